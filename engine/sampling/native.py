"""The sampler's C kernels, built on first use for this CPU and loaded into the process.

The few-row matmul (``few_rows.c``, :mod:`.few_rows`) and a decode step's other work: attention
(a prefill's too), norms, the MLP's activation, token draws and logprobs (``fused_ops.c``, :mod:`.fused_ops`). The system's C
compiler (``cc``, or ``$CC``) builds both into one library with OpenMP, ``-march=native`` and
``-ffp-contract=off`` (every sum is rounded as the source writes it, whatever the CPU offers);
loaded, its threads are torch's own OpenMP team. Where there is no compiler, the build fails, no
temp dir can hold the library, or it would bring a second OpenMP runtime, :func:`library` says
why and each caller keeps its torch path.
"""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCES = tuple(Path(__file__).with_name(name) for name in ("few_rows.c", "fused_ops.c"))
_OPENMP = ("libgomp", "libiomp", "libomp")
_P, _L, _I = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
# each kernel's C signature (argtypes; every one returns an int status)
SIGNATURES = {
    "sess_few_rows": [_P, _I, _I, _P, _I, _I, _I, _P, _I],
    "sess_decode_attention": [_P, _L, _P, _L, _P, _L, _P, _P, _P, _P, _P, _P, _P, _P, _P, _P, _L, _L]
    + [_I, _I, _I, _I, _P, _I],
    "sess_prefill_attention": [_P, _L, _P, _P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _P, _I],
    "sess_rms_norm": [_P, _L, _P, _L, _P, ctypes.c_float, _I, _I, _P, _P, _I],
    "sess_silu_mul": [_P, _L, _P, _L, _I, _I, _P, _I],
    "sess_draw": [_P, _L, _I, _I, _P, _P, _P, _P, _P, _I],
    "sess_logprobs": [_P, _L, _I, _I, _P, _P, _I],
}


@functools.cache
def library() -> tuple[ctypes.CDLL | None, str]:
    """The kernels built for this CPU and loaded, with how; (None, why not) where they cannot be."""
    compiler = c_compiler()
    if compiler is None:
        return None, "not built: no C compiler (cc or $CC)"
    try:
        with tempfile.TemporaryDirectory(prefix="sess-kernels-") as tmp:
            built = Path(tmp) / "sess_kernels.so"
            done = subprocess.run(build_command(compiler, built), capture_output=True, text=True, timeout=120)
            if done.returncode != 0:
                return None, f"not built: {Path(compiler).name} failed: {done.stderr.strip()[-300:]}"
            lib = ctypes.CDLL(str(built))  # mapped: the file may go
    except (OSError, subprocess.SubprocessError) as exc:  # no temp dir, a noexec one, a timeout
        return None, f"not built: {exc}"
    runtimes = _openmp_runtimes()
    if runtimes is None or len(runtimes) > 1:
        return None, f"not used: OpenMP runtimes in the process {runtimes or 'unknown'} (one is torch's)"
    return declared(lib), f"built by {Path(compiler).name} for this CPU"


def c_compiler() -> str | None:
    """The path of the system's C compiler (``$CC``, else ``cc``), or None where there is none."""
    return shutil.which(os.environ.get("CC", "cc"))


def build_command(compiler: str, out: Path, arch: str = "native") -> list[str]:
    """The command that builds the kernels into ``out`` for the CPU ``arch`` (``-march``)."""
    flags = ["-O3", f"-march={arch}", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-Wno-psabi"]
    return [compiler, *flags, *map(str, SOURCES), "-o", str(out), "-lm"]


def declared(lib: ctypes.CDLL) -> ctypes.CDLL:
    """``lib`` with each kernel's C signature (:data:`SIGNATURES`) declared."""
    for name, argtypes in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return lib


def built() -> bool:
    """Whether :func:`library` has been asked yet (the kernels are built on first use, not by
    asking how they are)."""
    return bool(library.cache_info().currsize)


def _openmp_runtimes() -> set[str] | None:
    """The OpenMP libraries mapped into this process (None where that cannot be read)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    paths = {line.split()[-1] for line in maps.splitlines() if len(line.split()) >= 6}
    return {p for p in paths if Path(p).name.startswith(_OPENMP)}
