"""Freed memory stays with the engine process while it works, and goes back once it is idle.

A training step allocates gigabytes of activations and gradients and frees them at its end. With
glibc's defaults every allocation of more than a few MB is a fresh ``mmap`` of 4 KiB pages and
every free gives it back to the kernel, so the next step takes a page fault for each page again,
and a large share of a step's time goes to the kernel. The settings below make malloc serve every
thread from one heap that is never trimmed, so small and medium blocks reuse the same pages step
after step, and map blocks of :data:`MMAP_FROM` bytes or more (a chunk's logits, the larger
activations) on their own, in 2 MiB transparent huge pages (glibc's ``hugetlb`` tunable): a fault
then brings in 512 pages at once, so a fresh mapping costs little, and freeing it gives it back at
once. A heap holding every block, big ones too, faults as rarely but fragments: big blocks of
changing sizes leave holes that keep its resident size far above the live tensors.

Kept for good, though, the heap is the engine's footprint for the rest of its life. So an engine
that has been idle for :data:`IDLE_TRIM_S` seconds gives its free heap back (:func:`trim`, glibc's
``malloc_trim``): a loop that sends its next op within seconds keeps its pages, and a finished or
paused one costs only what it holds. The bound that makes this cheap is the training memory budget
(:mod:`sess.engine.runtime.memory.training_budget`): a step's peak is a few times the weights, not dozens.

A decode step is the exception (:func:`sampling_heap`): its big blocks (the logits, the batch's KV
cache) have the same sizes step after step, so while it runs they come from the heap, and each
step reuses the pages the one before freed.

glibc reads these settings when a process starts, so :func:`engine_env` puts them in the
environment of the engine processes sess starts (``python -m sess.engine.server`` re-executes
itself under them). An in-process engine applies what can still be applied with ``mallopt``
(:func:`keep_freed_memory`: not the huge pages). Linux with glibc only; ``SESS_MALLOC=system``
turns both off, and values already in the environment are kept.

CPU engines only: on CUDA the activations live in the CUDA caching allocator, which keeps freed
blocks by itself, and the host heap holds little, so an engine on a GPU keeps glibc's defaults.

``SESS_MALLOC=jemalloc`` runs the engine on jemalloc instead (the system's ``libjemalloc.so.2``,
e.g. Debian's ``libjemalloc2``, preloaded; :data:`JEMALLOC_CONF`). Its size classes leave far less
free memory stranded between live blocks than glibc's heap, and freed pages go back two seconds
later, so an engine on it peaks lower at about the same speed (benchmarks/README.md has the
figures). It is a choice, not the default, because it needs a system library: the engine starts
the same everywhere on glibc. ``SESS_MALLOC=glibc`` (or unset) is the tuned heap above; ``system``
is glibc's own defaults.

Whatever the malloc, a CPU engine also caps the two caches of oneDNN primitives at
:data:`ONEDNN_CACHES` entries (torch's ideep keeps one, ``LRU_CACHE_CAPACITY``, and oneDNN its own,
``ONEDNN_PRIMITIVE_CACHE_CAPACITY``; 1,024 each by default). The sampler's linear layers run through
oneDNN, and a primitive is made for each shape: every prefill's row count is new, so over a run the
caches fill with primitives of ~0.3 MB each, most used once, and the engine's peak creeps up step
after step. A decode step needs one primitive per weight shape (five on smollm2, plus LoRA's), so
64 entries keep all of them, and a new one costs far less to make than a step takes. The runtime
also trims the heap where the engine switches between sampling and training (``Runtime.entering``),
and on glibc between the phases of a training op's micro-batches where the op's resident memory has
grown past its memory budget, and always between a checkpointed micro-batch's, whose long datum's
blocks fit the holes earlier steps left badly (``training_ops._Heap``).

A CPU engine's OpenMP threads also spin for a set time, not libgomp's set count
(:func:`.openmp_spin.spin_count`). Between two parallel regions a thread of torch's OpenMP runtime
(libgomp) spins for up to ~300,000 iterations before it sleeps. On cores that other processes use
too (a loop's own client, a test run, a shared host), the spinning threads take the cores from the
one thread that still has work, and every region can wait out a scheduler slice. Sleeping at once
(``OMP_WAIT_POLICY=PASSIVE``) is the other extreme: each region then pays a wake-up, which on free
cores costs a decode step more than the spinning saves. A spin as long as a decode step's serial
gaps (:data:`.openmp_spin.SPIN_SECONDS`) keeps the speed of free cores and most of the gain on
shared ones (the figures: benchmarks/README.md, "The engine's OpenMP spin"). A user's own
``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` wins. libgomp reads them when it loads (with torch), so
they go into the engine's environment; an in-process engine keeps its process's own setting.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import os
import sys

from sess.engine.runtime.memory import openmp_spin

KEEP = 2**31 - 1
MMAP_FROM = 4 << 20  # blocks this big or bigger are mapped on their own (glibc allows up to 32 MiB)
ENGINE_MALLOC = {
    "MALLOC_ARENA_MAX": "1",  # threads share the main heap (other arenas map big blocks anyway)
    "MALLOC_MMAP_THRESHOLD_": str(MMAP_FROM),  # fixed: glibc's own threshold moves with each free
    "MALLOC_TRIM_THRESHOLD_": str(KEEP),  # and freeing does not hand the heap's top back
    "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1",  # malloc's mappings and heap in transparent huge pages
}
# what mallopt can still set in a running process (glibc malloc.h): M_ARENA_MAX, M_MMAP_THRESHOLD,
# M_TRIM_THRESHOLD
_M_MMAP_THRESHOLD = -3
_MALLOPT = ((-8, 1), (_M_MMAP_THRESHOLD, MMAP_FROM), (-1, KEEP))
# while a decode step runs, blocks below this come from the heap (glibc's largest threshold)
SAMPLING_MMAP_FROM = 32 << 20

# entries each of oneDNN's primitive caches keeps (torch's ideep, oneDNN's own); both read at first use
ONEDNN_CACHES = {"LRU_CACHE_CAPACITY": "64", "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64"}

# what says how long an OpenMP thread out of work spins before it sleeps (libgomp reads them at
# load); the engine sets GOMP_SPINCOUNT (openmp_spin.spin_count) unless the user set either
OPENMP_USER = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")

# jemalloc (SESS_MALLOC=jemalloc): freed pages go back after ~2 s, by its own thread, and at once
# (muzzy 0: not lazily with MADV_FREE, which would leave them counted in the engine's RSS)
JEMALLOC_CONF = "background_thread:true,dirty_decay_ms:2000,muzzy_decay_ms:0"
CHOICES = ("glibc", "jemalloc", "system")  # SESS_MALLOC; unset means glibc

IDLE_TRIM_S = 5.0  # seconds without an op or a decode step before the engine trims its heap

_applied: bool | None = None


def choice(env) -> str:
    """``SESS_MALLOC`` of ``env``, checked: one of :data:`CHOICES` (unset: glibc)."""
    value = env.get("SESS_MALLOC", "") or "glibc"
    if value not in CHOICES:
        raise ValueError(f"SESS_MALLOC={value!r}: expected one of {', '.join(CHOICES)} (unset: glibc)")
    return value


def _engine_malloc(env, device: str) -> str:
    """The malloc an engine on ``device`` is set up for: :func:`choice` for a CPU engine on Linux,
    else ``system`` (nothing to set)."""
    wanted = choice(env)
    return wanted if device == "cpu" and sys.platform.startswith("linux") else "system"


def _enabled(env, device: str = "cpu") -> bool:
    return _engine_malloc(env, device) == "glibc"


def jemalloc_library() -> str | None:
    """The system's jemalloc (the loader's name for it, e.g. ``libjemalloc.so.2``), or None where it
    is not installed."""
    return ctypes.util.find_library("jemalloc")


def engine_env(base: dict[str, str] | None = None, device: str = "cpu") -> dict[str, str]:
    """The environment for an engine process on ``device``: ``base`` (default: this process's)
    plus the malloc settings above, unless turned off, already set, or the engine is not on CPU.
    With ``SESS_MALLOC=jemalloc``, jemalloc preloaded instead (ValueError where it is missing). A
    CPU engine's oneDNN caches are capped (:data:`ONEDNN_CACHES`) and its OpenMP threads spin
    for :data:`.openmp_spin.SPIN_SECONDS` whatever its malloc."""
    env = dict(os.environ if base is None else base)
    _cap_onednn(env, device)
    if device == "cpu" and not any(key in env for key in OPENMP_USER):
        env["GOMP_SPINCOUNT"] = str(openmp_spin.spin_count())
    malloc = _engine_malloc(env, device)
    if malloc == "jemalloc":
        library = jemalloc_library()
        if library is None:
            raise ValueError(
                "SESS_MALLOC=jemalloc: libjemalloc.so.2 is not installed (Debian/Ubuntu: "
                "apt install libjemalloc2; Fedora: dnf install jemalloc); or unset SESS_MALLOC"
            )
        preload = env.get("LD_PRELOAD", "")
        if library not in preload.split():
            env["LD_PRELOAD"] = f"{library} {preload}".strip()
        env.setdefault("MALLOC_CONF", JEMALLOC_CONF)
    elif malloc == "glibc":
        for key, value in ENGINE_MALLOC.items():
            env.setdefault(key, value)
    return env


def _cap_onednn(env, device: str) -> None:
    """:data:`ONEDNN_CACHES` into ``env`` for a CPU engine, where not set already."""
    if device == "cpu":
        for key, value in ONEDNN_CACHES.items():
            env.setdefault(key, value)


def allocator() -> str:
    """Which malloc this process runs on: ``jemalloc`` or ``glibc`` (elsewhere: ``system``)."""
    if _jemalloc_ctl() is not None:
        return "jemalloc"
    return "glibc" if sys.platform.startswith("linux") else "system"


@functools.cache
def _jemalloc_ctl():
    """jemalloc's ``mallctl`` where jemalloc is this process's malloc, else None."""
    try:
        ctl = ctypes.CDLL(None).mallctl
    except (OSError, AttributeError):
        return None
    ctl.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    ctl.restype = ctypes.c_int
    return ctl


def exec_as_engine(argv: list[str], device: str = "cpu") -> None:
    """Replace this process with ``argv`` (``argv[0]`` the program) under :func:`engine_env`, since
    glibc reads the settings only at start; return at once if they are in effect already."""
    env = engine_env(device=device)
    if env != dict(os.environ):
        os.execve(argv[0], argv, env)


def keep_freed_memory(device: str = "cpu") -> bool:
    """Apply the settings with ``mallopt`` in this process (once) for an engine on ``device``;
    whether glibc took them. The oneDNN caps go into this process's environment too, where they
    are not set: they hold if no oneDNN primitive has been made yet."""
    global _applied
    if _applied is None:
        _cap_onednn(os.environ, device)
        _applied = _enabled(os.environ, device) and allocator() == "glibc" and _mallopt()
    return _applied



def tuned() -> bool | None:
    """Whether :func:`keep_freed_memory` tuned this process's malloc: None if nothing asked it to."""
    return _applied


def _mallopt() -> bool:
    mallopt = _mallopt_function()
    return mallopt is not None and all(mallopt(param, value) == 1 for param, value in _MALLOPT)


@contextlib.contextmanager
def sampling_heap():
    """While the block runs (the engine's decode steps), blocks up to :data:`SAMPLING_MMAP_FROM`
    come from the heap, where this process's malloc is tuned (:func:`keep_freed_memory` or the
    engine's environment). A decode step's logits (12.6 MB for 64 rows of smollm2) and a batch's
    KV cache (a tensor a layer, 6 MB each for 8 x 8 rows) are then blocks the step or batch before
    freed, not fresh mappings that fault in and are zeroed each time. The sampler's big blocks
    repeat in size step after step, so they fit the holes they leave; training, whose blocks change
    size with every batch, keeps mapping its own (:data:`MMAP_FROM`), and the heap is trimmed where
    the engine switches to training or idles."""
    tuned_here = _fixed_threshold() and _set_mmap_threshold(SAMPLING_MMAP_FROM)
    try:
        yield
    finally:
        if tuned_here:
            _set_mmap_threshold(MMAP_FROM)


def _fixed_threshold() -> bool:
    """Whether this process's glibc maps blocks from :data:`MMAP_FROM` on, as tuned here or by
    :func:`engine_env` (an untuned glibc moves its own threshold up to the blocks it frees)."""
    from_env = os.environ.get("MALLOC_MMAP_THRESHOLD_") == str(MMAP_FROM) and allocator() == "glibc"
    return bool(_applied) or from_env


def _set_mmap_threshold(size: int) -> bool:
    mallopt = _mallopt_function()
    return mallopt is not None and mallopt(_M_MMAP_THRESHOLD, size) == 1


@functools.cache
def _mallopt_function():
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt


def trim() -> bool:
    """Hand the heap's free memory back to the kernel (glibc ``malloc_trim``; under jemalloc, a
    purge of every arena); whether it could."""
    ctl = _jemalloc_ctl()
    if ctl is not None:
        return ctl(b"arena.4096.purge", None, None, None, 0) == 0  # 4096: MALLCTL_ARENAS_ALL
    if not sys.platform.startswith("linux"):
        return False
    try:
        malloc_trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return False
    malloc_trim.argtypes, malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    malloc_trim(0)
    return True


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def peak_resident_bytes() -> int | None:
    """This process's highest resident memory so far (Linux ``/proc``: VmHWM), or None."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, IndexError, ValueError):
        pass
    return None


def resident_bytes() -> int | None:
    """This process's resident memory (Linux ``/proc``: VmRSS), or None where that cannot be read."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return None
