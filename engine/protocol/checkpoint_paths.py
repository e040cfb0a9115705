"""Checkpoint addresses: ``sess://<session>/<kind>/<name>``, parsed and checked on both sides of the wire.

Kinds: ``weights`` (a PEFT adapter for sampling), ``merged`` (a transformers model directory with the
adapter folded in), ``state`` (adapter plus AdamW moments) and ``sampler`` (a transient adapter that
``save_weights_and_get_sampling_client`` writes; the engine keeps each session's newest few). What
the files hold is :mod:`sess.engine.runtime.checkpoints.checkpoint_files`' business; this module only names them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from sess.engine.protocol.types import InvalidRequest

KINDS = ("weights", "merged", "state", "sampler")
_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
# the engine's id of a session whose name another key holds too: the name, ``@`` and 8 hex
_OWNED_SUFFIX = re.compile(r"@[0-9a-f]{8}$")


@dataclass(frozen=True)
class CheckpointRef:
    session: str
    kind: str
    name: str

    @property
    def uri(self) -> str:
        return f"sess://{self.session}/{self.kind}/{self.name}"

    def directory(self, home: Path) -> Path:
        return home / "checkpoints" / self.session / self.kind / self.name


def check_name(value: str, what: str) -> str:
    """A session or checkpoint name: letters, digits, '.', '_', '-'; at most 128; no '..'."""
    if not isinstance(value, str) or not _PART.match(value) or ".." in value:
        raise InvalidRequest(
            f"{what}: {value!r} is not a valid name (letters, digits, '.', '_', '-'; at most 128; no '..')"
        )
    return value


def parse_path(path: str, *, field: str = "path") -> CheckpointRef:
    """Parse ``sess://session/kind/name``; anything else (``..``, extra parts, other schemes) is refused."""
    if not isinstance(path, str) or not path.startswith("sess://"):
        raise InvalidRequest(
            f"{field}: expected a sess://<session>/<kind>/<name> checkpoint path, got {path!r}"
        )
    parts = path[len("sess://") :].split("/")
    if len(parts) != 3 or any(p in ("", ".", "..") for p in parts) or parts[1] not in KINDS:
        raise InvalidRequest(f"{field}: {path!r} is not sess://<session>/<{'|'.join(KINDS)}>/<name>")
    check_name(_OWNED_SUFFIX.sub("", parts[0]), field)
    check_name(parts[2], field)
    return CheckpointRef(*parts)
