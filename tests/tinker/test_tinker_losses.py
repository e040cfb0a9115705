"""The losses the Tinker SDK names: gspo matches a plain-torch GSPO-token reference (loss and
gradients), with and without ``sequence_ratio_mask``; stable_reinforce matches its formula written
out in plain torch (loss, gradients and metrics); a loss this engine does not run is refused with
the supported set, in both SDKs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sess.engine import Datum, InvalidRequest
from sess.engine.protocol.data_checks import DEFAULT_CONFIG, REQUIRED_INPUTS

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


def stable_reinforce_reference(
    lp: torch.Tensor, x: dict[str, torch.Tensor], cap: float, kl_coeff: float
) -> torch.Tensor:
    """Truncated-IS REINFORCE plus k3 KL(sampler || learner) on the tokens with an advantage."""
    log_w = lp - x["logprobs"]
    w = torch.exp(log_w)
    mask = (x["advantages"] != 0).float()
    k3 = (w - 1 - log_w) * mask
    return -(torch.clamp(w, max=cap).detach() * lp * x["advantages"]).sum() + kl_coeff * k3.sum()


@pytest.mark.parametrize("config", [None, {"kl_coeff": 0.3, "weight_cap": 1.02}], ids=["default", "kl"])
def test_stable_reinforce_matches_plain_torch(tc, runtime, config):
    tok = tc.get_tokenizer()
    train_steps(tc, SENTENCES, 1e-2)
    model = reference_model(runtime, tc.name)
    data = _batch(tok, model, np.random.default_rng(2), with_mask=False)
    clear_grads(runtime, tc.name)
    out = tc.forward_backward(data, "stable_reinforce", loss_fn_config=config).result()
    got = engine_grads(runtime, tc.name)
    options = {**DEFAULT_CONFIG["stable_reinforce"], **(config or {})}
    assert options["weight_cap"] == (config or {}).get("weight_cap", 2.0)
    model.zero_grad(set_to_none=True)
    inputs = [{k: v.to_torch().float() for k, v in d.loss_fn_inputs.items()} for d in data]
    lps = [reference_logprobs(model, d) for d in data]
    total = sum(
        stable_reinforce_reference(lp, x, options["weight_cap"], options["kl_coeff"])
        for lp, x in zip(lps, inputs)
    )
    total.backward()
    assert abs(out.metrics["loss:sum"] - total.item()) < 1e-5
    assert max_diff(got, reference_grads(model)) < 1e-5
    with torch.no_grad():
        lp, x = torch.cat(lps), {k: torch.cat([i[k] for i in inputs]) for k in ("logprobs", "advantages")}
        mask = x["advantages"] != 0
        w = torch.exp(lp - x["logprobs"])[mask]
    assert out.metrics["is_weight:mean"] == pytest.approx(w.mean().item(), rel=1e-5)
    assert out.metrics["is_weight:max"] == pytest.approx(w.max().item(), rel=1e-5)
    assert out.metrics["is_weight_truncated:mean"] == pytest.approx(
        (w > options["weight_cap"]).float().mean().item()
    )
    assert out.metrics["kl_sampler_learner_k3:mean"] == pytest.approx(
        (w - 1 - torch.log(w)).mean().item(), rel=1e-4, abs=1e-7
    )
    if config:  # a cap of 1.02 against +-0.05 nats of drift truncates some weights, not all
        assert 0 < out.metrics["is_weight_truncated:mean"] < 1
    clear_grads(runtime, tc.name)


def test_stable_reinforce_refuses_an_option_it_does_not_take(tc):
    datum = ce_datum(tc.get_tokenizer().encode(SENTENCES[1]))
    n = datum.model_input.length
    rl = Datum(
        datum.model_input,
        {
            "target_tokens": datum.loss_fn_inputs["target_tokens"],
            "logprobs": np.full(n, -1.0, np.float32),
            "advantages": np.ones(n, np.float32),
        },
    )
    with pytest.raises(InvalidRequest, match="clip_low_threshold"):
        tc.forward_backward([rl], "stable_reinforce", loss_fn_config={"clip_low_threshold": 0.5})
    with pytest.raises(InvalidRequest, match="kl_coeff: expected a value of 0 or more"):
        tc.forward_backward([rl], "stable_reinforce", loss_fn_config={"kl_coeff": -0.1})
    with pytest.raises(InvalidRequest, match="weight_cap: expected 1 or more"):
        tc.forward_backward([rl], "stable_reinforce", loss_fn_config={"weight_cap": 0.5})


def test_losses_the_engine_does_not_run_are_refused_with_the_supported_set(tc):
    assert "gspo" in REQUIRED_INPUTS and "stable_reinforce" in REQUIRED_INPUTS
    datum = ce_datum(tc.get_tokenizer().encode(SENTENCES[1]))
    with pytest.raises(InvalidRequest, match="custom is not supported by this engine"):
        tc.forward_backward([datum], "custom")
    with pytest.raises(InvalidRequest, match="choose one of cross_entropy, .*gspo"):
        tc.forward_backward([datum], "no_such_loss")
