"""What one state save costs, so a user can set ``save_every`` against the work a crash may lose.

A run resumes from its last saved state after an engine dies (``sess run`` does it by itself), so
at most ``save_every`` steps are computed again; each save is the LoRA adapter plus its AdamW
moments in safetensors. This trains one step on a session of the default run's shape (smollm2-135m,
LoRA rank 32 on attention, MLP and ``lm_head``), saves its state three times and prints each save's
seconds and the checkpoint's size on disk, beside one training step's seconds for scale.

    python benchmarks/save_cost.py                    # smollm2-135m, rank 32
    python benchmarks/save_cost.py --model tiny-llama --rank 8
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from sess.engine import AdamParams, ServiceClient  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--home", default=None, help="engine home (default: a temporary one)")
    args = parser.parse_args()
    home = Path(args.home or tempfile.mkdtemp(prefix="sess-save-cost-"))
    svc = ServiceClient("inproc", home=home)
    tc = svc.create_lora_training_client(args.model, rank=args.rank, alpha=2 * args.rank, seed=0)
    tokens = tc.get_tokenizer().encode("The capital of France is Paris. " * 16)
    started = time.perf_counter()
    tc.forward_backward([tokens]).result()
    tc.optim_step(AdamParams(learning_rate=1e-4)).result()
    step_s = time.perf_counter() - started
    seconds = []
    for i in range(3):
        started = time.perf_counter()
        tc.save_state(name=f"s{i}").result()
        seconds.append(time.perf_counter() - started)
    directory = home / "checkpoints" / tc.name / "state" / "s0"
    size = sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())
    print(
        f"{args.model} LoRA rank {args.rank}: one state save {min(seconds):.2f}-{max(seconds):.2f} s, "
        f"{size / 1e6:.1f} MB on disk; one training step ({len(tokens)} tokens) {step_s:.2f} s"
    )
    tc.stop()


if __name__ == "__main__":
    main()
