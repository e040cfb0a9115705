"""cross_entropy with (N, K) targets: K teacher tokens per position, each weighted. The loss and the
gradients are those of K one-target datums summed; logprobs come back as (N, K); shapes that do not
match, and K = 0, are refused naming both shapes."""

from __future__ import annotations

import numpy as np
import pytest

from sess.engine import Datum, InvalidRequest, ModelInput

from helpers import clear_grads, engine_grads, max_diff

K = 3


def _batch(vocab: int):
    rng = np.random.default_rng(0)
    data, columns = [], []
    for n in (7, 11):
        tokens = rng.integers(0, vocab, n + 1)
        targets = rng.integers(0, vocab, (n, K))
        targets[:, 0] = tokens[1:]
        weights = rng.uniform(0.0, 1.0, (n, K)).astype(np.float32)
        model_input = ModelInput.from_ints(tokens[:-1].tolist())
        data.append(Datum(model_input, {"target_tokens": targets, "weights": weights}))
        columns.append(
            [Datum(model_input, {"target_tokens": targets[:, j], "weights": weights[:, j]}) for j in range(K)]
        )
    return data, columns


def test_k_targets_per_position_equal_k_single_target_datums_summed(tc):
    data, columns = _batch(256)
    multi = tc.forward(data, "cross_entropy").result()
    for datum, output, singles in zip(data, multi.loss_fn_outputs, columns):
        got = output["logprobs"].to_numpy()
        assert got.shape == (datum.model_input.length, K)
        alone = tc.forward(singles, "cross_entropy").result()
        expected = np.stack([o["logprobs"].to_numpy() for o in alone.loss_fn_outputs], axis=1)
        np.testing.assert_allclose(got, expected, atol=1e-5)
    summed = sum(tc.forward(s, "cross_entropy").result().metrics["loss:sum"] for s in columns)
    assert abs(multi.metrics["loss:sum"] - summed) < 1e-5 * max(1.0, abs(summed))


def test_k_targets_give_the_gradients_of_the_single_target_datums(tc, runtime):
    data, columns = _batch(256)
    clear_grads(runtime, tc.name)
    tc.forward_backward(data, "cross_entropy").result()
    multi = engine_grads(runtime, tc.name)
    clear_grads(runtime, tc.name)
    tc.forward_backward([d for c in columns for d in c], "cross_entropy").result()
    single = engine_grads(runtime, tc.name)
    clear_grads(runtime, tc.name)
    assert max_diff(multi, single) < 1e-5


@pytest.mark.parametrize(
    "targets, weights, words",
    [
        ((5, 0), (5, 0), ["(5, 0)", "K = 0"]),
        ((5, 3), (5, 2), ["(5, 3)", "(5, 2)"]),
        ((5, 3), (5,), ["(5, 3)", "(5,)"]),
        ((4, 3), (4, 3), ["(4, 3)", "model_input.length 5"]),
    ],
)
def test_mismatched_shapes_are_refused_naming_both(tc, targets, weights, words):
    datum = Datum(
        ModelInput.from_ints([1, 2, 3, 4, 5]),
        {"target_tokens": np.ones(targets, np.int64), "weights": np.ones(weights, np.float32)},
    )
    with pytest.raises(InvalidRequest) as refused:
        tc.forward([datum], "cross_entropy").result()
    assert all(w in str(refused.value) for w in words), str(refused.value)
    # the session still works
    ok = Datum(ModelInput.from_ints([1, 2, 3]), {"target_tokens": [2, 3, 4], "weights": [1.0, 1.0, 1.0]})
    assert np.isfinite(tc.forward([ok], "cross_entropy").result().metrics["loss:sum"])
