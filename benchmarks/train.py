"""Training throughput: forward_backward + optim_step through the engine vs a plain PEFT step.

Both sides run the same model, LoRA config (rank, alpha, targets), batch (B sequences x T tokens),
token-sum cross entropy and AdamW, alternating A/B rounds in this one process so machine noise
hits both alike. Prints tokens/s for each and the ratio engine / plain (target >= 0.95).

    python benchmarks/train.py                          # smollm2-135m, 8 x 128, in-process engine
    python benchmarks/train.py --url http://127.0.0.1:PORT   # through an engine server
    python benchmarks/train.py --model tiny-llama --rounds 5
    python benchmarks/train.py --dtype bfloat16          # both sides with a bf16 base model
    python benchmarks/train.py --device cuda             # on a GPU (bf16 there by default)
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from sess.engine import AdamParams, Datum, ModelInput, ServiceClient  # noqa: E402
from sess.engine.runtime.models.catalog import DTYPES, Dtypes, load_model, lora_targets  # noqa: E402

from common import add_device_options, as_engine_process, in_process_client, on_engine  # noqa: E402


def batch(vocab: int, rows: int, length: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 10, (rows, length + 1), generator=g)


def plain_peft(
    model_name: str, home, rank: int, alpha: float, seed: int, device: str = "cpu", dtype=torch.float32
):
    model, _, _ = load_model(model_name, home=home, device=device, dtype=dtype)
    targets = lora_targets(model, train_attn=True, train_mlp=True, train_unembed=True)
    torch.manual_seed(seed)
    model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, **targets))
    model.eval()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        params, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, foreach=False
    )

    def step(tokens: torch.Tensor) -> float:
        tokens = tokens.to(model.device)
        logits = model(input_ids=tokens[:, :-1]).logits.float()
        loss = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), tokens[:, 1:].flatten(), reduction="sum"
        )
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return step


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--url", default="inproc", help="engine URL (default: in-process engine)")
    parser.add_argument("--home", default=None)
    add_device_options(parser)
    args = parser.parse_args()
    as_engine_process(args.device)

    if args.url == "inproc":
        svc = in_process_client(args.home, args.device, args.dtype, args.memory_budget)
    else:
        svc = ServiceClient(args.url, home=args.home)
    tc = svc.create_lora_training_client(args.model, rank=args.rank, alpha=2 * args.rank, seed=0)
    vocab = len(tc.get_tokenizer())

    def here(fn, *a, **k):  # an in-process engine's thread runs the baseline too: see common.py
        return on_engine(svc, fn, *a, **k) if args.url == "inproc" else fn(*a, **k)

    dtype = DTYPES[Dtypes.parse(args.dtype).name_for(args.model, args.device)]
    step = here(plain_peft, args.model, args.home, args.rank, 2 * args.rank, 0, args.device, dtype)

    def plain(tokens: torch.Tensor) -> float:
        return here(step, tokens)

    adam = AdamParams(learning_rate=1e-4)

    def engine_step(tokens: torch.Tensor) -> float:
        data = [
            Datum(
                ModelInput.from_ints(row[:-1].tolist()),
                {"target_tokens": row[1:].numpy(), "weights": torch.ones(len(row) - 1).numpy()},
            )
            for row in tokens
        ]
        fb = tc.forward_backward(data)
        opt = tc.optim_step(adam)
        loss = fb.result().metrics["loss:sum"]
        opt.result()
        return loss

    tokens_per_step = args.rows * args.length
    times: dict[str, list[float]] = {"engine": [], "plain": []}
    losses = {}
    for r in range(args.rounds + 1):  # round 0 warms both up and is not counted
        tokens = batch(vocab, args.rows, args.length, seed=r)
        for name, fn in (("engine", engine_step), ("plain", plain)):
            start = time.perf_counter()
            losses[name] = fn(tokens)
            if r:
                times[name].append(time.perf_counter() - start)
    engine_tps = tokens_per_step / statistics.median(times["engine"])
    plain_tps = tokens_per_step / statistics.median(times["plain"])
    table = Table(
        title=f"forward_backward + optim_step, {args.model} ({dtype}, {args.device}), {args.rows}x{args.length}, "
        f"LoRA rank {args.rank} ({args.url})"
    )
    for col in ("", "tokens/s", "median step s"):
        table.add_column(col)
    table.add_row("sess engine", f"{engine_tps:.1f}", f"{statistics.median(times['engine']):.2f}")
    table.add_row("plain PEFT step", f"{plain_tps:.1f}", f"{statistics.median(times['plain']):.2f}")
    table.add_row("ratio engine / plain", f"{engine_tps / plain_tps:.3f}", "")
    Console().print(table)
    print(f"last losses: engine {losses['engine']:.3f}, plain {losses['plain']:.3f}")
    tc.stop()
    svc.close()


if __name__ == "__main__":
    main()
