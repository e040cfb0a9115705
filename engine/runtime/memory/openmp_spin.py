"""How long a CPU engine's OpenMP threads spin, as a time: :data:`SPIN_SECONDS`, counted for this CPU.

Between two parallel regions a thread of torch's OpenMP runtime (libgomp) spins before it sleeps,
for ``GOMP_SPINCOUNT`` iterations of a loop that checks a flag and pauses. A decode step runs ~250
regions with a little serial work between them (Python, a kernel's setup). A thread that slept
must be woken for the next region; in a guest that costs the region tens of microseconds, 13 ms of
a 120 ms step at 64 rows when every region pays it. A thread that spins on cores other processes
use takes them from the thread with work. So a thread spins about as long as the serial gaps of a
step last, and no longer.

The count is of loop iterations, whose length is the CPU's ``pause`` instruction: 12 ns on one
host, several times that or less on others, so no one count means one time. :func:`spin_count`
times the loop libgomp runs, once per process, with a small C program (``engine/native/spin.c``,
built once per machine into the cache of :mod:`sess.engine.native.build`, as the sampler's
kernels are), and gives the count that spins
:data:`SPIN_SECONDS`: within libgomp's own bounds (its count for oversubscribed threads and its
default), :data:`FALLBACK` where the program cannot be built or run. The figures behind the time:
benchmarks/README.md, "The engine's OpenMP spin".
"""

from __future__ import annotations

import functools
import subprocess

from sess.engine.native.build import BuildError, build

SPIN_SECONDS = 150e-6  # how long an engine's OpenMP thread spins before it sleeps
FALLBACK = 3000  # the count where the loop cannot be timed here
LEAST, MOST = 1000, 300_000  # libgomp's count for oversubscribed threads, and its default


@functools.cache
def spin_count() -> int:
    """``GOMP_SPINCOUNT`` for :data:`SPIN_SECONDS` of spinning on this CPU (:data:`FALLBACK` where
    the loop cannot be timed), timed once per process."""
    ns = iteration_ns()
    if ns is None or ns <= 0:
        return FALLBACK
    return min(MOST, max(LEAST, round(SPIN_SECONDS * 1e9 / ns)))


def iteration_ns() -> float | None:
    """Nanoseconds one iteration of libgomp's spin loop takes here; None where the program
    cannot be built (no C compiler) or fails."""
    try:
        program = build("openmp_spin", ("spin.c",), ("-O2",)).path
        ran = subprocess.run([str(program)], capture_output=True, text=True, timeout=60)
        return float(ran.stdout) if ran.returncode == 0 else None
    except (BuildError, OSError, subprocess.SubprocessError, ValueError):  # a noexec cache, a timeout
        return None
