"""Tinker identifiers and checkpoint paths, and how each maps onto a sess session or ``sess://`` path.

A Tinker session id is ``tk-<12 hex>``; its training clients are models ``<session>:train:<n>``
(the SDK computes that form itself for a client made from a checkpoint) and its samplers
``<session>:sample:<n>``. A model is a sess session whose name swaps the colons for dots
(``tk-…:train:0`` is ``tk-….train.0``), so the mapping needs no table and survives restarts;
a run id without colons names a sess session as it is, so the Tinker SDK reaches checkpoints the
sess SDK made. Checkpoint kinds map one to one:

    tinker://<run>/weights/<name>           sess://<session>/state/<name>    adapter + AdamW state
    tinker://<run>/sampler_weights/<name>   sess://<session>/weights/<name>  PEFT adapter
    tinker://<run>/external_weights/<name>  sess://<session>/merged/<name>   transformers directory
"""

from __future__ import annotations

import re
import secrets

from sess.engine.protocol.checkpoint_paths import CheckpointRef, check_name, parse_path
from sess.engine.protocol.errors import InvalidRequest

SESSION_PREFIX = "tk-"
_SESSION = re.compile(r"^tk-[0-9a-f]{12}$")
_MODEL = re.compile(r"^(tk-[0-9a-f]{12}):train:(\d{1,9})$")
_SESS_MODEL = re.compile(r"^(tk-[0-9a-f]{12})\.train\.(\d{1,9})$")
TO_SESS_KIND = {"weights": "state", "sampler_weights": "weights", "external_weights": "merged"}
TO_TINKER_KIND = {v: k for k, v in TO_SESS_KIND.items()}
CHECKPOINT_TYPE = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}


def new_session_id() -> str:
    return SESSION_PREFIX + secrets.token_hex(6)


def is_session_id(value: str) -> bool:
    return isinstance(value, str) and bool(_SESSION.match(value))


def model_id(session_id: str, seq: int) -> str:
    return f"{session_id}:train:{seq}"


def sampler_id(session_id: str, seq: int) -> str:
    return f"{session_id}:sample:{seq}"


def session_of_model(model: str) -> str | None:
    """The Tinker session id of a model id, or None when the run was made through the sess SDK."""
    match = _MODEL.match(model)
    return match.group(1) if match else None


def sess_name(run_id: str, field: str = "model_id") -> str:
    """The sess session behind a Tinker model / training run id."""
    if not isinstance(run_id, str):
        raise InvalidRequest(f"{field}: expected a string, got {type(run_id).__name__}")
    match = _MODEL.match(run_id)
    if match:
        return f"{match.group(1)}.train.{match.group(2)}"
    if ":" in run_id:
        raise InvalidRequest(
            f"{field}: {run_id[:80]!r} is not a model id of this engine (<session>:train:<n>)"
        )
    return check_name(run_id, field)


def run_id(session: str) -> str:
    """The Tinker training run id of a sess session (the inverse of :func:`sess_name`)."""
    match = _SESS_MODEL.match(session)
    return f"{match.group(1)}:train:{match.group(2)}" if match else session


def to_sess_path(path: str, field: str = "path") -> str:
    """``tinker://<run>/<kind>/<name>`` as the ``sess://`` path of the same files."""
    if not isinstance(path, str) or not path.startswith("tinker://"):
        raise InvalidRequest(
            f"{field}: expected a tinker://<run>/<kind>/<name> path, got {str(path)[:120]!r}"
        )
    parts = path[len("tinker://") :].split("/")
    if len(parts) != 3 or parts[1] not in TO_SESS_KIND:
        raise InvalidRequest(
            f"{field}: {path[:120]!r} is not tinker://<run>/<{'|'.join(TO_SESS_KIND)}>/<name>"
        )
    name = check_name(parts[2], field)
    return CheckpointRef(sess_name(parts[0], field), TO_SESS_KIND[parts[1]], name).uri


def to_tinker_path(sess_path: str) -> str:
    ref = parse_path(sess_path)
    kind = TO_TINKER_KIND.get(ref.kind)
    if kind is None:
        raise InvalidRequest(f"path: sess checkpoints of kind {ref.kind!r} have no tinker:// form")
    return f"tinker://{run_id(ref.session)}/{kind}/{ref.name}"
