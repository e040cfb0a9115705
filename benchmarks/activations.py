"""What a training forward saves for the backward pass, by row length, against the probe's price.

The engine prices a position from one 128-token probe (``engine/runtime/memory/training_budget.py``) and
sizes micro-batches and activation checkpointing by it. This script checks the price on longer
rows and bigger batches: the bytes autograd saves (``saved_bytes``, weights excluded) for a forward
of B x T tokens through the session's decoder, plain and checkpointed, next to B x T x the probe's
price. It also prints the attention implementation the training forward uses (eager attention
would save [heads x T x T] probabilities a layer, and a long row would cost more than its price).

    python benchmarks/activations.py                       # smollm2-135m, LoRA rank 32 everywhere
    python benchmarks/activations.py --model tiny-llama --shapes 1x128,1x512
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

from sess.engine.runtime.memory.training_budget import checkpointing, saved_bytes  # noqa: E402
from sess.engine.runtime.models.model_host import ModelHost  # noqa: E402
from sess.engine.runtime.output_layer import decoder_and_head  # noqa: E402

MB = float(1 << 20)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--shapes", default="1x128,8x128,1x512,1x1024,4x1024", help="B x T, comma-separated")
    parser.add_argument("--home", default=os.environ.get("SESS_HOME", str(Path.home() / ".sess")))
    args = parser.parse_args()
    host = ModelHost(args.model, Path(args.home), "cpu")
    print(f"attention implementation: {host.model.config._attn_implementation}")
    host.add_adapter("probe", host.lora_config(32, 64, True, True, True), seed=0)
    for param in host.adapter_params("probe").values():
        param.requires_grad_(True)
    with host.activate("probe") as model:
        cost = host.activation_cost(model)
        print(
            f"probe price: {cost.plain / 1024:.0f} KB a position, {cost.checkpointed / 1024:.0f} KB checkpointed"
        )
        decoder, _, _ = decoder_and_head(model)
        for shape in args.shapes.split(","):
            rows, length = (int(n) for n in shape.split("x"))
            ids = torch.randint(
                10, host.vocab_size, (rows, length), generator=torch.Generator().manual_seed(0)
            )

            def run(ids=ids):
                decoder(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)

            with torch.enable_grad():
                plain = saved_bytes(run, model, torch.device("cpu"))
                with checkpointing(model, True):
                    stored = saved_bytes(run, model, torch.device("cpu"))
            count = rows * length
            print(
                f"{rows} x {length}: saves {plain / MB:.0f} MiB = {plain / count / 1024:.0f} KB a position "
                f"(priced {count * cost.plain / MB:.0f} MiB); checkpointed {stored / MB:.0f} MiB "
                f"(priced {count * cost.checkpointed / MB:.0f} MiB)"
            )


if __name__ == "__main__":
    main()
