"""Sampling throughput: sess's continuous-batching sampler vs HF ``generate`` on the same LoRA model.

Prints a table of new tokens/s and ratios, all measured in this one process on the same model,
prompts, num_samples, max_tokens and temperature:

1. batch: P prompts x K samples x T new tokens (default 8 x 8 x 64, temperature 0.7), the median
   of ``--rounds`` rounds (default 3) after a first batch that is shown apart: a new process's
   first batch grows its heap into memory the process never had, whose first touch costs a
   virtual machine far more than the batches after it pay (as the floor's first pass is not
   timed either);
2. latency: 1 prompt x 1 sample, with the GB/s of weights it reads beside the memory bandwidth
   measured in the same process (a large read: ``common.memory_bandwidth``);
3. adapters: 8 concurrent requests from 4 sessions with different adapters vs the same requests
   served one at a time;
4. prefill sharing: a long prompt sampled with num_samples=1 and num_samples=K (1 new token each),
   for sess and HF: the time ratio K/1 and the engine's recorded prefill tokens; and one prefill
   of the batch's P chat prompts (which share their system prompt) in each of the engine's forms,
   alternated: torch attention and the attention kernel on each prompt whole, and the default, the
   shared prefix computed once;
5. the matmul floor: the time of one decode step's base-model linear layers alone (P x K rows,
   fp32, oneDNN as the sampler runs it: with prepacked weights where the engine's memory budget
   holds the copies, as at ``--memory-budget 1G`` for smollm2; every layer in model order, so each weight streams from
   memory as in a real step), as the tokens/s of a sampler that did nothing else and its ratio to
   HF. No fp32 sampler on these kernels, which run near this CPU's fp32 peak, can beat that ratio;
   the gap between it and sess is what attention, LoRA, norms, token selection and overhead cost.
   Each batch round is followed at once by a floor measurement, and the batch's fraction of the
   floor is the median of the rounds' own ratios (a shared host's speed drifts between minutes).
   Beside it, where that round's time went (:class:`BatchParts`): the prefill (of it the cache
   fill), the decode steps, token choice, rows leaving the batch, and the rest.

    python benchmarks/sampling.py                      # smollm2-135m, the acceptance setting
    python benchmarks/sampling.py --model tiny-llama   # a quick check
    python benchmarks/sampling.py --dtype bfloat16 --skip latency,adapters,prefill   # bf16 batch
    python benchmarks/sampling.py --device cuda        # on a GPU (no matmul floor: it is oneDNN's)
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from types import SimpleNamespace

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from sess.engine import AdamParams, SamplingParams  # noqa: E402
from sess.engine.sampling import block_cache, decode_batch, prefill_layout  # noqa: E402

from common import (  # noqa: E402
    CallTimes,
    add_device_options,
    as_engine_process,
    clock,
    in_process_client,
    memory_bandwidth,
    on_engine,
    patched,
    weight_bytes,
)

TOPICS = [
    "the sea",
    "a robot",
    "winter",
    "a city at night",
    "an old library",
    "mountains",
    "a cat",
    "the moon",
]


def prompts_for(tok, n: int) -> list[list[int]]:
    chats = [
        [{"role": "user", "content": f"Write a long, detailed story about {TOPICS[i % len(TOPICS)]}."}]
        for i in range(n)
    ]
    return [
        list(tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False))
        for c in chats
    ]


def sess_batch(sc, prompts, k, params) -> tuple[int, float]:
    start = time.perf_counter()
    futures = [sc.sample(p, num_samples=k, sampling_params=params) for p in prompts]
    results = [f.result() for f in futures]
    elapsed = time.perf_counter() - start
    return sum(len(s.tokens) for r in results for s in r.sequences), elapsed


def hf_batch(model, tok, prompts, k, max_tokens, temperature) -> tuple[int, float]:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=temperature > 0,
            temperature=temperature if temperature > 0 else None,
            top_p=1.0,
            top_k=0,
            max_new_tokens=max_tokens,
            num_return_sequences=k,
            pad_token_id=tok.pad_token_id,
        )
    elapsed = time.perf_counter() - start
    new = out[:, width:]
    eos = set(
        model.generation_config.eos_token_id
        if isinstance(model.generation_config.eos_token_id, list)
        else [model.generation_config.eos_token_id]
    )
    count = 0
    for row in new.tolist():  # count tokens up to and including the first EOS, like sess
        for i, t in enumerate(row):
            if t in eos:
                count += i + 1
                break
        else:
            count += len(row)
    return count, elapsed


class BatchParts(CallTimes):
    """Where a batch's wall time goes, timed by wrapping the decode batch's calls in this process:
    the prefill of joining requests with their first tokens (of it, the cache fill), the decode
    steps (the decoder's forward), token choice after each step, and rows leaving the batch (the
    cache kept for the rest)."""

    def __init__(self, decoder):
        super().__init__()
        self.targets = (  # (owner, attribute, part)
            (decode_batch.DecodeBatch, "_join", "prefill"),
            (block_cache.BlockCache, "from_prompts", "cache fill"),
            (type(decoder), "step", "decode steps"),
            (decode_batch, "choose", "token choice"),
            (block_cache.BlockCache, "keep", "rows leaving"),
        )

    def timing(self):
        """Time the calls while the block runs, from zero."""
        self.seconds.clear()
        self.calls.clear()
        return patched(
            (owner, name, self.wrap(part, getattr(owner, name))) for owner, name, part in self.targets
        )

    def summary(self, total: float) -> str:
        """The parts as seconds and shares of ``total`` (the batch's wall time)."""
        top = {key: s for key, s in self.seconds.items() if "/" not in key}
        parts = []
        for key, seconds in sorted(top.items(), key=lambda item: -item[1]):
            inner = [
                f"{k.split('/')[-1]} {s:.2f} s" for k, s in self.seconds.items() if k.startswith(key + "/")
            ]
            of_it = f", of it {', '.join(inner)}" if inner else ""
            parts.append(f"{key} {seconds:.2f} s ({seconds / total:.0%}, {self.calls[key]} calls{of_it})")
        rest = total - sum(top.values())
        return (
            "; ".join(parts) + f"; the rest {rest:.2f} s ({rest / total:.0%}: requests, Python between calls)"
        )


def matmul_floor(host, rows: int, repeats: int = 7) -> float:
    """Median seconds for one pass of the base model's linear layers over ``rows`` rows, in model
    order, through the kernels the lean decoder uses (oneDNN; prepacked weights where the memory
    budget holds the copies, and at one or two rows the few-row kernel over them)."""
    linear = host.decoder.linear
    linear.packing(host.decoder.packs())  # as the decoder's own steps decide
    layers = [
        m for name, m in host.model.named_modules() if type(m) is torch.nn.Linear and "lora_" not in name
    ]
    gen = torch.Generator().manual_seed(0)
    inputs = {n: torch.randn(rows, n, generator=gen) for n in {m.in_features for m in layers}}
    times = []
    with torch.no_grad():
        for _ in range(repeats + 1):  # the first pass packs any weight not yet packed
            start = clock()
            for m in layers:
                linear(inputs[m.in_features], m.weight, m.bias)
            times.append(clock() - start)
    return statistics.median(times[1:])


def prefill_forms(
    host, adapter: str, prompts: list[list[int]], samples: int, repeats: int = 7
) -> dict[str, float]:
    """Median seconds of one prefill of ``prompts`` (``samples`` each), the engine's three forms
    alternated in this process: each prompt whole through torch's attention (where the C kernels
    are not built), each prompt whole through the attention kernel, and the engine's default, a
    prefix the prompts share computed once (:class:`~sess.engine.sampling.prefill_layout.Layout`)."""
    decoder = host.decoder
    if not (decoder.uses_kernels() and decoder.attention_kernel):
        return {}
    jobs = [
        SimpleNamespace(
            prompt=p, num_samples=samples, adapter=adapter, prompt_logprobs=False, params=SamplingParams()
        )
        for p in prompts
    ]
    layout = prefill_layout.Layout.of
    forms = {
        "torch attention, each prompt whole": [(decoder, "attention_kernel", False)],
        "attention kernel, each prompt whole": [
            (prefill_layout.Layout, "of", lambda jobs, share: layout(jobs, False))
        ],
        "attention kernel, shared prefix once": [],
    }
    times = {name: [] for name in forms}
    for _ in range(repeats + 1):  # the first round warms each form
        for name, changes in forms.items():
            with patched(changes):
                start = time.perf_counter()
                decoder.prefill(jobs)
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t[1:]) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument(
        "--rounds", type=int, default=3, help="batch rounds, each followed by the floor (the median is shown)"
    )
    parser.add_argument("--home", default=None, help="engine home (default: SESS_HOME or ~/.sess)")
    parser.add_argument(
        "--skip", default="", help="comma list of parts to skip: batch,latency,adapters,prefill"
    )
    add_device_options(parser)
    args = parser.parse_args()
    as_engine_process(args.device)
    skip = set(filter(None, args.skip.split(",")))
    console = Console()
    svc = in_process_client(args.home, args.device, args.dtype, args.memory_budget)
    runtime = svc.transport.engine.runtime
    sessions = [svc.create_lora_training_client(args.model, rank=args.rank, seed=i) for i in range(4)]
    tok = sessions[0].get_tokenizer()
    prompts = prompts_for(tok, args.prompts)
    # give every adapter its own non-zero weights (LoRA B starts at 0)
    for i, tc in enumerate(sessions):
        tc.forward_backward([prompts[i % len(prompts)] + tok.encode(" Once upon a time")]).result()
        tc.optim_step(AdamParams(learning_rate=1e-3)).result()
    samplers = [tc.save_weights_and_get_sampling_client() for tc in sessions]
    sc = samplers[0]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=0)
    sc.sample(prompts[0], sampling_params=SamplingParams(max_tokens=2)).result()  # warm-up

    host = runtime.hosts[args.model]
    adapter = host.checkpoint_adapters[sc.model_path]
    table = Table(
        title=f"sampling on {args.model} ({host.dtype}, {args.device}; LoRA rank {args.rank}, "
        f"{torch.get_num_threads()} threads)"
    )
    for col in ("case", "sess tok/s", "baseline tok/s", "ratio"):
        table.add_column(col)
    figures = {}
    notes: list[str] = []

    def hf(prompts_, k, max_tokens=args.max_tokens, temperature=args.temperature):
        def run():
            with host.activate(adapter) as model:
                return hf_batch(model, tok, prompts_, k, max_tokens, temperature)

        return on_engine(svc, run)  # on the engine's thread: see common.py

    floor_here = args.device == "cpu" and host.dtype == torch.float32
    if "batch" not in skip:
        rows = args.prompts * args.samples
        # each round: the batch, then the floor at once, so both see the same state of a shared host
        rounds = []
        parts = BatchParts(host.decoder)
        if floor_here:  # the floor's first pass packs the base weights (merged plans do not use
            # them): done before the first batch, its copies do not take the heap a batch freed
            on_engine(svc, matmul_floor, host, rows, 1)
        # the process's first batch is not a round, as the floor's first pass is not: it grows the
        # heap into memory the process never had (shown apart, below)
        with parts.timing():
            n_first, t_first = sess_batch(sc, prompts, args.samples, params)
        first = parts.summary(t_first)
        for _ in range(args.rounds):
            with parts.timing():
                n_sess, t_sess = sess_batch(sc, prompts, args.samples, params)
            floor = on_engine(svc, matmul_floor, host, rows) if floor_here else None
            rounds.append((n_sess, t_sess, floor, parts.summary(t_sess)))
        n_sess, t_sess, _, spent = sorted(rounds, key=lambda r: r[0] / r[1])[len(rounds) // 2]
        notes.append(f"where the middle round's {t_sess:.2f} s went: {spent}")
        notes.append(
            f"the process's first batch, before the rounds: {n_first / t_first:.1f} tok/s, {t_first:.2f} s: "
            f"{first.split('; the rest')[0]}"
        )
        n_hf, t_hf = hf(prompts, args.samples)
        figures["batch"] = (n_sess / t_sess) / (n_hf / t_hf)
        table.add_row(
            f"{args.prompts} prompts x {args.samples} samples x {args.max_tokens}",
            f"{n_sess / t_sess:.1f}",
            f"{n_hf / t_hf:.1f} (HF generate)",
            f"{figures['batch']:.2f}x",
        )
    if "batch" not in skip and floor_here:
        floor = statistics.median(f for _, _, f, _ in rounds)
        ratios = sorted((n / t) / (rows / f) for n, t, f, _ in rounds)
        table.add_row(
            f"matmul floor: base linears only, {rows} rows ({floor * 1e3:.1f} ms/step)",
            f"{rows / floor:.1f}",
            f"{n_hf / t_hf:.1f} (HF generate)",
            f"{(rows / floor) / (n_hf / t_hf):.2f}x",
        )
        notes.append(
            f"batch / floor: {statistics.median(ratios):.3f}, the median of {len(rounds)} rounds "
            f"({', '.join(f'{r:.3f}' for r in ratios)}), each round's batch against the floor measured "
            f"right after it"
        )
        notes.append(
            f"{3 * n_hf / t_hf:.0f} tok/s (3x HF) leaves {rows / (3 * n_hf / t_hf) * 1e3:.1f} ms per "
            f"{rows}-row step, its share of the prefill included; the base model's matmuls alone "
            f"take {floor * 1e3:.1f} ms of it; sess takes {t_sess / n_sess * rows * 1e3:.1f} ms per {rows} tokens."
        )
    if "latency" not in skip:
        n_sess, t_sess = sess_batch(sc, prompts[:1], 1, params)
        n_hf, t_hf = hf(prompts[:1], 1)
        table.add_row(
            "batch 1 (latency)",
            f"{n_sess / t_sess:.1f}",
            f"{n_hf / t_hf:.1f} (HF generate)",
            f"{(n_sess / t_sess) / (n_hf / t_hf):.2f}x",
        )
        if args.device == "cpu":  # a token reads every weight once: how near the memory's speed
            read, _ = on_engine(svc, memory_bandwidth)
            base, lora = weight_bytes(host, adapter)
            notes.append(
                f"batch 1 reads {(base + lora) / 1e6:.0f} MB of weights a token: sess "
                f"{(base + lora) * n_sess / t_sess / 1e9:.1f} GB/s, HF {(base + lora) * n_hf / t_hf / 1e9:.1f} GB/s, "
                f"against {read / 1e9:.1f} GB/s measured reading memory in this process"
            )
    if "adapters" not in skip:
        for s in samplers:  # load every checkpoint adapter before timing either side
            s.sample(prompts[0], sampling_params=SamplingParams(max_tokens=2)).result()
        requests = [(samplers[i % 4], prompts[i % len(prompts)]) for i in range(8)]
        p = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=1)
        start = time.perf_counter()
        futures = [s.sample(pr, num_samples=1, sampling_params=p) for s, pr in requests]
        n_conc = sum(len(f.result().sequences[0].tokens) for f in futures)
        t_conc = time.perf_counter() - start
        start = time.perf_counter()
        n_seq = sum(
            len(s.sample(pr, num_samples=1, sampling_params=p).result().sequences[0].tokens)
            for s, pr in requests
        )
        t_seq = time.perf_counter() - start
        figures["adapters"] = (n_conc / t_conc) / (n_seq / t_seq)
        table.add_row(
            "8 requests, 4 adapters",
            f"{n_conc / t_conc:.1f}",
            f"{n_seq / t_seq:.1f} (one by one)",
            f"{figures['adapters']:.2f}x",
        )
    if "prefill" not in skip:
        long_prompt = (tok.encode(" ".join(["The quick brown fox jumps over the lazy dog."] * 60)))[:512]
        one = SamplingParams(max_tokens=1, temperature=1.0, seed=0)
        before = svc.get_usage(sessions[0].name).prefill_tokens
        t1 = statistics.median(
            _timed(lambda: sc.sample(long_prompt, num_samples=1, sampling_params=one).result())
            for _ in range(3)
        )
        tk = statistics.median(
            _timed(lambda: sc.sample(long_prompt, num_samples=args.samples, sampling_params=one).result())
            for _ in range(3)
        )
        recorded = (svc.get_usage(sessions[0].name).prefill_tokens - before) / 6
        h1 = statistics.median(_timed(lambda: hf([long_prompt], 1, 1, 1.0)) for _ in range(3))
        hk = statistics.median(_timed(lambda: hf([long_prompt], args.samples, 1, 1.0)) for _ in range(3))
        forms = on_engine(svc, prefill_forms, host, adapter, prompts, args.samples)
        if forms:
            shared = len(os.path.commonprefix(prompts))
            notes.append(
                f"one prefill of the {len(prompts)} chat prompts ({sum(map(len, prompts))} tokens, the first "
                f"{shared} of each alike), median of 7 alternated rounds: "
                + "; ".join(f"{name} {t * 1e3:.0f} ms" for name, t in forms.items())
            )
        table.add_row(
            f"prefill {len(long_prompt)} tokens: K={args.samples} vs K=1 time",
            f"{tk / t1:.2f}x",
            f"{hk / h1:.2f}x (HF generate)",
            f"recorded prefill {recorded:.0f} tokens/request",
        )
    console.print(table)
    for note in notes:
        console.print(note)
    for tc in sessions:
        tc.stop()
    svc.close()


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


if __name__ == "__main__":
    main()
