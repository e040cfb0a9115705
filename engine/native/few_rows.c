/* The few-row matmul of sess's sampler (built by engine/native, declared in kernels.h, called
   from engine/sampling/few_rows.py).

   y[r][n] = sum over k of x[r][k] * w[n][k], reading w in oneDNN's prepacked layout for fp32
   linear weights: tiles of `tile` output features, each tile's weights k-major,
   [n / tile][k][tile]. Each output sums k in blocks of `block` columns: within a block a chain
   of fused multiply-adds from zero in column order, and the blocks' sums added left to right.
   That is the order oneDNN's packed kernel sums a row in at the shapes where few_rows.py finds it
   equal to the bit, and it depends on nothing but the row, so a row gets the same result alone
   as among 64 others. Rows are independent; tiles are shared out between threads, in halves. */

#include "kernels.h"

#include <math.h>
#include <omp.h>
#include <stddef.h>
#include <string.h>

enum { WIDEST = 64 };

/* Columns [0, cols) of one tile: w and y point at the tile's first column to compute, w's rows
   `tile` floats apart. */
static inline __attribute__((always_inline)) void
tile_rows(const float *x, int rows, int k_total, const float *w, int block, float *y, int n_total, const int tile,
          const int cols)
{
    for (int r = 0; r < rows; r++) {
        const float *row = x + (size_t)r * k_total;
        float total[WIDEST];
        for (int lo = 0; lo < k_total; lo += block) {
            const int hi = lo + block < k_total ? lo + block : k_total;
            float acc[WIDEST];
            for (int j = 0; j < cols; j++) acc[j] = 0.0f;
            for (int k = lo; k < hi; k++) {
                const float xk = row[k];
                const float *wk = w + (size_t)k * tile;
                for (int j = 0; j < cols; j++) acc[j] = fmaf(xk, wk[j], acc[j]);
            }
            if (lo == 0) {
                for (int j = 0; j < cols; j++) total[j] = acc[j];
            } else {
                for (int j = 0; j < cols; j++) total[j] = total[j] + acc[j];
            }
        }
        memcpy(y + (size_t)r * n_total, total, sizeof(float) * cols);
    }
}

/* The threads share the tiles out in halves, each thread a contiguous run of them: a weight of an
   odd number of tiles (9 of 64 features for a 576-wide output) keeps both threads busy to the end
   instead of one thread reading a tile more. Each output's sum is the same whichever thread takes
   it. */
#define TILES_OF(T)                                                                                   \
    static void tiles_##T(const float *x, int rows, int k, const float *w, int n, int block,          \
                          float *y, int threads)                                                      \
    {                                                                                                 \
        const int halves = 2 * (n / T);                                                               \
        _Pragma("omp parallel num_threads(threads)")                                                  \
        {                                                                                             \
            const int team = omp_get_num_threads(), me = omp_get_thread_num();                        \
            int half = (int)((long)halves * me / team);                                               \
            const int end = (int)((long)halves * (me + 1) / team);                                    \
            if (half < end && half % 2) { /* a tile's second half */                                  \
                const int t = half / 2;                                                               \
                tile_rows(x, rows, k, w + (size_t)t * k * T + T / 2, block, y + (size_t)t * T + T / 2, \
                          n, T, T / 2);                                                               \
                half++;                                                                               \
            }                                                                                         \
            for (; half + 1 < end; half += 2) {                                                       \
                const int t = half / 2;                                                               \
                tile_rows(x, rows, k, w + (size_t)t * k * T, block, y + (size_t)t * T, n, T, T);      \
            }                                                                                         \
            if (half < end) { /* a tile's first half */                                               \
                const int t = half / 2;                                                               \
                tile_rows(x, rows, k, w + (size_t)t * k * T, block, y + (size_t)t * T, n, T, T / 2);  \
            }                                                                                         \
        }                                                                                             \
    }

TILES_OF(8)
TILES_OF(16)
TILES_OF(24)
TILES_OF(32)
TILES_OF(48)
TILES_OF(64)

/* x [rows][k] and y [rows][n] dense; returns 0, or -1 for a tile width not compiled here. */
int sess_few_rows(const float *x, int rows, int k, const float *w, int n, int tile, int block, float *y,
                  int threads)
{
    if (n % tile != 0 || block < 1) return -1;
    switch (tile) {
    case 8: tiles_8(x, rows, k, w, n, block, y, threads); return 0;
    case 16: tiles_16(x, rows, k, w, n, block, y, threads); return 0;
    case 24: tiles_24(x, rows, k, w, n, block, y, threads); return 0;
    case 32: tiles_32(x, rows, k, w, n, block, y, threads); return 0;
    case 48: tiles_48(x, rows, k, w, n, block, y, threads); return 0;
    case 64: tiles_64(x, rows, k, w, n, block, y, threads); return 0;
    default: return -1;
    }
}
