"""One GRPO step, sess vs TRL's GRPOTrainer, on the same work: wall-time ratio.

Same model (smollm2-135m, the cached transformers directory sess converted), the same P prompts
(arithmetic questions), group size G, completion length T (at most T tokens, stopping at EOS on
both sides), temperature 1, LoRA rank r on the same modules (attention + MLP: TRL cannot put LoRA on lm_head), one optimizer
step, CPU. TRL runs with use_cpu=True,
beta=0 (no reference model), loss on all P x G completions in one step. The sess step is the seed
loop: P sample requests (K=G each), rewards, forward_backward(ppo), optim_step,
save_weights_and_get_sampling_client. Each side runs a warm-up step first; the next steps are timed
and the median is reported. Needs `pip install trl` (not a dependency of sess).

sess runs in this process, with the malloc settings of an engine process (engine/memory.py). TRL
runs in a process of its own, once as users run it (glibc's default malloc) and once with the same
settings as sess, so the table shows how much of the gap is the allocator; ``--trl inprocess`` runs it
in this process on the engine's thread instead.

    python benchmarks/grpo_vs_trl.py
    python benchmarks/grpo_vs_trl.py --model tiny-llama --steps 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("WANDB_DISABLED", "true")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from sess.engine import AdamParams, Datum, ModelInput, SamplingParams, ServiceClient  # noqa: E402
from sess.engine.runtime.memory.malloc_tuning import ENGINE_MALLOC, engine_env  # noqa: E402
from sess.engine.runtime.models.catalog import load_model, lora_targets, prepare  # noqa: E402

from common import as_engine_process, on_engine  # noqa: E402


def questions(n: int) -> list[tuple[str, int]]:
    rng = np.random.default_rng(0)
    pairs = rng.integers(1, 50, size=(n, 2))
    return [
        (f"What is {a} + {b}? Give the final answer as 'Answer: <number>'.", int(a + b)) for a, b in pairs
    ]


def reward_of(text: str, truth: int) -> float:
    digits = "".join(c if c.isdigit() else " " for c in text).split()
    return 1.0 if digits and int(digits[-1]) == truth else 0.0


def sess_steps(args, prompts_text, truths, steps: int) -> list[float]:
    svc = ServiceClient("inproc", home=args.home)
    tc = svc.create_lora_training_client(
        args.model, rank=args.rank, alpha=2 * args.rank, seed=0, train_unembed=False
    )
    tok = tc.get_tokenizer()
    prompts = [
        list(
            tok.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        for q in prompts_text
    ]
    sampler = tc.create_sampling_client()
    times = []
    for step in range(steps + 1):
        start = time.perf_counter()
        futures = [
            sampler.sample(
                p,
                num_samples=args.group,
                sampling_params=SamplingParams(
                    max_tokens=args.completion, temperature=1.0, seed=step * 100 + i
                ),
            )
            for i, p in enumerate(prompts)
        ]
        datums = []
        for prompt, truth, future in zip(prompts, truths, futures):
            seqs = future.result().sequences
            rewards = np.array([reward_of(tok.decode(s.tokens), truth) for s in seqs])
            advantages = rewards - rewards.mean()
            for s, a in zip(seqs, advantages):
                tokens = prompt + s.tokens
                n = len(prompt) - 1
                datums.append(
                    Datum(
                        ModelInput.from_ints(tokens[:-1]),
                        {
                            "target_tokens": np.array(tokens[1:]),
                            "logprobs": np.array([0.0] * n + s.logprobs, np.float32),
                            "advantages": np.array([0.0] * n + [a] * len(s.tokens), np.float32),
                        },
                    )
                )
        tc.forward_backward(datums, "ppo")
        tc.optim_step(AdamParams(learning_rate=1e-5)).result()
        sampler = tc.save_weights_and_get_sampling_client()
        if step:
            times.append(time.perf_counter() - start)
    tc.stop()
    svc.close()
    return times


def trl_steps(args, prompts_text, truths, steps: int) -> list[float]:
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    path = prepare(args.model, args.home)
    model, _, _ = load_model(args.model, home=args.home)
    tokenizer = AutoTokenizer.from_pretrained(path)
    truth_of = dict(zip(prompts_text, truths))

    def reward(prompts, completions, **kwargs):
        return [
            reward_of(c[-1]["content"] if isinstance(c, list) else c, truth_of[_question(p)])
            for p, c in zip(prompts, completions)
        ]

    data = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": q}]} for q in prompts_text] * (steps + 1)
    )
    config = GRPOConfig(
        output_dir="/tmp/sess-grpo-vs-trl",
        use_cpu=True,
        per_device_train_batch_size=args.prompts * args.group,
        num_generations=args.group,
        max_completion_length=args.completion,
        temperature=1.0,
        top_k=0,
        beta=0.0,
        learning_rate=1e-5,
        max_steps=steps + 1,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        bf16=False,
        disable_dropout=True,
    )
    targets = lora_targets(model, train_attn=True, train_mlp=True, train_unembed=False)
    peft_config = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0, **targets)
    times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.start = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.start)

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=data,
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=[Timer()],
    )
    trainer.train()
    return times[1:]


def _question(prompt) -> str:
    return prompt[-1]["content"] if isinstance(prompt, list) else prompt


TRL_SETTINGS = {
    "default": "TRL GRPOTrainer (default malloc, as users run it)",
    "engine": "TRL GRPOTrainer (with the engine's malloc settings)",
    "inprocess": "TRL GRPOTrainer (in this process, on the engine's thread)",
}


def trl_in_child(args, settings: str) -> list[float]:
    """TRL's step times from a process of its own: with glibc's default malloc (``default``, how a
    user runs TRL) or with the settings sess gives its engine processes (``engine``)."""
    plain = {k: v for k, v in os.environ.items() if k not in ENGINE_MALLOC}
    env = engine_env(plain) if settings == "engine" else {**plain, "SESS_MALLOC": "system"}
    command = [sys.executable, os.path.abspath(__file__), "--trl-child", "--model", args.model]
    command += ["--prompts", str(args.prompts), "--group", str(args.group), "--steps", str(args.steps)]
    command += ["--completion", str(args.completion), "--rank", str(args.rank)]
    command += ["--home", args.home] if args.home else []
    out = subprocess.run(command, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"TRL run failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--completion", type=int, default=32)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per side (after one warm-up)")
    parser.add_argument("--home", default=None)
    parser.add_argument(
        "--trl",
        default="default,engine",
        help="TRL runs, comma-separated: default (own process, default malloc), engine (own process, "
        "the engine's malloc settings), inprocess (this process, on the engine's thread)",
    )
    parser.add_argument("--trl-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.manual_seed(0)
    pairs = questions(args.prompts)
    prompts_text, truths = [q for q, _ in pairs], [t for _, t in pairs]
    if args.trl_child:
        print(json.dumps(trl_steps(args, prompts_text, truths, args.steps)))
        return
    as_engine_process()
    sess_t = sess_steps(args, prompts_text, truths, args.steps)
    s = statistics.median(sess_t)
    table = Table(
        title=f"one GRPO step: {args.model}, {args.prompts} prompts x {args.group}, {args.completion} tokens, LoRA r{args.rank}"
    )
    for col in ("", "median step s", "steps timed", "sess / this"):
        table.add_column(col)
    table.add_row("sess (engine malloc settings)", f"{s:.1f}", str(len(sess_t)), "")
    for settings in filter(None, args.trl.split(",")):
        if settings == "inprocess":  # the engine's thread (one OpenMP team, see common.py) and heap
            svc = ServiceClient("inproc", home=args.home)
            trl_t = on_engine(svc, trl_steps, args, prompts_text, truths, args.steps)
            svc.close()
        else:
            trl_t = trl_in_child(args, settings)
        t = statistics.median(trl_t)
        table.add_row(TRL_SETTINGS[settings], f"{t:.1f}", str(len(trl_t)), f"{s / t:.2f}")
    Console().print(table)


if __name__ == "__main__":
    main()
