"""Provenance spans of Tinker datums: read, checked against the recorded sequences, then used.

A datum's ``model_input_spans`` tile its input tokens and its ``loss_fn_input_spans`` tile its
``target_tokens`` (tinker 0.38's ``Datum.with_provenance``): consecutive runs, each claiming that
its positions are positions ``[offset, offset + length)`` of a recorded sequence's sampled tokens
(``SampledProvenanceSpan``) or of its request's prompt (``PromptProvenanceSpan``). The engine checks
every claim (the runs add up to the field they tile, each offset is in range, each ``sequence_id``
is one this Tinker session sampled and still holds (:mod:`.sequence_records`) and the
tokens are the ones sampled) and refuses a datum whose spans contradict it with a 400 naming the
datum and the span. A target on a prompt run that the loss leaves out (every input of its
``masked_by`` in :mod:`sess.engine.protocol.loss_registry` that the datum sends is 0 there) is a
placeholder and is not compared: cookbook 0.6.1's ``rl_loop`` sends 0 for every prompt target,
under a zero advantage. A loss that needs the sampler's logprobs from the record (``stable_reinforce``)
gets them: the rows on sampled runs take the recorded logprobs, the other rows keep the datum's
``logprobs`` (zero where it has none). Any other loss trains on the datum as sent.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sess.engine.protocol.errors import InvalidRequest
from sess.engine.protocol.loss_registry import LOSSES
from sess.engine.protocol.types import Datum, TensorData
from sess.engine.server.tinker.sequence_records import SequenceRecords

MAX_ID_CHARS = 200
RECORDED_LOGPROBS_LOSSES = frozenset({"stable_reinforce"})  # losses that read the recorded logprobs


@dataclass(frozen=True)
class Span:
    sampled: bool  # a run of sampled tokens; False: a run of the request's prompt
    sequence_id: str
    offset: int
    length: int


def read_spans(messages, where: str) -> list[Span]:
    """A datum's repeated ``ProvenanceSpan`` field as :class:`Span` runs (shape checks only)."""
    spans = []
    for j, message in enumerate(messages):
        kind = message.WhichOneof("span")
        if kind is None:
            raise InvalidRequest(f"{where}[{j}]: empty span; expected prompt_tokens or sampled_tokens")
        arm = getattr(message, kind)
        if not arm.sequence_id or len(arm.sequence_id) > MAX_ID_CHARS:
            raise InvalidRequest(f"{where}[{j}].sequence_id: expected 1 to {MAX_ID_CHARS} characters")
        if arm.offset < 0 or arm.length < 0:
            raise InvalidRequest(
                f"{where}[{j}]: offset {arm.offset} and length {arm.length} must both be >= 0"
            )
        spans.append(Span(kind == "sampled_tokens", arm.sequence_id, arm.offset, arm.length))
    return spans


def apply(
    data: list[Datum],
    spans: list[tuple[list[Span], list[Span]]],
    records: SequenceRecords | None,
    loss_fn: str,
) -> None:
    """Check every datum's spans against ``records`` (the Tinker session's); for a loss in
    :data:`RECORDED_LOGPROBS_LOSSES`, write the recorded sampler logprobs into its ``logprobs``."""
    for i, (datum, (model_spans, loss_spans)) in enumerate(zip(data, spans)):
        if not model_spans and not loss_spans:
            continue
        tokens = np.asarray(datum.model_input.to_ints(), np.int64)
        _check(tokens, model_spans, records, f"data[{i}].model_input_spans", "model_input")
        target = datum.loss_fn_inputs.get("target_tokens")
        target_ids = None if target is None else np.asarray(target.to_numpy())
        if target_ids is None or target_ids.ndim != 1:
            raise InvalidRequest(
                f"data[{i}].loss_fn_input_spans: they tile loss_fn_inputs['target_tokens'], which this "
                "datum lacks or has as (N, K); send (N,) target_tokens with provenance spans"
            )
        where = f"data[{i}].loss_fn_input_spans"
        unweighted = _unweighted(datum, loss_fn, len(target_ids))
        _check(target_ids.astype(np.int64), loss_spans, records, where, "target_tokens", unweighted)
        if loss_fn in RECORDED_LOGPROBS_LOSSES:
            datum.loss_fn_inputs["logprobs"] = _sampler_logprobs(datum, loss_spans, records, len(target_ids))


def _unweighted(datum: Datum, loss_fn: str, n: int) -> np.ndarray | None:
    """The target positions ``loss_fn`` leaves out: where every input of its ``masked_by`` that the
    datum sends with ``n`` values is 0 (None: it sends none of them)."""
    loss = LOSSES.get(loss_fn)
    masks = [datum.loss_fn_inputs.get(name) for name in (loss.masked_by if loss else ())]
    masks = [np.asarray(m.to_numpy()) for m in masks if m is not None]
    masks = [m for m in masks if m.shape == (n,)]
    return np.logical_and.reduce([m == 0 for m in masks]) if masks else None


def _check(
    tokens: np.ndarray,
    spans: list[Span],
    records: SequenceRecords | None,
    where: str,
    field: str,
    unweighted: np.ndarray | None = None,
) -> None:
    covered = sum(s.length for s in spans)
    if covered != len(tokens):
        raise InvalidRequest(
            f"{where}: the runs cover {covered} positions but {field} has {len(tokens)}; the spans must "
            "tile it exactly (model_input_spans and loss_fn_input_spans come as a pair)"
        )
    position = 0
    for j, span in enumerate(spans):
        record = records.get(span.sequence_id) if records is not None else None
        if record is None:
            raise InvalidRequest(
                f"{where}[{j}].sequence_id: {span.sequence_id[:80]!r} is not a sequence this session "
                "sampled, or its record expired (a day unused) or was dropped (the session's oldest go "
                "past 4M recorded tokens); send the datum without spans, or sample it again"
            )
        source, kind = (record.tokens, "sampled tokens") if span.sampled else (record.prompt, "prompt")
        if span.offset + span.length > len(source):
            raise InvalidRequest(
                f"{where}[{j}]: offset {span.offset} + length {span.length} is past the end of sequence "
                f"{span.sequence_id[:80]!r}'s {kind} ({len(source)} tokens)"
            )
        claimed = source[span.offset : span.offset + span.length]
        differs = tokens[position : position + span.length] != claimed
        if unweighted is not None and not span.sampled:  # a prompt target the loss leaves out
            differs &= ~unweighted[position : position + span.length]
        mismatch = np.flatnonzero(differs)
        if mismatch.size:
            k = int(mismatch[0])
            raise InvalidRequest(
                f"{where}[{j}]: {field}[{position + k}] is token {int(tokens[position + k])} but "
                f"sequence {span.sequence_id[:80]!r}'s {kind}[{span.offset + k}] was {int(claimed[k])}"
            )
        position += span.length


def _sampler_logprobs(datum: Datum, spans: list[Span], records: SequenceRecords | None, n: int) -> TensorData:
    given = datum.loss_fn_inputs.get("logprobs")
    values = np.zeros(n, np.float32) if given is None else np.asarray(given.to_numpy(), np.float32).copy()
    if values.shape != (n,):
        return given  # the batch checks name the wrong shape
    position = 0
    for span in spans:
        if span.sampled and records is not None:
            record = records.get(span.sequence_id)
            values[position : position + span.length] = record.logprobs[
                span.offset : span.offset + span.length
            ]
        position += span.length
    return TensorData(values, dtype="float32", shape=[n])
