"""A multi-turn RL step's sampling with the sampler's prefix cache and without it, paired, in one run.

The environment is guess-a-number: the policy guesses a whole number from 1 to 100, the env answers
"Higher." or "Lower." until it is found or the turns run out (reward 1 when found, else 1 minus the
last guess's distance over 100). Each turn is sampled from the whole conversation so far
(:func:`sess.rl.rollouts.rollout_groups`), so a turn's prompt begins with the previous turn's prompt
and reply: what the prefix cache serves, beside the group's shared first prompt.

Each step samples the same rollouts twice from one sampler, with the same seeds: once with the
cache on and once off (``SESS_PREFIX_CACHE``, which the sampler reads per request; the order
alternates between steps), and checks that both give the same tokens. A run with the cache off
keeps no entries, and every step trains (``forward_backward`` with the ``ppo`` loss, then
``optim_step``) and samples the next from new weights, whose entries are apart from the last step's:
so the run with the cache on is served only by the entries it made itself, as in a real run. It
prints per step the prompt tokens sent, those not computed (``prompt_cache_hit_tokens``) with the
cache and without it (without it, a prefill still computes a prefix that the prompts of one request
batch share once: a group's first prompt), the sampling seconds of each side, and their medians (after one uncounted
warm-up step each way); it asserts nothing about time.

    python benchmarks/prefix_cache_multiturn.py
    python benchmarks/prefix_cache_multiturn.py --model tiny-llama --steps 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from sess.engine import AdamParams, SamplingParams
from sess.rl import rollouts
from sess.rl.env import Env, StepResult

from common import as_engine_process, in_process_client


class GuessNumber(Env):
    """Guess the secret number; the env says higher or lower after each wrong guess."""

    def __init__(self, secret: int):
        self.secret, self.turn = secret, 0

    def initial_observation(self) -> list[dict]:
        ask = "I am thinking of a whole number from 1 to 100. Guess it: reply with one number only."
        return [{"role": "user", "content": ask}]

    def step(self, message: str) -> StepResult:
        self.turn += 1
        digits = "".join(c if c.isdigit() else " " for c in message).split()
        guess = int(digits[0]) if digits else None
        if guess == self.secret:
            return StepResult(1.0, True, metrics={"found": 1.0})
        if self.turn >= self.max_turns:
            near = 0.0 if guess is None else max(0.0, 1 - abs(guess - self.secret) / 100)
            return StepResult(near, True, metrics={"found": 0.0})
        hint = "Reply with one number." if guess is None else "Higher." if guess < self.secret else "Lower."
        return StepResult(0.0, False, [{"role": "user", "content": hint}])


class Counted:
    """A sampling client that adds up each response's ``prompt_cache_hit_tokens`` and prompt tokens,
    and keeps the sampled tokens."""

    def __init__(self, sc):
        self.sc, self.prompt, self.cached, self.tokens = sc, 0, 0, []

    def sample(self, prompt, num_samples, params, **asked):
        self.prompt += len(prompt)
        return _Reading(self, self.sc.sample(prompt, num_samples, params, **asked))


class _Reading:
    def __init__(self, counted: Counted, future):
        self.counted, self.future = counted, future

    def result(self):
        response = self.future.result()
        self.counted.cached += response.prompt_cache_hit_tokens
        self.counted.tokens.append([list(s.tokens) for s in response.sequences])
        return response


def sample_with(cache_on: bool, sc, tok, secrets: list[int], args, step: int):
    os.environ["SESS_PREFIX_CACHE"] = "1" if cache_on else "0"
    counted = Counted(sc)
    envs = [[GuessNumber(secret) for _ in range(args.group_size)] for secret in secrets]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0)
    seeds = [1000 * step + i for i in range(len(secrets))]
    started = time.perf_counter()
    groups = rollouts.rollout_groups(counted, tok, envs, params, seeds, max_turns=args.turns)
    return groups, counted, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--steps", type=int, default=4, help="steps, each sampled with and without the cache")
    parser.add_argument("--groups", type=int, default=2, help="problems (secret numbers) per step")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4, help="replies per episode at most")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens per reply at most")
    parser.add_argument("--home", default=None)
    args = parser.parse_args()
    as_engine_process()
    svc = in_process_client(args.home)
    tc = svc.create_lora_training_client(args.model, rank=16, alpha=32, seed=0)
    tok = tc.get_tokenizer()
    sc = tc.save_weights_and_get_sampling_client()
    rng = np.random.default_rng(0)
    for on in (True, False):  # warm-up, not counted: the first requests pay for one-time setup
        sample_with(on, sc, tok, [50] * args.groups, args, step=args.steps)
    rows = []
    for step in range(args.steps):
        secrets = [int(x) for x in rng.integers(1, 101, args.groups)]
        order = (True, False) if step % 2 == 0 else (False, True)
        runs = {on: sample_with(on, sc, tok, secrets, args, step) for on in order}
        (groups, on, on_s), (_, off, off_s) = runs[True], runs[False]
        assert on.tokens == off.tokens, "the prefix cache changed the sampled tokens"
        turns = float(np.mean([e.turns for g in groups for e in g.episodes_G]))
        rows.append(
            (step, "on, off" if order[0] else "off, on", on.prompt, on.cached, off.cached, on_s, off_s)
        )
        print(
            f"step {step} ({rows[-1][1]}): prompt tokens {on.prompt}, not computed {on.cached} with the "
            f"cache ({on.cached / on.prompt:.0%}), {off.cached} without; turns/episode {turns:.1f}, "
            f"sampling {on_s:.2f} s with the cache, {off_s:.2f} s without ({on_s / off_s:.2f}x)",
            flush=True,
        )
        datums = rollouts.batch_datums(groups)
        if datums:
            tc.forward_backward(datums, "ppo").result()
        tc.optim_step(AdamParams(learning_rate=1e-4)).result()
        sc = tc.save_weights_and_get_sampling_client()
    on_s, off_s = statistics.median(r[5] for r in rows), statistics.median(r[6] for r in rows)
    prompt, cached, shared = (sum(r[i] for r in rows) for i in (2, 3, 4))
    print(
        f"{args.model}, {args.groups} groups x {args.group_size}, up to {args.turns} turns of "
        f"{args.max_tokens} tokens, {args.steps} steps: of {prompt} prompt tokens, {cached} not computed "
        f"with the cache ({cached / prompt:.0%}, {cached / len(rows):.0f} a step), {shared} without "
        f"({shared / prompt:.0%}); median sampling per step "
        f"{on_s:.2f} s with the cache, {off_s:.2f} s without ({on_s / off_s:.2f}x); same tokens both ways"
    )
    tc.stop()
    svc.close()


if __name__ == "__main__":
    main()
