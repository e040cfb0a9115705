"""Typed requests: one dataclass per engine op, the wire's single definition on both of its sides.

The SDK builds a request, checks it (:meth:`Request.check`) and sends ``to_wire()``; the engine reads
the same class back with :meth:`Request.from_wire`, which checks every field's type and bounds
(:mod:`.wire_checks`) before the executor ever sees the op, so bad input is a 400 that names the
field and never reaches torch. Checks that need the model (token ids against the vocabulary, prompt
length against the context) run in the op's handler. The engine's table of ops
(:mod:`sess.engine.runtime.ops.table`) names each op's request type and handler.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from sess.engine.protocol.data_checks import check_data, check_loss_fn
from sess.engine.protocol.errors import InvalidRequest
from sess.engine.protocol.types import AdamParams, Datum, SamplingParams
from sess.engine.protocol.wire_checks import bounded, check_fields, check_instance

MAX_DATUMS = 1 << 16  # datums in one forward / forward_backward
MAX_PROMPT = 1 << 20  # tokens in one prompt (the model's context is checked by the engine)
MAX_NAME = 128
MIN_TTL_S, MAX_TTL_S = 1, 10 * 366 * 86400  # a checkpoint's ttl_seconds: 1 s to ten years
MAX_METADATA = 64  # user_metadata entries on one checkpoint
Status = Literal["Starting", "Running", "Stopping", "Stopped", "Failed", "Interrupted"]


@dataclass(frozen=True, kw_only=True)
class Request:
    """Base of every request: reads and writes its fields as a JSON object."""

    envelope: ClassVar[tuple[str, ...]] = ()  # fields the transport carries outside ``args``

    @classmethod
    def from_wire(cls, wire: Any, where: str = "") -> Request:
        request = cls(**check_fields(cls, wire, where))
        request.check_values(where)
        return request

    def check(self, where: str = "") -> None:
        """Every field's type and bounds, then the checks across fields (the SDK calls this)."""
        check_instance(self, where)
        self.check_values(where)

    def check_values(self, where: str = "") -> None:
        """Checks across fields; subclasses add theirs."""

    def to_wire(self) -> dict:
        wire = {}
        for spec in dataclasses.fields(self):
            if spec.name in self.envelope:
                continue
            value = getattr(self, spec.name)
            if isinstance(value, list):
                value = [v.to_wire() if hasattr(v, "to_wire") else v for v in value]
            elif hasattr(value, "to_wire"):
                value = value.to_wire()
            wire[spec.name] = value
        return wire


def _name(default=None):
    return bounded(default, max_length=MAX_NAME)


# control ops ---------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class NoArgs(Request):
    pass


@dataclass(frozen=True, kw_only=True)
class CreateSession(Request):
    base_model: str = bounded(max_length=1024)
    name: str | None = _name()
    rank: int = bounded(32, 1, 1024)
    alpha: float = bounded(64.0, above=0.0)
    seed: int | None = bounded(None, 0, (1 << 63) - 1)
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True
    user_metadata: dict | None = None

    def check_values(self, where: str = "") -> None:
        if not (self.train_mlp or self.train_attn or self.train_unembed):
            raise InvalidRequest("train_mlp, train_attn, train_unembed: at least one must be true")


@dataclass(frozen=True, kw_only=True)
class CreateSessionFromState(Request):
    path: str
    name: str | None = _name()
    with_optimizer: bool = False
    user_metadata: dict | None = None  # the new session's; a continued session keeps its own


@dataclass(frozen=True, kw_only=True)
class SessionName(Request):
    name: str = _name()


@dataclass(frozen=True, kw_only=True)
class DeleteSession(Request):
    name: str = _name()
    stop_if_active: bool = False


@dataclass(frozen=True, kw_only=True)
class ListSessions(Request):
    name_contains: str | None = _name()
    status_equals: Status | None = None
    max_results: int | None = bounded(None, 1)


@dataclass(frozen=True, kw_only=True)
class GetUsage(Request):
    name: str | None = _name()


@dataclass(frozen=True, kw_only=True)
class TokenizerFiles(Request):
    base_model: str = bounded(max_length=1024)


@dataclass(frozen=True, kw_only=True)
class ModelInfo(Request):
    """A base model by catalog name, hub id or directory (another front end's names for it)."""

    base_model: str = bounded(max_length=1024)


@dataclass(frozen=True, kw_only=True)
class CheckpointPath(Request):
    path: str


@dataclass(frozen=True, kw_only=True)
class ListCheckpoints(Request):
    session: str = _name()


@dataclass(frozen=True, kw_only=True)
class DeleteCheckpoint(Request):
    path: str


# ops ordered by a session's sequence numbers ------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class SessionOp(Request):
    """An op of one session; the session's name travels in the op's envelope, not in ``args``."""

    envelope: ClassVar[tuple[str, ...]] = ("session",)
    session: str = _name()


@dataclass(frozen=True, kw_only=True)
class ForwardRequest(SessionOp):
    data: list[Datum] = bounded(max_items=MAX_DATUMS, min_items=1)
    loss_fn: str = "cross_entropy"
    loss_fn_config: dict | None = None

    def check_values(self, where: str = "") -> None:
        check_loss_fn(self.loss_fn, self.loss_fn_config)
        check_data(self.data, self.loss_fn)


@dataclass(frozen=True, kw_only=True)
class OptimStep(SessionOp):
    adam_params: AdamParams = field(default_factory=AdamParams)


def check_checkpoint_metadata(metadata: dict | None, where: str = "") -> None:
    """A checkpoint's ``user_metadata``: string keys to strings (1 KiB each), at most MAX_METADATA."""
    if metadata is None:
        return
    if len(metadata) > MAX_METADATA:
        raise InvalidRequest(f"{where}user_metadata: {len(metadata)} entries; at most {MAX_METADATA}")
    for key, value in metadata.items():
        if not isinstance(value, str) or len(str(key)) > 1024 or len(value) > 1024:
            raise InvalidRequest(
                f"{where}user_metadata.{str(key)[:40]}: expected a string of at most 1024 characters"
            )


@dataclass(frozen=True, kw_only=True)
class SaveWeights(SessionOp):
    name: str | None = _name()
    merge: bool = False
    transient: bool = False  # a sampler save the engine deletes once newer ones replace it
    ttl_seconds: int | None = bounded(None, MIN_TTL_S, MAX_TTL_S)  # None: kept until deleted
    user_metadata: dict | None = None  # strings to strings, kept with the checkpoint

    def check_values(self, where: str = "") -> None:
        if self.transient and (self.name is not None or self.merge):
            raise InvalidRequest("transient: a transient sampler save takes no name and no merge")
        check_checkpoint_metadata(self.user_metadata, where)


@dataclass(frozen=True, kw_only=True)
class SaveState(SessionOp):
    name: str | None = _name()
    ttl_seconds: int | None = bounded(None, MIN_TTL_S, MAX_TTL_S)  # None: kept until deleted
    user_metadata: dict | None = None  # strings to strings, kept with the checkpoint

    def check_values(self, where: str = "") -> None:
        check_checkpoint_metadata(self.user_metadata, where)


@dataclass(frozen=True, kw_only=True)
class LoadState(SessionOp):
    path: str
    with_optimizer: bool = False


@dataclass(frozen=True, kw_only=True)
class Noop(SessionOp):
    """Keeps a session's order moving past an op that never ran (cancelled on the client)."""


# sampling -------------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Target(Request):
    """What to sample from: a live session's weights, a checkpoint, or a base model (adapter off)."""

    session: str | None = _name()
    model_path: str | None = None
    base_model: str | None = bounded(None, max_length=1024)

    def check_values(self, where: str = "target") -> None:
        given = [k for k in ("session", "model_path", "base_model") if getattr(self, k) is not None]
        if len(given) != 1:
            raise InvalidRequest(f"{where or 'target'}: give exactly one of session, model_path, base_model")


@dataclass(frozen=True, kw_only=True)
class SampleRequest(Request):
    target: Target
    prompt: list[int] = bounded(max_items=MAX_PROMPT, min_items=1)
    num_samples: int = bounded(1, 1, 1024)
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    include_prompt_logprobs: bool = False
    topk_prompt_logprobs: int | None = bounded(None, 1, 1024)
    # each sequence also carries the trainer's logprobs of its tokens (``trainer_logprobs``)
    include_trainer_logprobs: bool = False
    # each sequence's top-k (token, logprob) at every sampled position (``topk_logprobs``)
    topk_sample_logprobs: int | None = bounded(None, 1, 1024)
    # prompt logprobs (and top-k) only for the last N prompt tokens; earlier entries None
    prompt_logprobs_last_n: int | None = bounded(None, 1)
    # [len(prompt) - 1][K] token ids (-1: none) whose logprob at prompt position i + 1 to return
    target_prompt_logprobs: list[list[int]] | None = bounded(None, max_items=MAX_PROMPT)
    # K draws at the request's temperature from the next-token distribution at each prompt position
    prompt_alt_tokens_k: int | None = bounded(None, 1, 1024)

    def check_values(self, where: str = "") -> None:
        check_prompt_options(self, self.include_prompt_logprobs or bool(self.topk_prompt_logprobs))


@dataclass(frozen=True, kw_only=True)
class ComputeLogprobs(Request):
    target: Target
    prompt: list[int] = bounded(max_items=MAX_PROMPT, min_items=1)
    prompt_logprobs_last_n: int | None = bounded(None, 1)  # score only the last N tokens

    def check_values(self, where: str = "") -> None:
        check_prompt_options(self, True)


def check_prompt_options(request, scores_prompt: bool) -> None:
    """The prompt-scoring options against the prompt: ``prompt_logprobs_last_n`` within 1..len - 1 and
    asked with prompt logprobs; ``target_prompt_logprobs`` one row of K >= 1 ids per prompt position
    after the first."""
    positions = len(request.prompt) - 1
    last_n = request.prompt_logprobs_last_n
    if last_n is not None:
        if not scores_prompt:
            raise InvalidRequest(
                "prompt_logprobs_last_n: applies to prompt logprobs; set include_prompt_logprobs "
                "(prompt_logprobs) or topk_prompt_logprobs"
            )
        if not 1 <= last_n <= positions:
            raise InvalidRequest(
                f"prompt_logprobs_last_n: must be between 1 and len(prompt) - 1 = {positions}, got {last_n}"
            )
    targets = getattr(request, "target_prompt_logprobs", None)
    if targets is not None:
        widths = {len(row) for row in targets}
        if len(targets) != positions or len(widths) != 1 or 0 in widths or positions * max(widths) > 1 << 20:
            shape = f"({len(targets)}, {'/'.join(map(str, sorted(widths))) or 0})"
            raise InvalidRequest(
                f"target_prompt_logprobs: shape {shape} is not (len(prompt) - 1, K) = ({positions}, K) "
                "with K >= 1 ids in every row (at most 2**20 ids)"
            )
        bad = next((t for row in targets for t in row if t < -1), None)
        if bad is not None:
            raise InvalidRequest(f"target_prompt_logprobs: token id {bad}; ids count from 0 (-1: none)")
