"""An adapter's decode plan merged into copies of the weights vs as LoRA terms: decode step time.

The lean decoder runs an adapter's rows either through its merged weights (``W + scaling * B A``,
the projections that read the same input stacked into one matmul: the engine's choice for an fp32
base on CPU with room for the copies) or through the base weights plus the LoRA terms (an ``A`` and
a ``B`` matmul and an add a projection). Beside them a third form, merged but one matmul a
projection (q/k/v and gate/up not stacked), shows what the stacking alone gives. The forms run here
in one process on the engine's thread, alternated round by round so machine noise hits them alike,
on the same adapter, prompts and rows; beside them, the matmul floor of the same rows (the base
model's linear layers alone, ``sampling.matmul_floor``):

    python benchmarks/lora_forms.py                       # smollm2-135m, 1 row and 64 rows
    python benchmarks/lora_forms.py --model tiny-llama --rounds 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
from decode_profile import Job, trained_adapter  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402
from sampling import matmul_floor  # noqa: E402

from sess.engine.sampling import llama_decoder, lora_plans  # noqa: E402

from common import add_device_options, on_engine  # noqa: E402

# form -> (LlamaDecoder.merge_lora, q/k/v and gate/up stacked)
FORMS = {"terms": (False, False), "merged, unstacked": (True, False), "merged": (True, True)}


def unstacked(parent, names, adapter: str, scratch):
    """``lora_plans.merged_of`` one projection at a time: a matmul for each, none stacked."""
    parts = [lora_plans.merged_of(parent, (name,), adapter, scratch) for name in names]
    if all(part is None for part in parts):
        return None
    return [part[0] if part is not None else None for part in parts]


def use_form(host, form: str) -> None:
    """Make ``form`` the decoder's: its plans are made again at the next step."""
    merge, stacked = FORMS[form]
    host.decoder.merge_lora = merge
    llama_decoder.merged_of = lora_plans.merged_of if stacked else unstacked
    host.decoder.release_memory()


def step_seconds(host, adapter, prompts, samples: int, steps: int) -> float:
    """Mean seconds of ``steps`` decode steps of ``len(prompts) x samples`` rows, after a fresh
    prefill and one step that makes the plan."""
    decoder = host.decoder
    pre = decoder.prefill([Job(p, samples, adapter) for p in prompts])
    rows = len(prompts) * samples
    adapters = [adapter] * rows
    positions = torch.tensor([len(p) for p in prompts for _ in range(samples)])
    tokens = pre.last_logits.argmax(-1).repeat_interleave(samples)
    times = []
    for index in range(steps + 1):
        start = time.perf_counter()
        logits = decoder.step(pre.cache, adapters, tokens, positions)
        if index:
            times.append(time.perf_counter() - start)
        tokens, positions = logits.argmax(-1), positions + 1
    return statistics.mean(times)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rows", default="1,64", help="batch sizes: 1 (one prompt) or P x 8 samples")
    parser.add_argument("--steps", type=int, default=6, help="timed decode steps a round")
    parser.add_argument("--rounds", type=int, default=4, help="rounds of both forms, alternated")
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--home", default=None)
    add_device_options(parser)
    args = parser.parse_args()
    svc, tc, prompts, host, adapter = trained_adapter(args)
    default = "merged" if host.decoder.merges_lora() else "terms"
    table = Table(title=f"decode step on {args.model} ({host.dtype}, LoRA rank {args.rank}), ms per step")
    for column in (
        "rows",
        "LoRA terms",
        "merged, unstacked",
        "merged",
        "terms / merged",
        "unstacked / merged",
        "matmul floor",
        "floor / merged",
    ):
        table.add_column(column)
    for rows in (int(r) for r in args.rows.split(",")):
        samples = 1 if rows == 1 else 8
        use = prompts[: max(1, rows // samples)]
        seconds: dict[str, list[float]] = {form: [] for form in FORMS}
        floors = []
        for _ in range(args.rounds):
            for form in FORMS:
                use_form(host, form)
                seconds[form].append(on_engine(svc, step_seconds, host, adapter, use, samples, args.steps))
            floors.append(on_engine(svc, matmul_floor, host, len(use) * samples, 3))
        medians = {form: statistics.median(times) for form, times in seconds.items()}
        merged, floor = medians["merged"], statistics.median(floors)

        def ratio(form: str, seconds=seconds) -> str:
            ratios = [t / m for t, m in zip(seconds[form], seconds["merged"])]
            return f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"

        table.add_row(
            str(len(use) * samples),
            *(f"{medians[form] * 1e3:.1f}" for form in FORMS),
            ratio("terms"),
            ratio("merged, unstacked"),
            f"{floor * 1e3:.1f}",
            f"{floor / merged:.2f}",
        )
    use_form(host, default)
    Console().print(table)
    Console().print(
        f"the engine's default here: {default}; medians of {args.rounds} alternated rounds of "
        f"{args.steps} steps each (ratio: per round, median and range)"
    )
    tc.stop()
    svc.close()


if __name__ == "__main__":
    main()
