"""KTO: learn from binary feedback (desirable / undesirable completions), Kahneman-Tversky style.

Each step takes ``batch_size`` feedback examples ``(x_i, y_i, desirable_i)``. The implied reward of a
completion is ``r(x, y) = log π(y|x) - log π_ref(y|x)`` summed over completion tokens, where π is the
session's policy and π_ref the base model (adapter off; its logprobs come from
``tc.service.create_sampling_client(base_model=...).compute_logprobs``, cached per example). The KL
baseline is estimated from mismatched pairs in the batch, ``z0 = max(0, mean_i r(x_i, y_{i+1 mod B}))``,
and is not differentiated. The loss is
``mean_i [λ_D (1 - σ(β (r_i - z0)))]`` over desirable examples plus
``[λ_U (1 - σ(β (z0 - r_i)))]`` over undesirable ones, averaged over the batch (λ_D =
``desirable_weight``, λ_U = ``undesirable_weight``, β = ``beta``). It runs on this machine through
``forward_backward_custom`` (the engine returns policy logprobs for the matched and mismatched
datums, the gradient goes back as per-token weights), followed by an AdamW ``optim_step``.
Reported: ``margin`` = mean r(desirable) - mean r(undesirable), which KTO drives up; the held-out
version is ``eval/margin``.

Launch: ``sess run loop=kto`` (arithmetic: correct vs wrong answers),
``sess run loop=kto data=feedback_jsonl data.path=feedback.jsonl``, or on its own:
``python -m sess.harness loop=kto model=tiny-llama loop.steps=2``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sess.engine import AdamParams, TrainingClient
from sess.rl import rendering
from sess.rl.data import Dataset, Feedback
from sess.rl.hooks import Hooks

if TYPE_CHECKING:  # torch is imported where the loss runs: composing a config needs none
    import torch


@dataclass
class Config:
    name: str = "kto"
    steps: int = 20
    batch_size: int = 8  # feedback examples per step
    learning_rate: float = 1e-4
    grad_clip_norm: float = 1.0
    max_tokens: int = 24  # the runner's greedy evaluation budget
    beta: float = 0.1
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0


class Reference:
    """Base-model logprob sums of (prompt, completion) token pairs, computed once each."""

    def __init__(self, tc: TrainingClient):
        self.sc = tc.service.create_sampling_client(base_model=tc.base_model)
        self.cache: dict[tuple, float] = {}

    def sums(self, pairs: list[tuple[list[int], list[int]]]) -> list[float]:
        keys = [(tuple(p), tuple(c)) for p, c in pairs]
        todo = {
            k: self.sc.compute_logprobs(list(k[0] + k[1])) for k in dict.fromkeys(keys) if k not in self.cache
        }
        for key, future in todo.items():
            self.cache[key] = float(sum(future.result()[len(key[0]) :]))
        return [self.cache[k] for k in keys]


def pair_datum(prompt_T: list[int], completion_T: list[int]):
    """prompt + completion; ``weights`` marks the completion tokens whose logprobs are summed."""
    full_T = prompt_T + completion_T
    mask_T = [0.0] * len(prompt_T) + [1.0] * len(completion_T)
    return rendering.shifted_datum(full_T, weights=mask_T)


def encode(tok, items: list[Feedback]) -> list[tuple[list[int], list[int]]]:
    return [
        (rendering.prompt_tokens(tok, f.prompt), rendering.completion_tokens(tok, f.prompt, f.completion))
        for f in items
    ]


def kto_loss(cfg: Config, desirable_B: list[bool], ref_B: torch.Tensor, ref_mismatch_B: torch.Tensor):
    """The custom loss: ``logprobs`` holds B matched then B mismatched sequences."""
    import torch

    n = len(desirable_B)
    want = torch.tensor(desirable_B)

    def loss_fn(data, logprobs):
        sums = torch.stack(
            [(lp * d.loss_fn_inputs["weights"].to_torch()).sum() for d, lp in zip(data, logprobs)]
        )
        reward_B = sums[:n] - ref_B
        z0 = (sums[n:] - ref_mismatch_B).mean().clamp(min=0).detach()
        value_B = torch.where(
            want,
            cfg.desirable_weight * torch.sigmoid(cfg.beta * (reward_B - z0)),
            cfg.undesirable_weight * torch.sigmoid(cfg.beta * (z0 - reward_B)),
        )
        lam_B = torch.where(want, torch.tensor(cfg.desirable_weight), torch.tensor(cfg.undesirable_weight))
        loss = (lam_B - value_B).mean()
        r = reward_B.detach()
        metrics = {"kl_baseline": float(z0), **_margin(r, want)}
        return loss, metrics

    return loss_fn


def _margin(reward_B: torch.Tensor, want: torch.Tensor) -> dict:

    good = reward_B[want].mean().item() if want.any() else 0.0
    bad = reward_B[~want].mean().item() if (~want).any() else 0.0
    return {"reward/desirable": good, "reward/undesirable": bad, "margin": good - bad}


def train(
    cfg: Config,
    tc: TrainingClient,
    feedback: Dataset[Feedback],
    hooks: Hooks,
    *,
    seed: int = 0,  # unused: the data order is seeded already
    start_step: int = 0,
) -> int:
    """Train steps ``start_step ..``; returns the number of steps done (``cfg.steps``)."""
    import torch

    tok = tc.get_tokenizer()
    adam = AdamParams(learning_rate=cfg.learning_rate, grad_clip_norm=cfg.grad_clip_norm)
    ref = Reference(tc)
    for step in range(start_step, cfg.steps):
        started = time.perf_counter()
        items = [feedback.train(step * cfg.batch_size + i) for i in range(cfg.batch_size)]
        pairs = encode(tok, items)
        # The KL baseline's pairs: each prompt with the next example's completion.
        mismatched = [(pairs[i][0], pairs[(i + 1) % len(pairs)][1]) for i in range(len(pairs))]
        ref_B = torch.tensor(ref.sums(pairs))
        ref_mismatch_B = torch.tensor(ref.sums(mismatched))
        datums = [pair_datum(p, c) for p, c in pairs + mismatched]
        loss_fn = kto_loss(cfg, [f.desirable for f in items], ref_B, ref_mismatch_B)
        fb = tc.forward_backward_custom(datums, loss_fn)
        opt = tc.optim_step(adam)
        out, stepped = fb.result(), opt.result()
        metrics = {k: v for k, v in out.metrics.items() if k != "loss:sum"}
        hooks.step_done(
            step,
            {
                "loss": out.metrics["loss:sum"],
                **metrics,
                "grad_norm": stepped.metrics.get("grad_norm", 0.0),
                "tokens": 2 * sum(d.model_input.length for d in datums),
                "seconds": time.perf_counter() - started,
            },
        )
    return cfg.steps


def evaluate(tc: TrainingClient, feedback: Dataset[Feedback]) -> dict:
    """Held-out implied-reward margin (policy vs base model) of desirable over undesirable completions."""
    import torch

    items = feedback.held_out
    if not items or not any(f.desirable for f in items) or all(f.desirable for f in items):
        return {}
    pairs = encode(tc.get_tokenizer(), items)
    ref_B = torch.tensor(Reference(tc).sums(pairs))
    out = tc.forward([pair_datum(p, c) for p, c in pairs], "cross_entropy").result()
    sums = torch.tensor(
        [
            float((o["logprobs"].to_torch() * torch.tensor([0.0] * (len(p) - 1) + [1.0] * len(c))).sum())
            for o, (p, c) in zip(out.loss_fn_outputs, pairs)
        ]
    )
    want = torch.tensor([f.desirable for f in items])
    return {f"eval/{k}": v for k, v in _margin(sums - ref_B, want).items()}
