/* libgomp's spin loop (config/linux/wait.h, do_spin), timed for engine/runtime/memory/openmp_spin.py:
   a relaxed load of the flag, then cpu_relax (x86's pause; a compiler barrier elsewhere), ITERATIONS
   times; prints the median of ROUNDS rounds, in ns of the thread's own CPU time per iteration (busy
   cores slow the wall clock, not the loop). */

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
