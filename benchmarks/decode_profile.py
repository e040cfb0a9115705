"""Where a decode step's time goes: matmuls, attention, LoRA, token choice, other ops, padding.

Drives the engine's own decoder (the lean llama decoder, as the sampler runs it at the engine's
settings) on a sampling client's adapter, step by step, at each batch size asked for (default 1
row and 64 rows: one request, and 8 prompts x 8 samples), and times each part of a step by
wrapping the decoder's calls in this process:

- projections: every projection and the lm_head (the lm_head also on its own line), through the
  base weights or, where the engine merges adapters' plans (an fp32 base on CPU), through the
  adapter's merged weights, its LoRA included;
- LoRA terms: each group of rows' ``B(A x)`` terms, where the plans are not merged;
- attention: the cache writes, the rotary embedding where the C kernel does it, and decode attention;
- token choice: drawing the token and its logprob from the logits (the decode batch's work);
  the steps run under the engine's sampling heap (``malloc_tuning.sampling_heap``), as its own do;
- other: the rest of the step (norms, rotary embeddings, residual adds, activations, the
  embedding, Python between ops), and of it the number of tensor ops a step dispatches;
- padding: matmul calls run on zero rows added to reach a calibrated row count.

A step of one or two rows runs as made-ready C calls (``engine/sampling/few_row_step.py``); its
few-row calls, lm_head and attention are timed the same way.

Beside them, measured in the same process: the matmul floor (the base linears alone over the same
rows, as in ``sampling.py``), the memory bandwidth (a large read and a large copy), and for each
batch size the bytes of weights a step must read and the GB/s the step achieves, and the share
of the read bandwidth a step reaches: (weights + the KV entries it reads) / bandwidth / step time.

    python benchmarks/decode_profile.py                    # smollm2-135m, 1 and 64 rows
    python benchmarks/decode_profile.py --rows 1,16,64 --steps 6
    python benchmarks/decode_profile.py --model tiny-llama # a quick check
"""

from __future__ import annotations

import argparse
import os
import statistics
from dataclasses import dataclass, field

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402
from sampling import matmul_floor, prompts_for  # noqa: E402

from sess.engine import AdamParams, SamplingParams  # noqa: E402
from sess.engine.runtime.memory.malloc_tuning import sampling_heap  # noqa: E402
from sess.engine.sampling import (  # noqa: E402
    block_cache,
    fused_ops,
    llama_decoder,
    lora_plans,
    row_invariant,
)
from sess.engine.sampling.few_row_step import FewRowStep  # noqa: E402
from sess.engine.sampling.token_choice import choose  # noqa: E402

from common import (  # noqa: E402
    CallTimes,
    add_device_options,
    as_engine_process,
    clock,
    in_process_client,
    memory_bandwidth,
    on_engine,
    patched,
    use_cpu_time,
    weight_bytes,
)

PARTS = ("projections", "of them lm_head", "LoRA terms", "attention", "token choice")


@dataclass
class Job:  # what the decoder's prefill reads of a sample request
    prompt: list[int]
    num_samples: int
    adapter: str | None
    prompt_logprobs: int = 0
    params: SamplingParams = field(default_factory=lambda: SamplingParams(max_tokens=16))


class Timers(CallTimes):
    """Seconds per part (:class:`~common.CallTimes`), with the matmul calls a step makes and the
    zero rows they were padded with, from the wrappers :func:`instrument` installs."""

    def __init__(self):
        super().__init__()
        self.matmuls = 0
        self.padded_calls = 0
        self.padded_rows = 0


def instrument(decoder, vocab: int, timers: Timers):
    """The decoder's parts wrapped with ``timers`` while the returned context is entered."""
    rowwise = row_invariant.rowwise

    def counted_rowwise(fn, x, counts, out_features, few=None):
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        timers.matmuls += 1
        padded = sum(
            counts.padded[min(row_invariant.CHUNK, rows - s) - 1] - min(row_invariant.CHUNK, rows - s)
            for s in range(0, rows, row_invariant.CHUNK)
        )
        timers.padded_calls += padded > 0
        timers.padded_rows += padded
        return rowwise(fn, x, counts, out_features, few)

    if decoder.merges_lora():  # every projection goes through lora_plans.project
        is_head = ("lm_head", lambda linear, parent, names, *rest: names == ("lm_head",))
        projections = (lora_plans, "project", timers.wrap("projections", lora_plans.project, is_head))
    else:
        linear = type(decoder.linear)
        is_head = ("lm_head", lambda self, x, weight, *rest: weight.shape[0] == vocab)
        projections = (linear, "__call__", timers.wrap("projections", linear.__call__, is_head))
    return patched(
        [
            projections,
            (llama_decoder, "add_terms", timers.wrap("LoRA terms", llama_decoder.add_terms)),
            (llama_decoder, "decode_attention", timers.wrap("attention", llama_decoder.decode_attention)),
            (block_cache.BlockCache, "update", timers.wrap("attention", block_cache.BlockCache.update)),
            (fused_ops, "attend", timers.wrap("attention", fused_ops.attend)),
            (row_invariant, "rowwise", counted_rowwise),
            # a step of one or two rows runs as made-ready C calls (few_row_step.py)
            (FewRowStep, "_run", timers.wrap("projections", FewRowStep._run)),
            (FewRowStep, "_head", timers.wrap("projections", FewRowStep._head, ("lm_head", lambda *a: True))),
            (FewRowStep, "_attend", timers.wrap("attention", FewRowStep._attend)),
        ]
    )


def ops_per_step(decoder, cache, adapters, tokens, positions) -> int:
    """Tensor ops one decode step dispatches (top-level aten calls, as the profiler counts them)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        decoder.step(cache, adapters, tokens, positions)
    return sum(1 for e in prof.events() if e.cpu_parent is None and e.name.startswith("aten::"))


def profile(host, adapter, prompts, samples: int, steps: int, warmup: int) -> dict:
    """Per-step seconds of each part over ``steps`` decode steps of ``len(prompts) x samples`` rows
    (after ``warmup`` steps), on the engine's thread."""
    decoder = host.decoder
    vocab = host.model.config.vocab_size
    # room in the cache for every step: past its max_tokens a cache grows, a copy of all of it
    jobs = [Job(p, samples, adapter, params=SamplingParams(max_tokens=warmup + steps + 1)) for p in prompts]
    pre = decoder.prefill(jobs)
    cache, rows = pre.cache, len(prompts) * samples
    adapters = [adapter] * rows
    positions = torch.tensor([len(p) for p in prompts for _ in range(samples)])
    tokens = pre.last_logits.argmax(-1).repeat_interleave(samples)
    temperature, top_k, top_p = (
        torch.full((rows,), 0.7),
        torch.zeros(rows, dtype=torch.long),
        torch.ones(rows),
    )
    gen = torch.Generator().manual_seed(0)
    walls, choosing, timers = [], [], Timers()

    def one_step():
        nonlocal tokens, positions
        start = clock()
        logits = decoder.step(cache, adapters, tokens, positions)
        mid = clock()
        tokens, _ = choose(
            logits, temperature, top_k, top_p, torch.rand(rows, generator=gen, dtype=torch.float64)
        )
        positions = positions + 1
        return mid - start, clock() - mid

    with sampling_heap():  # as the engine runs its decode steps
        for _ in range(warmup):
            one_step()
        with instrument(decoder, vocab, timers):
            for _ in range(steps):
                wall, chose = one_step()
                walls.append(wall)
                choosing.append(chose)
    ops = ops_per_step(decoder, cache, adapters, tokens, positions)
    per_step = {part: timers.seconds[part] / steps for part in PARTS}
    per_step["of them lm_head"] = timers.seconds["projections/lm_head"] / steps
    per_step["token choice"] = statistics.mean(choosing)
    step = statistics.mean(walls)
    per_step["other"] = step - per_step["projections"] - per_step["LoRA terms"] - per_step["attention"]
    config = host.model.config
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    # KV entries a step reads: each prompt's columns once (its samples share them), each row's own
    column_bytes = config.num_hidden_layers * 2 * config.num_key_value_heads * dim * 4
    own = rows * (warmup + steps / 2)
    return {
        "rows": rows,
        "kv_bytes": column_bytes * (sum(len(p) for p in prompts) + own),
        "ready": timers.calls["projections"] > 0 and not timers.matmuls,
        "step": step + per_step["token choice"],
        "parts": per_step,
        "ops": ops,
        "calls": timers.matmuls / steps,
        "padded_calls": timers.padded_calls / steps,
        "padded_rows": timers.padded_rows / steps,
        "columns": int(positions.float().mean()),
        "packed": decoder.linear.pack,
        "merged": decoder.merges_lora(),
    }


def trained_adapter(args):
    """An in-process engine as the engine process runs (``args``: model, rank, home and the device
    options), a LoRA session trained one step (B off zero) and its sampler's adapter loaded:
    ``(svc, tc, prompts, host, adapter)``, with 8 chat prompts."""
    as_engine_process(args.device)
    svc = in_process_client(args.home, args.device, args.dtype, args.memory_budget)
    tc = svc.create_lora_training_client(args.model, rank=args.rank, seed=0)
    tok = tc.get_tokenizer()
    prompts = prompts_for(tok, 8)
    tc.forward_backward([prompts[0] + tok.encode(" Once upon a time")]).result()
    tc.optim_step(AdamParams(learning_rate=1e-3)).result()
    sc = tc.save_weights_and_get_sampling_client()
    sc.sample(prompts[0], sampling_params=SamplingParams(max_tokens=2)).result()  # loads the adapter
    host = svc.transport.engine.runtime.hosts[args.model]
    return svc, tc, prompts, host, host.checkpoint_adapters[sc.model_path]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rows", default="1,64", help="batch sizes: 1 (one prompt) or P x 8 samples")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--home", default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: the engine's)")
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="time with the engine thread's CPU time (with --threads 1: for a machine other work shares)",
    )
    add_device_options(parser)
    args = parser.parse_args()
    if args.cpu_time and args.threads != 1:
        parser.error("--cpu-time counts the engine thread's work only: run it with --threads 1")
    svc, tc, prompts, host, adapter = trained_adapter(args)
    if args.threads:
        on_engine(svc, torch.set_num_threads, args.threads)
    if args.cpu_time:
        use_cpu_time()
    read, copy = on_engine(svc, memory_bandwidth)
    base, lora = weight_bytes(host, adapter)
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        samples = 1 if rows == 1 else 8
        use = prompts[: max(1, rows // samples)]
        result = on_engine(svc, profile, host, adapter, use, samples, args.steps, args.warmup)
        result["floor"] = on_engine(svc, matmul_floor, host, result["rows"], 3)
        if result["ready"]:  # the same rows through the general step, for comparison
            general = (llama_decoder.LlamaDecoder, "_few_step_for", lambda self, *args: None)
            with patched([general]):
                result["general"] = on_engine(svc, profile, host, adapter, use, samples, args.steps, 2)[
                    "step"
                ]
        results.append(result)
    console = Console()
    table = Table(
        title=f"decode step on {args.model} ({host.dtype}, LoRA rank {args.rank}, "
        f"{torch.get_num_threads()} threads), ms per step"
    )
    table.add_column("part")
    for r in results:
        table.add_column(f"{r['rows']} rows ({r['columns']} cache columns)")
    for part in (*PARTS, "other"):
        table.add_row(
            part, *(f"{r['parts'][part] * 1e3:.1f} ({r['parts'][part] / r['step']:.0%})" for r in results)
        )
    table.add_row(
        "whole step", *(f"{r['step'] * 1e3:.1f} = {r['rows'] / r['step']:.1f} tok/s" for r in results)
    )
    table.add_row("tensor ops a step", *(str(r["ops"]) for r in results))
    table.add_row(
        "padding: matmul calls padded, rows added",
        *(f"{r['padded_calls']:.0f} of {r['calls']:.0f}, {r['padded_rows']:.0f}" for r in results),
    )
    table.add_row("step as made-ready C calls", *("yes" if r["ready"] else "no" for r in results))
    table.add_row(
        "the general step instead (same rows, same process)",
        *(f"{r['general'] * 1e3:.1f}" if "general" in r else "-" for r in results),
    )
    table.add_row("prepacked base weights", *("yes" if r["packed"] else "no" for r in results))
    table.add_row("adapter plans", *("merged" if r["merged"] else "LoRA terms" for r in results))
    table.add_row("matmul floor (base linears alone)", *(f"{r['floor'] * 1e3:.1f}" for r in results))
    table.add_row(
        "weights read a step / achieved",
        *(f"{(base + lora) / 1e6:.0f} MB, {(base + lora) / r['step'] / 1e9:.1f} GB/s" for r in results),
    )
    table.add_row(
        "bandwidth limit (weights / read bandwidth)",
        *(f"{(base + lora) / read * 1e3:.1f}" for _ in results),
    )
    table.add_row(
        "weights + KV read a step / read bandwidth / step",
        *(f"{(base + lora + r['kv_bytes']) / read / r['step']:.2f}" for r in results),
    )
    console.print(table)
    console.print(f"memory bandwidth, same process: read {read / 1e9:.1f} GB/s, copy {copy / 1e9:.1f} GB/s")
    tc.stop()
    svc.close()


if __name__ == "__main__":
    main()
