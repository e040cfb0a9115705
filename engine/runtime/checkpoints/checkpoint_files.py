"""Checkpoints on disk: PEFT adapters, optimizer state and merged models, all safetensors + JSON.

A checkpoint is addressed as ``sess://<session>/<kind>/<name>`` and lives at
``<home>/checkpoints/<session>/<kind>/<name>/``. Kinds:

- ``weights``: a PEFT adapter (``adapter_model.safetensors`` + ``adapter_config.json``) for sampling;
- ``merged``: a transformers model directory with the adapter folded in (the adapter it came from
  is kept under ``adapter/``, so the engine can sample from it cheaply);
- ``state``: the adapter plus AdamW moments (``optimizer.safetensors``) and ``state.json``;
- ``sampler``: a PEFT adapter like ``weights``, written by ``save_weights_and_get_sampling_client``
  without a name. These are transient: they live as long as their session and are deleted when it
  stops, so a client may keep sampling from any of them while the session runs, and an RL loop
  that publishes a sampler every step leaves nothing behind (``save_weights_for_sampler`` keeps its
  ``weights`` for good).

Every directory is written through :func:`sess.engine.protocol.home.atomic_dir`, its manifest
(:mod:`.manifest`: owner digest, session, kind, name, base model) inside it; nothing is pickled.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from sess.engine.protocol.checkpoint_paths import CheckpointRef
from sess.engine.protocol.errors import InvalidRequest, NotFound
from sess.engine.protocol.home import atomic_dir, remove_dir
from sess.engine.runtime.checkpoints.manifest import MANIFEST_FILE, write_manifest

STATE_FILES = ("adapter_model.safetensors", "adapter_config.json", "optimizer.safetensors", "state.json")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)


def _save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors wants contiguous CPU tensors that share no storage (tied weights do)."""
    copies = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in tensors.items()}
    save_file(copies, str(path), metadata={"format": "pt"})


def write_adapter(directory: Path, state: dict[str, torch.Tensor], config: dict) -> None:
    """Write a PEFT-format adapter into an existing (temp) directory."""
    _save_tensors(state, directory / "adapter_model.safetensors")
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True, default=str))


def read_adapter(directory: Path) -> tuple[dict[str, torch.Tensor], dict]:
    if not (directory / "adapter_model.safetensors").exists():
        raise NotFound(f"checkpoint {directory.name}: adapter files are missing")
    state = load_file(str(directory / "adapter_model.safetensors"))
    config = json.loads((directory / "adapter_config.json").read_text())
    return state, config


def _write_manifest(directory: Path, ref: CheckpointRef, owner: str, base_model: str) -> None:
    write_manifest(
        directory, owner=owner, session=ref.session, kind=ref.kind, name=ref.name, base_model=base_model
    )


def save_weights(
    ref: CheckpointRef,
    home: Path,
    state: dict[str, torch.Tensor],
    config: dict,
    *,
    owner: str,
    base_model: str,
) -> Path:
    target = ref.directory(home)
    with atomic_dir(target) as tmp:
        write_adapter(tmp, state, config)
        _write_manifest(tmp, ref, owner, base_model)
    return target


def save_state(
    ref: CheckpointRef,
    home: Path,
    adapter_state: dict[str, torch.Tensor],
    adapter_config: dict,
    optimizer_tensors: dict[str, torch.Tensor],
    meta: dict,
    *,
    owner: str,
) -> Path:
    target = ref.directory(home)
    with atomic_dir(target) as tmp:
        write_adapter(tmp, adapter_state, adapter_config)
        _save_tensors(optimizer_tensors, tmp / "optimizer.safetensors")
        (tmp / "state.json").write_text(json.dumps(meta, indent=2, sort_keys=True))
        _write_manifest(tmp, ref, owner, meta["base_model"])
    return target


def read_state(directory: Path) -> tuple[dict[str, torch.Tensor], dict, dict[str, torch.Tensor], dict]:
    """A state checkpoint's adapter, adapter config, AdamW tensors and ``state.json``; one with a
    file missing or unreadable (copied in part, damaged on disk) is a 400 that names what is wrong."""
    if not any((directory / name).is_file() for name in ("state.json", "optimizer.safetensors")):
        raise InvalidRequest(f"path: {directory.name} is not a state checkpoint (save it with save_state)")
    missing = [name for name in STATE_FILES if not (directory / name).is_file()]
    if missing:
        raise InvalidRequest(
            f"path: state checkpoint {directory.name} is not whole: {', '.join(missing)} missing"
        )
    try:
        adapter_state, adapter_config = read_adapter(directory)
        optimizer = load_file(str(directory / "optimizer.safetensors"))
        meta = json.loads((directory / "state.json").read_text())
    except (SafetensorError, ValueError, OSError) as exc:
        raise InvalidRequest(f"path: state checkpoint {directory.name} is damaged ({exc})") from None
    return adapter_state, adapter_config, optimizer, meta


def save_merged(
    ref: CheckpointRef,
    home: Path,
    model_config,
    merged_state: dict[str, torch.Tensor],
    base_dir: Path,
    adapter_state: dict[str, torch.Tensor],
    adapter_config: dict,
    *,
    owner: str,
    base_model: str,
) -> Path:
    """A transformers directory: config.json, model.safetensors, tokenizer files, and adapter/."""
    target = ref.directory(home)
    with atomic_dir(target) as tmp:
        model_config.save_pretrained(tmp)
        _save_tensors(merged_state, tmp / "model.safetensors")
        for name in TOKENIZER_FILES:
            if (base_dir / name).exists():
                shutil.copy2(base_dir / name, tmp / name)
        (tmp / "adapter").mkdir()
        write_adapter(tmp / "adapter", adapter_state, adapter_config)
        _write_manifest(tmp, ref, owner, base_model)
    return target


def adapter_dir(ref: CheckpointRef, home: Path) -> Path:
    """The directory holding the PEFT adapter of a checkpoint of any kind."""
    directory = ref.directory(home)
    if not directory.exists():
        raise NotFound(f"checkpoint {ref.uri} not found")
    return directory / "adapter" if ref.kind == "merged" else directory


def saved(session: str, home: Path, kind: str = "*") -> list[CheckpointRef]:
    """A session's checkpoints on disk (of ``kind``, default every kind), oldest first; directories
    being written or removed (hidden names) are not listed."""
    root = home / "checkpoints" / session
    found = [d for d in root.glob(f"{kind}/*") if d.is_dir() and not d.name.startswith(".")]
    found.sort(key=lambda d: (d.stat().st_mtime_ns, d.name))
    return [CheckpointRef(session, d.parent.name, d.name) for d in found]


def remove(ref: CheckpointRef, home: Path) -> None:
    """Delete a checkpoint's directory (renamed away first, so its path is gone at once)."""
    remove_dir(ref.directory(home))


def files(directory: Path) -> list[tuple[str, Path]]:
    """A checkpoint's files for a client (relative name, path), its manifest left out: that is the
    engine's record of the directory, not part of the checkpoint."""
    found = sorted(f for f in directory.rglob("*") if f.is_file() and f.name != MANIFEST_FILE)
    return [(str(f.relative_to(directory)), f) for f in found]
