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
times the loop libgomp runs, once per process, with a small C program built by the system's
compiler (``cc`` or ``$CC``, as the sampler's kernels are), and gives the count that spins
:data:`SPIN_SECONDS`: within libgomp's own bounds (its count for oversubscribed threads and its
default), :data:`FALLBACK` where the program cannot be built or run. The figures behind the time:
benchmarks/README.md, "The engine's OpenMP spin".
"""

from __future__ import annotations

import functools
import subprocess
import tempfile
from pathlib import Path

from sess.engine.sampling.native import c_compiler

SPIN_SECONDS = 150e-6  # how long an engine's OpenMP thread spins before it sleeps
FALLBACK = 3000  # the count where the loop cannot be timed here
LEAST, MOST = 1000, 300_000  # libgomp's count for oversubscribed threads, and its default

# libgomp's spin (config/linux/wait.h, do_spin): a relaxed load of the flag, then cpu_relax (x86's
# pause; a compiler barrier elsewhere), ITERATIONS times; the median of ROUNDS rounds, in ns of the
# thread's own CPU time per iteration (busy cores slow the wall clock, not the loop), printed
_PROGRAM = r"""
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
enum { ITERATIONS = 200000, ROUNDS = 9 };
static int flag;
static int cmp(const void *a, const void *b) { double x = *(const double *)a, y = *(const double *)b; return (x > y) - (x < y); }
int main(void)
{
    double ns[ROUNDS];
    for (int round = 0; round < ROUNDS; round++) {
        struct timespec start, end;
        clock_gettime(CLOCK_THREAD_CPUTIME_ID, &start);
        for (long i = 0; i < ITERATIONS; i++) {
            if (__atomic_load_n(&flag, __ATOMIC_RELAXED) != 0) return 1;
#if defined(__x86_64__) || defined(__i386__)
            __builtin_ia32_pause();
#else
            __asm__ volatile("" : : : "memory");
#endif
        }
        clock_gettime(CLOCK_THREAD_CPUTIME_ID, &end);
        ns[round] = ((end.tv_sec - start.tv_sec) * 1e9 + (end.tv_nsec - start.tv_nsec)) / ITERATIONS;
    }
    qsort(ns, ROUNDS, sizeof ns[0], cmp);
    printf("%.4f\n", ns[ROUNDS / 2]);
    return 0;
}
"""


@functools.cache
def spin_count() -> int:
    """``GOMP_SPINCOUNT`` for :data:`SPIN_SECONDS` of spinning on this CPU (:data:`FALLBACK` where
    the loop cannot be timed), timed once per process."""
    ns = iteration_ns()
    if ns is None or ns <= 0:
        return FALLBACK
    return min(MOST, max(LEAST, round(SPIN_SECONDS * 1e9 / ns)))


def iteration_ns() -> float | None:
    """Nanoseconds one iteration of libgomp's spin loop takes here; None where the system's C
    compiler is missing or the program fails."""
    compiler = c_compiler()
    if compiler is None:
        return None
    try:
        with tempfile.TemporaryDirectory(prefix="sess-spin-") as tmp:
            source, program = Path(tmp) / "spin.c", Path(tmp) / "spin"
            source.write_text(_PROGRAM)
            built = subprocess.run([compiler, "-O2", str(source), "-o", str(program)], capture_output=True, timeout=60)
            if built.returncode != 0:
                return None
            ran = subprocess.run([str(program)], capture_output=True, text=True, timeout=60)
            return float(ran.stdout) if ran.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, ValueError):  # no temp dir, a noexec one, a timeout
        return None
