"""The engine's ops: one table from op name to its request type, its handler and how it is scheduled.

Kinds: ``control`` ops run on the executor and answer their caller directly (create, list, stop
sessions, ...); ``ordered`` ops belong to one session and run in the order of the sequence numbers
its client stamped (training, saves, loads); ``unordered`` ops run as they come; ``batched`` ops
(sampling) join their base model's continuous decode batch and finish from the decode loop. The
executor checks a request against its type before queueing it (:mod:`sess.engine.protocol.requests`),
so a handler only ever sees well-typed input. What else the executor, the managed engine, billing and the
other ranks do around an op (save before a stop, forget a deleted session, record a checkpoint, pay
for its tokens, run it on every rank) is a property of its row here, not a test of its name there.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from sess.engine.protocol import requests as rq
from sess.engine.runtime.checkpoints import checkpoint_lifecycle
from sess.engine.runtime.ops import checkpoint_ops, sampling_ops, session_ops, training_ops


class Kind(enum.Enum):
    CONTROL = "control"
    ORDERED = "ordered"
    UNORDERED = "unordered"
    BATCHED = "batched"


@dataclass(frozen=True)
class Op:
    request: type[rq.Request]
    handler: Callable
    kind: Kind
    accounted: bool = True  # counted in its session's usage and recorded by the registry
    starts_session: bool = False  # counts against its key's live-session limit
    saves_first: bool = False  # the session's training state is saved first, on every rank (a stop)
    answers_next_seq: bool = False  # the answer carries the session's next sequence number
    forgets_session: bool = False  # the session's ordering state and registry record go with it
    adds_checkpoint: bool = False  # its answer's path is a new checkpoint in the registry
    removes_checkpoint: bool = False  # its answer's path leaves the registry
    restarts_order: bool = False  # its answer's session starts again at sequence number 1
    costly: bool = False  # its tokens are paid for: refused past its key's budget (billing)
    followed: bool = False  # every rank runs it: it changes the sessions, adapters or optimizer state all hold


OPS: dict[str, Op] = {
    "list_base_models": Op(rq.NoArgs, session_ops.list_base_models, Kind.CONTROL, accounted=False),
    "model_windows": Op(rq.NoArgs, session_ops.model_windows, Kind.CONTROL, accounted=False),
    "create_session": Op(
        rq.CreateSession, session_ops.create_session, Kind.CONTROL, starts_session=True, followed=True
    ),
    "create_session_from_state": Op(
        rq.CreateSessionFromState,
        session_ops.create_session_from_state,
        Kind.CONTROL,
        starts_session=True,
        restarts_order=True,
        followed=True,
    ),
    "stop_session": Op(rq.SessionName, session_ops.stop_session, Kind.CONTROL, saves_first=True, followed=True),
    "delete_session": Op(
        rq.DeleteSession, session_ops.delete_session, Kind.CONTROL, forgets_session=True, followed=True
    ),
    "list_sessions": Op(rq.ListSessions, session_ops.list_sessions, Kind.CONTROL, accounted=False),
    "get_usage": Op(rq.GetUsage, session_ops.get_usage, Kind.CONTROL, accounted=False),
    "session_info": Op(
        rq.SessionName, session_ops.session_info, Kind.CONTROL, accounted=False, answers_next_seq=True
    ),
    "tokenizer_files": Op(rq.TokenizerFiles, session_ops.tokenizer_files, Kind.CONTROL, accounted=False),
    "list_checkpoints": Op(
        rq.ListCheckpoints, checkpoint_ops.list_checkpoints, Kind.CONTROL, accounted=False
    ),
    "delete_checkpoint": Op(
        rq.DeleteCheckpoint, checkpoint_ops.delete_checkpoint, Kind.CONTROL, removes_checkpoint=True
    ),
    "model_info": Op(rq.ModelInfo, session_ops.model_info, Kind.CONTROL, accounted=False),
    "checkpoint_info": Op(
        rq.CheckpointPath, checkpoint_lifecycle.checkpoint_info, Kind.CONTROL, accounted=False
    ),
    "checkpoint_files": Op(rq.CheckpointPath, checkpoint_ops.checkpoint_files, Kind.CONTROL, accounted=False),
    "forward": Op(rq.ForwardRequest, training_ops.forward, Kind.ORDERED, costly=True, followed=True),
    "forward_backward": Op(
        rq.ForwardRequest, training_ops.forward_backward, Kind.ORDERED, costly=True, followed=True
    ),
    "optim_step": Op(rq.OptimStep, training_ops.optim_step, Kind.ORDERED, followed=True),
    "save_weights": Op(rq.SaveWeights, checkpoint_ops.save_weights, Kind.ORDERED, adds_checkpoint=True),
    "save_state": Op(rq.SaveState, checkpoint_ops.save_state, Kind.ORDERED, adds_checkpoint=True),
    "load_state": Op(rq.LoadState, checkpoint_ops.load_state, Kind.ORDERED, followed=True),
    "noop": Op(rq.Noop, session_ops.noop, Kind.ORDERED, accounted=False),
    "sample": Op(rq.SampleRequest, sampling_ops.start_sample, Kind.BATCHED, costly=True),
    "compute_logprobs": Op(rq.ComputeLogprobs, sampling_ops.compute_logprobs, Kind.UNORDERED, costly=True),
}
