"""Long context: forward_backward time and peak memory of one sequence of 1K to 8K tokens, and the
sampler's prefill of long prompts against its matmul floor and HF ``generate``.

Each length runs in a fresh engine process (so each peak RSS, VmHWM, is that length's alone): one
warm-up ``forward_backward`` of 64 tokens (model load, the activation probe), then one of the
length, timed, with the engine's defaults unless ``--memory-budget`` is given. Prints seconds,
tokens/s, peak RSS and the growth of the peak per 1K tokens between lengths (linear memory: a flat
slope). The output layer never holds a sequence's whole logits; a sequence longer than the budget's
micro-batches runs with activation checkpointing (docs/engine.md, Memory).

    python benchmarks/long_context.py                              # smollm2-135m, 1K 2K 4K 8K
    python benchmarks/long_context.py --model tiny-llama --lengths 256,512
    python benchmarks/long_context.py --model tiny-qwen3-32k --lengths 8192,16384,32768
    python benchmarks/long_context.py --memory-budget 1500M
    python benchmarks/long_context.py --prefill                    # smollm2-135m, 2K and 8K prompts
    python benchmarks/long_context.py --all       # smollm2 1K-8K, tiny-qwen3-32k 8K-32K, then --prefill

``--prefill``: in one process, a 16-token greedy sample after a prompt of each length (the
prompt's prefill timed apart, and where it went: projections, attention, the rest), the floor
(the prefill's FLOPs at the rate ``torch.mm`` reaches in this process on a [length x hidden] by
[hidden x intermediate] product, attention's FLOPs included) and HF ``generate`` of the same 16
tokens on the same model and adapter, on the engine's thread (``common.py`` says why).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import numpy as np  # noqa: E402

from sess.engine import AdamParams, Datum, ModelInput  # noqa: E402

from common import (  # noqa: E402
    CallTimes,
    add_device_options,
    as_engine_process,
    in_process_client,
    memory_status,
    on_engine,
    patched,
)


def _datum(vocab: int, length: int, seed: int) -> Datum:
    tokens = np.random.default_rng(seed).integers(10, vocab - 10, length + 1)
    inputs = {"target_tokens": tokens[1:], "weights": np.ones(length, np.float32)}
    return Datum(ModelInput.from_ints(tokens[:-1].tolist()), inputs)


def one_length(args) -> dict:
    """Time one ``forward_backward`` of ``args.length`` tokens in this process."""
    svc = in_process_client(args.home, args.device, args.dtype, args.memory_budget)
    tc = svc.create_lora_training_client(args.model, rank=8, alpha=16, seed=0)
    vocab = len(tc.get_tokenizer())
    tc.forward_backward([_datum(vocab, 64, 0)], "cross_entropy").result()
    started = time.perf_counter()
    out = tc.forward_backward([_datum(vocab, args.length, 1)], "cross_entropy").result()
    seconds = time.perf_counter() - started
    assert np.isfinite(out.metrics["loss:sum"])
    peak = memory_status()["VmHWM"]  # before the floor's own matrices
    config = svc.transport.engine.runtime.hosts[args.model].model.config
    rate = mm_rate(min(args.length, 2048), config.hidden_size, config.intermediate_size)
    floor = training_flops(config, args.length) / rate
    return {"length": args.length, "seconds": seconds, "peak_rss": peak, "floor": floor, "rate": rate}


def mm_rate(rows: int, inner: int, outer: int, repeats: int = 5) -> float:
    """FLOP/s of ``torch.mm`` [rows x inner] @ [inner x outer] in fp32 on this thread, the median."""
    import statistics

    import torch

    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(rows, inner, generator=gen), torch.randn(inner, outer, generator=gen)
    times = []
    for _ in range(repeats + 1):  # the first call warms the thread team and the pages
        start = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - start)
    return 2 * rows * inner * outer / statistics.median(times[1:])


def prefill_flops(config, length: int) -> float:
    """FLOPs of one prefill of ``length`` tokens: every projection on every token, attention over
    each token's columns up to it (scores and values: 4 x head dim per head and column), and the
    output layer on the last token."""
    hidden, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = getattr(config, "head_dim", None) or hidden // heads
    per_layer = hidden * (heads * dim) * 2 + 2 * hidden * kv_heads * dim + 3 * hidden * inter
    attention = 4 * heads * dim * length * (length + 1) / 2
    return layers * (2 * per_layer * length + attention) + 2 * hidden * config.vocab_size


def training_flops(config, length: int) -> float:
    """FLOPs of one ``forward_backward`` of ``length`` tokens at its least: the forward (every
    projection, causal attention and the output layer on every token) and the backward's input
    gradients (as many FLOPs as the forward's matmuls; attention's backward twice its forward); the
    LoRA weights' own gradients (rank 8) and any recomputation left out."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    heads = config.num_attention_heads
    dim = getattr(config, "head_dim", None) or hidden // heads
    attention = layers * 4 * heads * dim * length * (length + 1) / 2
    output = 2 * hidden * config.vocab_size * length
    matmuls = prefill_flops(config, length) - attention - 2 * hidden * config.vocab_size + output
    return 2 * matmuls + 3 * attention


def prefill_rates(args) -> None:
    """Prefill tokens/s of a 16-token sample after each prompt length, its floor and HF ``generate``."""
    import torch

    from sess.engine import SamplingParams
    from sess.engine.sampling import fused_ops, row_invariant

    svc = in_process_client(args.home, args.device, args.dtype, args.memory_budget)
    tc = svc.create_lora_training_client(args.model, rank=8, alpha=16, seed=0)
    vocab = len(tc.get_tokenizer())
    tc.forward_backward([_datum(vocab, 64, 0)], "cross_entropy").result()
    tc.optim_step(AdamParams(learning_rate=1e-3)).result()  # LoRA B off zero: the adapter counts
    sc = tc.save_weights_and_get_sampling_client()
    runtime = svc.transport.engine.runtime
    host = runtime.hosts[args.model]
    adapter = host.checkpoint_adapters[sc.model_path]
    config = host.model.config
    params = SamplingParams(max_tokens=16, temperature=0.0)
    sc.sample(_datum(vocab, 32, 2).model_input, sampling_params=params).result()  # warm-up
    decoder = type(host.decoder)
    times = CallTimes()
    parts = (
        (decoder, "prefill", "prefill"),
        (row_invariant, "rowwise", "projections"),
        (fused_ops, "prefill_attend", "attention"),
    )
    print(f"{args.model}, {torch.get_num_threads()} threads, 16 greedy tokens after each prompt")
    window = host.max_context
    for length in (min(int(n), window - 16) for n in args.lengths.split(",")):  # room for 16 more
        prompt = _datum(vocab, length, 10 + length).model_input  # fresh tokens: no prefix cached
        ids = torch.tensor([prompt.to_ints()])
        times.seconds.clear()
        with patched((owner, name, times.wrap(part, getattr(owner, name))) for owner, name, part in parts):
            started = time.perf_counter()
            sess_tokens = sc.sample(prompt, sampling_params=params).result().sequences[0].tokens
            sess_seconds = time.perf_counter() - started
        hidden, inter = config.hidden_size, config.intermediate_size
        rate = on_engine(svc, mm_rate, length, hidden, inter)

        def hf(ids=ids, length=length):
            with host.activate(adapter) as model, torch.no_grad():
                started = time.perf_counter()
                out = model.generate(input_ids=ids, do_sample=False, max_new_tokens=16, min_new_tokens=16)
                return time.perf_counter() - started, out[0, length:].tolist()

        hf_seconds, hf_tokens = on_engine(svc, hf)
        prefill = times.seconds["prefill"]
        floor = prefill_flops(config, length) / rate
        inner = ", ".join(
            f"{key.split('/')[-1]} {s:.2f} s"
            for key, s in times.seconds.items()
            if key.startswith("prefill/")
        )
        print(
            f"{length:>6} tokens: prefill {prefill:.2f} s = {length / prefill:.0f} tok/s ({inner}); "
            f"floor {floor:.2f} s = {length / floor:.0f} tok/s at {rate / 1e9:.0f} GFLOP/s "
            f"(torch.mm {length}x{hidden}x{inter}), prefill at {floor / prefill:.2f} of the floor; "
            f"sample 16 tokens {sess_seconds:.2f} s vs HF generate {hf_seconds:.2f} s "
            f"({hf_seconds / sess_seconds:.2f}x; same tokens: {sess_tokens == hf_tokens})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--lengths", default="1024,2048,4096,8192", help="comma-separated token counts")
    parser.add_argument("--home", default=None, help="SESS_HOME (default: the usual)")
    parser.add_argument("--length", type=int, default=None, help=argparse.SUPPRESS)  # one length, as JSON
    parser.add_argument("--prefill", action="store_true", help="the sampler's prefill (lengths: 2048,8192)")
    parser.add_argument(
        "--all",
        action="store_true",
        help="the section's three runs: smollm2 1K-8K, tiny-qwen3-32k 8K-32K, --prefill",
    )
    add_device_options(parser)
    args = parser.parse_args()
    if args.all:
        rest = [a for a in sys.argv[1:] if a != "--all"]
        for extra in (
            ["--model", "smollm2-135m"],
            ["--model", "tiny-qwen3-32k", "--lengths", "8192,16384,32768"],
            ["--prefill"],
        ):
            sys.stdout.flush()
            subprocess.run([sys.executable, __file__, *rest, *extra], check=True)
        return
    if args.prefill:
        as_engine_process(args.device)
        if "--lengths" not in sys.argv:
            args.lengths = "2048,8192"
        prefill_rates(args)
        return
    if args.length is not None:
        as_engine_process(args.device)
        print(json.dumps(one_length(args)))
        return
    rows = []
    for length in (int(n) for n in args.lengths.split(",")):
        command = [sys.executable, __file__, *sys.argv[1:], "--length", str(length)]
        answer = subprocess.run(command, capture_output=True, text=True)
        if answer.returncode != 0:
            sys.exit(f"length {length}: {answer.stderr.strip().splitlines()[-1]}")
        rows.append(json.loads(answer.stdout.strip().splitlines()[-1]))
    print(f"{args.model}, memory budget {args.memory_budget or 'default'}")
    print(
        f"{'tokens':>7} {'seconds':>8} {'tokens/s':>9} {'peak RSS':>10} {'MB per 1K more':>15} {'floor s':>8} {'of floor':>8}"
    )
    for i, row in enumerate(rows):
        slope = ""
        if i:
            grown = (row["peak_rss"] - rows[i - 1]["peak_rss"]) / 2**20
            slope = f"{grown / ((row['length'] - rows[i - 1]['length']) / 1024):.0f}"
        rate = row["length"] / row["seconds"]
        print(
            f"{row['length']:>7} {row['seconds']:>8.2f} {rate:>9.0f} {row['peak_rss'] / 2**30:>8.2f}GB {slope:>15}"
            f" {row['floor']:>8.2f} {row['floor'] / row['seconds']:>8.2f}"
        )
    print(
        "floor: the FLOPs of a forward and its input gradients at the rate torch.mm reached in the same process"
    )


if __name__ == "__main__":
    main()
