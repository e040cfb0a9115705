"""A run's token and cost forecast from its resolved config: what ``sess run --dry-run`` prints.

An upper bound, counted the way the engine bills (:mod:`sess.engine.protocol.prices`): every prompt is
tokenized with the model's own tokenizer and chat template (the longest one the run can touch is
taken for each request), and every sampled reply is taken at ``loop.max_tokens``. Per step:

- grpo and code_rl: ``batch_size`` groups, each one sample request
  (the prompt prefilled once, ``group_size`` replies sampled), further turns one request per episode
  (prefill: the episode so far); one ``forward_backward`` over every episode in full (trained).
  code_rl samples ahead and resamples or drops stale groups, bounded by its config
  (:meth:`sess.rl.rollout_workers.RolloutWorkers.take_fresh` proves it): with ``C = batch_size *
  (max_steps_off_policy + 1)`` groups pending at most, at most ``steps * batch_size + (steps + 1) *
  C`` groups, and with ``stale_policy=requeue`` also at most ``(steps * batch_size + C) *
  (max_requeues + 1)``, whichever is less.
- sft: ``batch_size`` rendered chats, trained. Other loops get no forecast yet.
- evaluations (at the start, every ``eval_every`` steps, at the end): one greedy episode per held-out
  env (and ``eval_samples`` sampled ones), or a forward over the held-out chats.

Turns: ``loop.max_turns`` where the loop has it; otherwise one for an env that offers no tools (the
embedded arithmetic and GSM8K envs answer in one reply) and the rollouts' cap for the others. Later
turns add an observation of at most ``loop.max_observation_tokens`` tokens (the rollouts' default
where the loop has none): past it the rollouts end the episode (:mod:`sess.rl.rollouts`), so every
figure here is a bound the run cannot exceed, not an estimate.
"""

from __future__ import annotations

from dataclasses import dataclass

from sess.rl import rendering
from sess.rl.data import Data
from sess.rl.rollout_workers import check_requeue_limit
from sess.rl.rollouts import DEFAULT_MAX_TURNS, MAX_OBSERVATION_TOKENS, check_observation_cap
from sess.tasks import sources

ENV_LOOPS = ("grpo", "code_rl")


@dataclass
class Forecast:
    prefill: int = 0
    sampled: int = 0
    trained: int = 0

    def usage(self) -> dict:
        """As the engine's usage counts a sample of it (forward's tokens as prefill)."""
        return {
            "prefill_tokens": self.prefill,
            "sampled_tokens": self.sampled,
            "training_tokens": self.trained,
        }

    @property
    def tokens(self) -> int:
        return self.prefill + self.sampled + self.trained


def evaluations(steps: int, eval_every: int) -> int:
    """How many times the runner evaluates: at the start, every ``eval_every`` steps, at the end."""
    return 2 + sum(1 for done in range(1, steps) if eval_every and done % eval_every == 0)


def planned_steps(cfg, data: Data) -> int:
    """The steps the run's loop will do: ``loop.steps``, or fewer where SFT's ``epochs`` of a finite
    data set end it first (as :mod:`sess.loops.sft` counts them)."""
    loop, steps = cfg.loop, int(cfg.loop.steps)
    chats = data.chats if loop.name == "sft" else None
    if chats is not None and chats.size and loop.get("epochs"):
        steps = min(steps, max(1, int(loop.epochs) * chats.size // int(loop.batch_size)))
    return steps


def add_episodes(
    fc: Forecast, prompt: int, members: int, max_tokens: int, turns: int, observation: int, times: int = 1
) -> int:
    """Add ``times`` groups' sampling (each ``members`` episodes of at most ``turns`` replies, each
    later one after an observation of at most ``observation`` tokens); a group's longest episode."""
    fc.prefill += times * prompt
    fc.sampled += times * members * max_tokens
    longest = prompt + max_tokens
    for _ in range(1, turns):
        longest += observation
        fc.prefill += times * members * longest
        fc.sampled += times * members * max_tokens
        longest += max_tokens
    return longest


def prompt_size(tok, make_env) -> tuple[int, bool]:
    """(tokens of the first prompt, whether it offers tools) of the env ``make_env`` makes."""
    env = make_env()
    tools = [t.to_json() for t in env.tools] or None
    return len(rendering.prompt_tokens(tok, env.initial_observation(), tools)), bool(tools)


def forecast(cfg, tok, data: Data | None = None) -> Forecast:
    """The upper bound of the run ``cfg`` (a resolved config), its prompts tokenized by ``tok``."""
    loop = cfg.loop
    if loop.get("max_observation_tokens") is not None:  # the limits the bound rests on, checked first
        check_observation_cap(loop.max_observation_tokens)
    if loop.get("max_requeues") is not None:
        check_requeue_limit(loop.max_requeues)
    data = data or sources.load(cfg.data, int(cfg.seed), cfg.grader)
    # prompts sized to the model (data=needle): by this tokenizer; the window is the engine's to check
    data.fit_to(tok, cfg.model.base_model, None, int(loop.max_tokens))
    fc = Forecast()
    steps, batch = int(loop.steps), int(loop.batch_size)
    evals = evaluations(steps, int(cfg.get("eval_every") or 0))
    cap = loop.get("max_turns")
    observation = int(loop.get("max_observation_tokens") or MAX_OBSERVATION_TOKENS)
    if loop.name in ENV_LOOPS:
        envs = data.need("envs", loop.name)
        group, max_tokens = int(loop.group_size), int(loop.max_tokens)
        samples = problems = steps * batch
        if loop.name == "code_rl":  # sampled ahead (the pool's capacity), stale ones again or dropped
            capacity = batch * (int(loop.max_steps_off_policy) + 1)
            samples = problems = steps * batch + (steps + 1) * capacity
            if loop.stale_policy == "requeue":  # a problem is sampled again, not a new one drawn
                problems = steps * batch + capacity
                samples = min(samples, problems * (int(loop.max_requeues) + 1))
        prompts = [prompt_size(tok, envs.train(k)) for k in range(problems)]
        prompt = max(p for p, _ in prompts)
        turns = int(cap) if cap else (DEFAULT_MAX_TURNS if any(t for _, t in prompts) else 1)
        longest = add_episodes(fc, prompt, group, max_tokens, turns, observation, times=samples)
        fc.trained += steps * batch * group * longest
        held = [prompt_size(tok, make_env) for make_env in envs.held_out]
        if held:
            held_prompt = max(p for p, _ in held)
            sampled = int(cfg.get("eval_samples") or 0)
            times = evals * len(held)
            add_episodes(fc, held_prompt, 1, max_tokens, turns, observation, times=times)
            if sampled:
                add_episodes(fc, held_prompt, sampled, max_tokens, turns, observation, times=times)
        return fc
    if loop.name != "sft":
        raise ValueError(f"loop {loop.name}: forecasts cover sft, grpo and code_rl")
    chats = data.need("chats", loop.name)
    steps = planned_steps(cfg, data)
    for k in range(steps * batch):
        fc.trained += len(rendering.chat_tokens(tok, chats.train(k))[0])
    if data.envs is not None:  # the runner evaluates on envs when the data has them
        for make_env in data.envs.held_out:
            prompt, tools = prompt_size(tok, make_env)
            turns = int(cap) if cap else (DEFAULT_MAX_TURNS if tools else 1)
            add_episodes(fc, prompt, 1, int(loop.max_tokens), turns, observation, times=evals)
    elif data.chats is not None:
        held = sum(len(rendering.chat_tokens(tok, chat)[0]) for chat in data.chats.held_out)
        fc.prefill += evals * held
    return fc
