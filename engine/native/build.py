"""C built once per machine: each artifact compiled into a disk cache and loaded from it afterwards.

:func:`build` compiles C sources from this folder with the system's C compiler (``$CC``, else
``cc``) into a file named by a hash of everything that decides its bytes: the sources and the
headers they include (:data:`HEADERS`), the flags, the compiler (its resolved path, size and
modification time, so an upgraded compiler builds anew) and the CPU (``/proc/cpuinfo``'s model
name and flags, which ``-march=native`` resolves from). The cache is :func:`cache_dir`:
``$SESS_KERNEL_CACHE`` where set, else ``$XDG_CACHE_HOME/sess/kernels``, else
``~/.cache/sess/kernels`` (per machine, not per ``$SESS_HOME``: a home holds a user's runs, and
tests give each their own). A second process, a second engine start, finds the file and runs no
compiler. Two processes building at once take turns on an ``fcntl`` lock beside the file; the
one that builds writes a temporary file and renames it into place, so a reader never sees half a
library and the other finds it built.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
HEADERS = (HERE / "kernels.h",)
TIMEOUT_S = 120


class BuildError(Exception):
    """The artifact could not be built here (no compiler, the compiler failed, no cache dir)."""


@dataclass(frozen=True)
class Built:
    """An artifact in the cache: its ``path``, and whether this call ran the compiler for it."""

    path: Path
    compiled: bool


def cache_dir() -> Path:
    """Where built artifacts live: ``$SESS_KERNEL_CACHE``, else the platform's user cache dir."""
    if os.environ.get("SESS_KERNEL_CACHE"):
        return Path(os.environ["SESS_KERNEL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "sess" / "kernels"


def c_compiler() -> str | None:
    """The path of the system's C compiler (``$CC``, else ``cc``), or None where there is none."""
    return shutil.which(os.environ.get("CC", "cc"))


def build(name: str, sources: tuple[str, ...], flags: tuple[str, ...], suffix: str = "") -> Built:
    """The cached artifact ``name`` built from ``sources`` (files in this folder) with ``flags``
    (``-shared`` among them for a library); compiled here only where the cache lacks it. Raises
    :class:`BuildError` saying why it cannot be had."""
    compiler = c_compiler()
    if compiler is None:
        raise BuildError("no C compiler (cc or $CC)")
    paths = [HERE / s for s in sources]
    target = cache_dir() / f"{name}-{key(paths, flags, compiler)[:20]}{suffix}"
    if target.exists():
        return Built(target, compiled=False)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target.with_name(target.name + ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, by the process's end too
            if target.exists():  # another process built it while this one waited
                return Built(target, compiled=False)
            partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
            try:
                command = [compiler, *flags, *map(str, paths), "-o", str(partial), "-lm"]
                done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S)
                if done.returncode != 0:
                    raise BuildError(f"{Path(compiler).name} failed: {done.stderr.strip()[-300:]}")
                os.replace(partial, target)
            finally:
                partial.unlink(missing_ok=True)
    except (OSError, subprocess.SubprocessError) as exc:  # no cache dir, a read-only one, a timeout
        raise BuildError(str(exc)) from exc
    return Built(target, compiled=True)


def key(sources: list[Path], flags: tuple[str, ...], compiler: str) -> str:
    """The hash naming an artifact: sources and headers, flags, compiler and CPU."""
    digest = hashlib.sha256()
    for path in (*sources, *HEADERS):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    resolved = Path(compiler).resolve()
    stat = resolved.stat()
    digest.update(f"{flags}\0{resolved}\0{stat.st_size}\0{stat.st_mtime_ns}\0{cpu()}".encode())
    return digest.hexdigest()


def cpu() -> str:
    """What ``-march=native`` resolves from: the CPU's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    wanted = ("model name", "flags", "Features", "CPU part", "CPU implementer")
    seen = dict(line.split(":", 1) for line in lines if line.split(":", 1)[0].strip() in wanted)
    return f"{platform.machine()} {sorted(seen.items())}"  # (platform.processor() runs uname)
