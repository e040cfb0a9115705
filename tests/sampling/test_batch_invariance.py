"""Batch invariance on any CPU: the row counts each matmul kernel runs at are calibrated on the
machine, so a row's bits do not depend on what shares its batch, whatever the BLAS does with
small or odd row counts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import torch

from sess.engine.sampling import row_invariant
from sess.engine.sampling.row_invariant import CHUNK, calibrate, rowwise

WEIGHT = torch.randn(24, 40, generator=torch.Generator().manual_seed(7))


def odd_counts_sum_otherwise(x: torch.Tensor) -> torch.Tensor:
    """A BLAS like some CPUs': rows of a matrix whose row count is not a multiple of 4 are summed
    in another order (here: in float64, then rounded)."""
    if x.shape[0] % 4:
        return (x.double() @ WEIGHT.double().T).float()
    return x @ WEIGHT.T


def test_calibration_finds_the_exact_row_counts_and_every_batch_gives_each_row_its_bits():
    counts = calibrate(odd_counts_sum_otherwise, 40, torch.float32, torch.device("cpu"))
    assert counts.exact
    assert all(padded % 4 == 0 and padded >= m for m, padded in enumerate(counts.padded, 1))
    x = torch.randn(3 * CHUNK, 40, generator=torch.Generator().manual_seed(8))
    reference = torch.cat([odd_counts_sum_otherwise(x[i : i + CHUNK]) for i in range(0, len(x), CHUNK)])
    for start, rows in [(0, 1), (5, 3), (7, 17), (1, 63), (2, 64), (3, 65), (9, 130)]:
        got = rowwise(odd_counts_sum_otherwise, x[start : start + rows], counts, 24)
        assert torch.equal(got, reference[start : start + rows]), (start, rows)
    # without the calibration the same kernel gives a row other bits in a batch of 3
    assert not torch.equal(odd_counts_sum_otherwise(x[:3]), reference[:3])


def _in_float64(rows: torch.Tensor) -> torch.Tensor:
    return (rows.double() @ WEIGHT.double().T).float()


def test_many_rows_go_in_wide_calls_only_where_those_give_each_row_its_chunk_bits():
    """A prefill's rows: a kernel whose wide calls give each row its CHUNK-row bits runs them in
    calls of the widest such count; one that sums wider calls in another order (here: more than
    CHUNK rows in float32, fewer in float64) keeps CHUNK-row calls. Either way every row gets its
    CHUNK-row bits."""
    x = torch.randn(5 * CHUNK + 37, 40, generator=torch.Generator().manual_seed(9))
    reference = torch.cat([_in_float64(x[i : i + CHUNK]) for i in range(0, len(x), CHUNK)])

    def other_order_when_wide(rows: torch.Tensor) -> torch.Tensor:
        return rows @ WEIGHT.T if rows.shape[0] > CHUNK else _in_float64(rows)

    for kernel, wide_calls in [(_in_float64, [256]), (other_order_when_wide, [])]:
        calls = []

        def counted(rows: torch.Tensor, kernel=kernel, calls=calls) -> torch.Tensor:
            calls.append(rows.shape[0])
            return kernel(rows)

        counts = calibrate(kernel, 40, torch.float32, torch.device("cpu"))
        assert torch.equal(rowwise(counted, x, counts, 24), reference)
        assert [n for n in calls if n > CHUNK] == wide_calls and sum(calls) >= len(x), calls
    assert not torch.equal(other_order_when_wide(x[:256]), reference[:256])  # the order shows


def test_a_kernel_whose_rows_depend_on_their_place_is_reported(monkeypatch):
    def by_place(x: torch.Tensor) -> torch.Tensor:
        out = x @ WEIGHT.T
        return out + torch.arange(x.shape[0])[:, None] * 1e-3  # a row's place changes its result

    counts = calibrate(by_place, 40, torch.float32, torch.device("cpu"))
    assert not counts.exact
    key = ("blas", 40, 24, torch.float32, "cpu", False, 1)
    monkeypatch.setattr(row_invariant, "_calibrated", {key: counts})
    report = row_invariant.report()
    assert {k: report[k] for k in ("exact", "kernels", "inexact")} == {
        "exact": False,
        "kernels": 1,
        "inexact": ["blas 40->24 float32 on cpu"],
    }


SCRIPT = textwrap.dedent(
    """
    import json
    from sess.engine import AdamParams, SamplingParams, ServiceClient

    svc = ServiceClient("inproc", home={home!r})
    tc = svc.create_lora_training_client("tiny-llama", rank=8, alpha=16, seed=3)
    tok = tc.get_tokenizer()
    # sampled once while B is still zero: its LoRA terms are exact zeros at any row count, which
    # must not pass for a row-invariant kernel
    fresh = SamplingParams(max_tokens=4, temperature=1.0, seed=0)
    tc.create_sampling_client().sample(tok.encode("Hello there"), num_samples=3, sampling_params=fresh).result()
    for _ in range(3):  # moves B off zero: the LoRA terms now count in every logprob
        tc.forward_backward([tok.encode("The quick brown fox jumps over the lazy dog.")]).result()
        tc.optim_step(AdamParams(learning_rate=2e-2)).result()
    sc = tc.save_weights_and_get_sampling_client()
    one_prompt = [(tok.encode("Question: what is 3 + 4? Answer:"), seed) for seed in range(16)]
    many_prompts = [(tok.encode(f"Question: what is {{i}} + {{2 * i}}? Answer:"), 0) for i in range(12)]
    mismatches = []
    for requests in (one_prompt, many_prompts):
        def ask(prompt, seed):
            params = SamplingParams(max_tokens=8, temperature=1.0, seed=seed)
            return sc.sample(prompt, num_samples=3, sampling_params=params)
        together = [f.result() for f in [ask(p, s) for p, s in requests]]
        for (prompt, seed), got in zip(requests, together):
            alone = ask(prompt, seed).result()
            for a, b in zip(got.sequences, alone.sequences):
                if (a.tokens, a.logprobs) != (b.tokens, b.logprobs):
                    mismatches.append([seed, a.logprobs, b.logprobs])
    print(json.dumps({{"mismatches": mismatches, "invariance": tc.service.transport.engine.runtime.batch_invariance()}}))
    tc.stop()
    """
)


def test_a_trained_adapter_samples_the_same_bits_alone_and_in_a_batch_under_a_row_count_dependent_blas(
    tmp_path,
):
    """MKL's conditional-reproducibility mode makes its sgemm sum most row counts that are not
    multiples of 4 in another order, at any size (as some CPUs' default kernels do): one prompt
    with 16 seeds and 12 prompts, each alone and all together, on an adapter trained off its zero
    init (and sampled once before, at zero), give the same tokens and logprobs to the bit, and the
    engine reports invariance."""
    env = {**os.environ, "MKL_CBWR": "COMPATIBLE"}
    script = SCRIPT.format(home=str(tmp_path / "home"))
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["invariance"]["exact"], result["invariance"]
    assert result["mismatches"] == []


def test_the_engine_reports_batch_invariance_at_start_and_in_its_status(http_engine, sess_home):
    """The engine calibrates the typical kernels at start; /healthz and `sess engine status` say
    whether sampling is batch-invariant here, and name the kernels that are not."""
    from typer.testing import CliRunner

    from sess.cli.main import app
    from sess.engine.sdk.local_engine import engine_info

    invariance = engine_info(sess_home)["batch_invariant"]
    assert invariance["kernels"] >= 4, invariance
    shown = CliRunner().invoke(app, ["engine", "status", "--home", str(sess_home)]).output
    assert f"one- and two-row matmuls: {invariance['few_rows']}" in " ".join(shown.split()), shown
    assert f"attention, norms and token draws: {invariance['fused_ops']}" in " ".join(shown.split()), shown
    if invariance["exact"]:
        assert "sampling: batch-invariant on this CPU" in shown
    else:
        assert "NOT batch-invariant" in shown and invariance["inexact"][0] in shown
