"""The losses the Tinker SDK names: gspo matches a plain-torch GSPO-token reference (loss and
gradients), with and without ``sequence_ratio_mask``; a loss this engine does not run is refused
with the supported set, in both SDKs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sess.engine import Datum, InvalidRequest
from sess.engine.sdk.data_checks import DEFAULT_CONFIG, REQUIRED_INPUTS

from helpers import (
    SENTENCES,
    ce_datum,
    clear_grads,
    engine_grads,
    max_diff,
    reference_grads,
    reference_logprobs,
    reference_model,
    train_steps,
)


def gspo_reference(lp: torch.Tensor, x: dict[str, torch.Tensor], lo: float, hi: float) -> torch.Tensor:
    """GSPO-token as Tinker's documentation writes it, for one sequence."""
    marks = x.get("sequence_ratio_mask", x["advantages"])
    log_ratio = (lp.detach() - x["logprobs"])[marks != 0].mean()
    ratio = torch.exp(log_ratio + lp - lp.detach())
    adv = x["advantages"]
    return -torch.minimum(ratio * adv, torch.clamp(ratio, lo, hi) * adv).sum()


def _batch(tok, model, rng, with_mask: bool) -> list[Datum]:
    data = []
    for text in SENTENCES[:3]:
        d = ce_datum(tok.encode(text))
        lp = reference_logprobs(model, d).detach().numpy()
        n = d.model_input.length
        inputs = {
            "target_tokens": d.loss_fn_inputs["target_tokens"],
            "logprobs": (lp + rng.uniform(-0.05, 0.05, n)).astype(np.float32),
            # one advantage per sequence on its "sampled" tail, 0 on its "prompt" head
            "advantages": np.where(np.arange(n) >= n // 3, rng.choice([-1.0, 1.0]), 0.0).astype(np.float32),
        }
        if with_mask:
            inputs["sequence_ratio_mask"] = (np.arange(n) >= n // 2).astype(np.float32)
        data.append(Datum(d.model_input, inputs))
    return data


@pytest.mark.parametrize(
    "config", [None, {"clip_low_threshold": 0.97, "clip_high_threshold": 1.02}], ids=["paper", "wide"]
)
@pytest.mark.parametrize("with_mask", [False, True], ids=["advantage-mask", "sequence_ratio_mask"])
def test_gspo_matches_plain_torch(tc, runtime, config, with_mask):
    tok = tc.get_tokenizer()
    train_steps(tc, SENTENCES, 1e-2)
    model = reference_model(runtime, tc.name)
    data = _batch(tok, model, np.random.default_rng(1), with_mask)
    clear_grads(runtime, tc.name)
    out = tc.forward_backward(data, "gspo", loss_fn_config=config).result()
    got = engine_grads(runtime, tc.name)
    bounds = {**DEFAULT_CONFIG["gspo"], **(config or {})}
    model.zero_grad(set_to_none=True)
    total = sum(
        gspo_reference(
            reference_logprobs(model, d),
            {k: v.to_torch().float() for k, v in d.loss_fn_inputs.items()},
            bounds["clip_low_threshold"],
            bounds["clip_high_threshold"],
        )
        for d in data
    )
    total.backward()
    assert abs(out.metrics["loss:sum"] - total.item()) < 1e-5
    assert max_diff(got, reference_grads(model)) < 1e-5
    clear_grads(runtime, tc.name)


def test_gspo_clips_whole_sequences_where_ppo_clips_tokens(tc):
    tok = tc.get_tokenizer()
    d = ce_datum(tok.encode(SENTENCES[0]))
    n = d.model_input.length
    lp = np.asarray(tc.forward([d]).result().loss_fn_outputs[0]["logprobs"].tolist(), np.float32)
    # sampler logprobs that put the sequence ratio far above the clip range: every token clipped
    far = Datum(
        d.model_input,
        {
            "target_tokens": d.loss_fn_inputs["target_tokens"],
            "logprobs": lp - 1.0,
            "advantages": np.ones(n, np.float32),
        },
    )
    out = tc.forward([far], "gspo").result()
    assert out.metrics["ratio:mean"] == pytest.approx(np.e, rel=1e-4)
    assert out.metrics["loss:sum"] == pytest.approx(
        -n * DEFAULT_CONFIG["gspo"]["clip_high_threshold"], rel=1e-5
    )


def test_losses_the_engine_does_not_run_are_refused_with_the_supported_set(tc):
    assert "gspo" in REQUIRED_INPUTS and "stable_reinforce" not in REQUIRED_INPUTS
    datum = ce_datum(tc.get_tokenizer().encode(SENTENCES[1]))
    with pytest.raises(
        InvalidRequest, match="stable_reinforce is not supported by this engine: .* defines neither"
    ):
        tc.forward_backward([datum], "stable_reinforce")
    with pytest.raises(InvalidRequest, match="choose one of cross_entropy, .*gspo"):
        tc.forward_backward([datum], "no_such_loss")
