"""Few-row matmuls: the sampler's kernel (``engine/native/few_rows.c``) vs oneDNN's prepacked call.

One pass over every projection and the lm_head of a model of smollm2-135m's shapes (random fp32
weights, prepacked as the sampler packs them; 121 matmuls, 538 MB), in model order so each weight
streams from memory, at 1, 2, 3, 4 and 8 rows: the kernel and oneDNN alternated pass by pass in
this process, the median of each, as GB/s of weights read beside the memory's read bandwidth
measured here. Each shape's kernel result is also compared bit for bit with oneDNN's 64-row
result (what the sampler needs for batch invariance). The sampler sends calls of up to
``few_rows.FEW`` rows through the kernel: this is the measurement that picks it.

    python benchmarks/few_rows.py                 # smollm2-135m's shapes
    python benchmarks/few_rows.py --rounds 15 --rows 1,2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).parent))
from sess.engine.sampling import few_rows, onednn  # noqa: E402

from common import as_engine_process, memory_bandwidth  # noqa: E402


def shapes(hidden: int, intermediate: int, kv: int, layers: int, vocab: int) -> list[tuple[int, int]]:
    """(out, in) of each matmul of a decode step as the sampler runs it (q/k/v and gate/up stacked)."""
    layer = [(hidden + 2 * kv, hidden), (hidden, hidden), (2 * intermediate, hidden), (hidden, intermediate)]
    return layer * layers + [(vocab, hidden)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--kv", type=int, default=192, help="key/value projection width (heads x head size)")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--rows", default="1,2,3,4,8")
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    as_engine_process()
    console = Console()
    lib, how = few_rows._built()
    if lib is None:
        sys.exit(f"the kernel is not available here: {how}")
    gen = torch.Generator().manual_seed(0)
    distinct = sorted(set(shapes(args.hidden, args.intermediate, args.kv, args.layers, args.vocab)))
    exact = {}  # (out, in) -> whether one row's kernel result is oneDNN's 64-row result
    for n, k in distinct:
        weight = torch.randn(n, k, generator=gen)
        packed = onednn.pack_weight(weight)
        kernel = few_rows.FewRows.of(packed, n, k)
        if kernel is None:
            sys.exit(f"the kernel does not match oneDNN at {k}->{n} on this CPU")
        x = torch.randn(onednn.CHUNK, k, generator=gen)
        exact[n, k] = torch.equal(kernel(x[:1]), onednn.linear(x, packed)[:1])
    # every matmul of the step gets its own weight, so a pass reads them all from memory
    step = [
        (n, k, onednn.pack_weight(torch.randn(n, k, generator=gen)))
        for n, k in shapes(args.hidden, args.intermediate, args.kv, args.layers, args.vocab)
    ]
    calls = [(few_rows.FewRows.of(p, n, k), p, k) for n, k, p in step]
    size = sum(n * k * 4 for n, k, _ in step)
    read, _ = memory_bandwidth()
    table = Table(title=f"{len(step)} matmuls, {size / 1e6:.0f} MB of fp32 weights; {how}")
    for column in ("rows", "kernel ms", "oneDNN ms", "kernel GB/s", "oneDNN GB/s", "kernel / oneDNN speed"):
        table.add_column(column)
    with torch.no_grad():
        for rows in map(int, args.rows.split(",")):
            inputs = {k: torch.randn(rows, k, generator=gen) for _, k, _ in step}
            times = {"kernel": [], "onednn": []}
            for _ in range(args.rounds + 1):  # the first round warms both up
                start = time.perf_counter()
                for kernel, _, k in calls:
                    kernel(inputs[k])
                middle = time.perf_counter()
                for _, packed, k in calls:
                    onednn.linear(inputs[k], packed)
                end = time.perf_counter()
                times["kernel"].append(middle - start)
                times["onednn"].append(end - middle)
            ours, theirs = (statistics.median(times[side][1:]) for side in ("kernel", "onednn"))
            table.add_row(
                str(rows),
                f"{ours * 1e3:.1f}",
                f"{theirs * 1e3:.1f}",
                f"{size / ours / 1e9:.1f}",
                f"{size / theirs / 1e9:.1f}",
                f"{theirs / ours:.2f}x",
            )
    console.print(table)
    console.print(f"memory read bandwidth measured in this process: {read / 1e9:.1f} GB/s")
    wrong = [f"{k}->{n}" for (n, k), same in exact.items() if not same]
    console.print(
        "one row: the kernel's bits equal oneDNN's 64-row result at every shape"
        if not wrong
        else f"one row: the kernel's bits DIFFER from oneDNN's 64-row result at {', '.join(wrong)}"
    )


if __name__ == "__main__":
    main()
