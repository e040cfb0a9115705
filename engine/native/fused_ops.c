/* A decode step's work besides its matmuls, and a prefill's attention, for sess's sampler
   (engine/native builds it, kernels.h declares it; engine/sampling/fused_ops.py calls it):
   attention over the KV cache, RMS norms (with the residual add before them) and the MLP's
   silu(gate) * up, each one call a layer over all rows; and token choice's draw with its logprob.

   Attention, one decode step, one layer: each row's new key and value go into the KV cache at
   the row's position (the key rotated there), and each query head attends over its row's columns
   0..position of its key/value head. The cache is the BlockCache's layer,
   [blocks][rows][kv heads][BLOCK][dim]: column c of row r, head h is at block c / BLOCK, slot
   c % BLOCK. A prefill's attention runs the same code on each prompt token, over its prompt's
   columns up to it.

   Every sum is taken in an order fixed by this code and the row's own data: a score is a dot
   product summed in LANES partial sums over dim (in order within each), the partials then added
   pairwise (hsum16; eight columns' scores are reduced together, each by the same additions);
   softmax subtracts the row's exact maximum, exponentiates (exp_neg16: IEEE operations only, no
   library call that may differ between CPUs) and sums the weights the same way, in LANES partial
   sums over columns then pairwise; the output adds weight * value in column order (a value read
   once for up to four query heads, each with its own sums) and divides by that sum at the end. A
   row reads no entries but its own (or the same entries of a sibling sample of its prompt: bit
   copies) and nothing past its position, so its result is the same alone as among 63 others,
   however long the others are. While a row computes, the next row's entries are asked for a few
   columns at a time (its own, and a prompt's where it is the row the prompt's samples read them
   from), so memory is read as the arithmetic runs. No fused multiply-adds (the build has
   -ffp-contract=off): the rotation is q * cos + roll(q) * sin rounded op by op, as torch's
   elementwise ops do it.

   Norms and the activation work row by row too: a norm sums a row's squares in LANES partial sums
   then pairwise, as a score; the activation is elementwise. So every row's result depends on that
   row alone. */

#include "kernels.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { LANES = 16, BLOCK = 64, WIDEST = 256, MOST_GROUPS = 16, TILE = 4 };

typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));

static inline v16 load16(const float *p)
{
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store16(float *p, v16 v) { memcpy(p, &v, sizeof v); }

static inline v16 splat16(float x) { return (v16){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

/* where `mask` is set (-1), a; elsewhere b */
static inline v16 select16(v16i mask, v16 a, v16 b) { return (v16)(((v16i)a & mask) | ((v16i)b & ~mask)); }

/* y = x * c + roll(x, dim / 2) * s, each product and the sum rounded on their own */
static inline void rotate(const float *restrict x, const float *restrict c, const float *restrict s, int dim,
                          float *restrict y)
{
    const int half = dim / 2;
    for (int d = 0; d < half; d++) {
        const float a = x[d] * c[d], b = x[d + half] * s[d];
        y[d] = a + b;
    }
    for (int d = half; d < dim; d++) {
        const float a = x[d] * c[d], b = x[d - half] * s[d];
        y[d] = a + b;
    }
}

/* p[0] + ... + p[15] pairwise: p[l] + p[l + 8], those + 4 apart, + 2 apart, + 1 apart */
static inline float hsum16(v16 p)
{
    const v8 h = __builtin_shufflevector(p, p, 0, 1, 2, 3, 4, 5, 6, 7)
                 + __builtin_shufflevector(p, p, 8, 9, 10, 11, 12, 13, 14, 15);
    const v4 q = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
    return (q[0] + q[2]) + (q[1] + q[3]);
}

/* e^x for x <= 0 (0 below -87), 16 at a time: x = n ln 2 + r, e^r by Cephes' expf polynomial,
   times 2^n built from its bits; every step an IEEE operation on each lane, so the same bits on
   every CPU and at every lane */
static inline v16 exp_neg16(v16 x)
{
    const v16i below = x < splat16(-87.0f);
    x = select16(below, splat16(-87.0f), x);
    const v16 shift = splat16(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
    const v16 n = (x * 1.44269504088896341f + shift) - shift;
    v16 r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    const v16 z = r * r;
    v16 y = splat16(1.9875691500e-4f);
    y = y * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * z + r + 1.0f;
    const v16 scale = (v16)((v16u)(__builtin_convertvector(n, v16i) + 127) << 23); /* 2^n */
    return select16(below, splat16(0.0f), y * scale);
}

/* hsum16 of each of the 8 vectors p[0..7] at once: lane i of the result is hsum16(p[i]), its
   additions the same ones in the same order (p[l] + p[l + 8], those + 4 apart, then
   (q[0] + q[2]) + (q[1] + q[3])), the vectors' lanes regrouped between them */
static inline v8 hsum16_x8(const v16 p[8])
{
    v16 t[4], u[2];
    for (int i = 0; i < 4; i++) /* lanes 0-7: p[2i]'s l + (l + 8); lanes 8-15: p[2i + 1]'s */
        t[i] = __builtin_shufflevector(p[2 * i], p[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
               + __builtin_shufflevector(p[2 * i], p[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28,
                                         29, 30, 31);
    for (int i = 0; i < 2; i++) /* four lanes a vector: its l + (l + 4) */
        u[i] = __builtin_shufflevector(t[2 * i], t[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
               + __builtin_shufflevector(t[2 * i], t[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29,
                                         30, 31);
    /* two lanes a vector: q[0] + q[2] and q[1] + q[3] */
    const v16 v = __builtin_shufflevector(u[0], u[1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29)
                  + __builtin_shufflevector(u[0], u[1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
    return __builtin_shufflevector(v, v, 0, 2, 4, 6, 8, 10, 12, 14)
           + __builtin_shufflevector(v, v, 1, 3, 5, 7, 9, 11, 13, 15);
}

/* where column c of a row's entries is from the row's first: block c / BLOCK, slot c % BLOCK */
static inline size_t column_at(int64_t c, size_t block_stride, size_t column_stride)
{
    return (size_t)(c / BLOCK) * block_stride + (size_t)(c % BLOCK) * column_stride;
}

/* column c of a row's cache entries: below `shared` its source row's (the same entries) */
static inline const float *column_of(const float *own, const float *source, int64_t shared, int64_t c,
                                     size_t block_stride, size_t column_stride)
{
    return (c < shared ? source : own) + column_at(c, block_stride, column_stride);
}

/* where batch row r's entries for key/value head h start in a cache layer: at its place (row r
   itself where `places` is NULL), `slot` floats a (row, head) a block */
static inline size_t entries_of(const int64_t *places, int64_t r, int h, int kv_heads, size_t slot)
{
    return ((size_t)(places ? places[r] : r) * kv_heads + h) * slot;
}

/* the cache entries a decode task asks for while another computes: columns next..end - 1 of one
   row's keys and values (dim floats a column), each column's cache lines requested into L2 (the
   hardware's stream prefetch stops at each 4 KiB page, 16 columns of a slot) */
typedef struct {
    const float *keys, *values;
    int64_t next, end;
    size_t block_stride;
    int dim;
} ahead_t;

/* request up to `columns` more of `a`'s columns (none where a is NULL or done) */
static inline void ask_ahead(ahead_t *a, int columns)
{
    if (a == NULL) return;
    for (; columns > 0 && a->next < a->end; columns--, a->next++) {
        const size_t at = column_at(a->next, a->block_stride, (size_t)a->dim);
        for (int d = 0; d < a->dim; d += 16) {
            __builtin_prefetch(a->keys + at + d, 0, 2);
            __builtin_prefetch(a->values + at + d, 0, 2);
        }
    }
}

/* out[g] for G query heads at once: the sum over columns c <= position of weights[g][c] *
   value[c] in column order (each product, then its add, rounded on its own), divided by total[g]
   at the end; each value is read once for all G */
static inline __attribute__((always_inline)) void
weigh_values(const float *weights, int64_t longest, const int G, const float *row_values,
             const float *source_values, int64_t shared, size_t block_stride, size_t column_stride,
             int64_t position, const int dim, const float *total, float *out, ahead_t *ahead)
{
    v16 acc[4][WIDEST / LANES];
    for (int g = 0; g < G; g++)
        for (int j = 0; j < dim / LANES; j++) acc[g][j] = splat16(0.0f);
    for (int64_t c = 0; c <= position; c++) {
        ask_ahead(ahead, 1);
        const float *value = column_of(row_values, source_values, shared, c, block_stride, column_stride);
        for (int j = 0; j < dim / LANES; j++) {
            const v16 entries = load16(value + j * LANES);
            for (int g = 0; g < G; g++) acc[g][j] = acc[g][j] + splat16(weights[g * longest + c]) * entries;
        }
    }
    for (int g = 0; g < G; g++)
        for (int j = 0; j < dim / LANES; j++) store16(out + (size_t)g * dim + j * LANES, acc[g][j] / total[g]);
}

/* A row of scores in place to e^(score - max) over its padded width (columns past the row: e^-inf = 0);
   returns their sum. The max is exact in any order; the sum runs in lane order. */
static inline __attribute__((always_inline)) float softmax_row(float *s, int64_t columns, int64_t padded) {
    for (int64_t c = columns; c < padded; c++) s[c] = -INFINITY;
    v16 top = load16(s);
    for (int64_t c = LANES; c < padded; c += LANES) {
        const v16 next = load16(s + c);
        top = select16(next > top, next, top);
    }
    float most = top[0];
    for (int l = 1; l < LANES; l++) most = top[l] > most ? top[l] : most;
    v16 sum = splat16(0.0f);
    for (int64_t c = 0; c < padded; c += LANES) {
        const v16 weights = exp_neg16(load16(s + c) - most);
        store16(s + c, weights);
        sum = sum + weights;
    }
    return hsum16(sum);
}

/* one row's attention for key/value head h: its groups of query heads over columns 0..position.
   Scores are taken 8 columns at a time, each column's dot product in its own vector of partial
   sums, the 8 reduced together (hsum16_x8: each the bits of its own hsum16) */
static inline __attribute__((always_inline)) void
row_head(const float *query_in, const float *q_cos, const float *q_sin, const float *row_keys,
         const float *row_values, const float *source_keys, const float *source_values, int64_t shared,
         size_t block_stride, size_t column_stride, int64_t position, int groups, const int dim, float *scores,
         int64_t longest, float *out, ahead_t *ahead)
{
    float query[MOST_GROUPS][WIDEST];
    for (int g = 0; g < groups; g++) rotate(query_in + (size_t)g * dim, q_cos, q_sin, dim, query[g]);
    for (int64_t first = 0; first <= position; first += 8) {
        ask_ahead(ahead, 8);
        const float *key[8];
        for (int i = 0; i < 8; i++) /* past the row: its last column again (the score is set to -inf below) */
            key[i] = column_of(row_keys, source_keys, shared, first + i <= position ? first + i : position,
                               block_stride, column_stride);
        for (int g = 0; g < groups; g++) {
            v16 p[8];
            for (int i = 0; i < 8; i++) { /* LANES partial sums over dim, in order */
                v16 sum = load16(query[g]) * load16(key[i]);
                for (int d = LANES; d < dim; d += LANES) sum = sum + load16(query[g] + d) * load16(key[i] + d);
                p[i] = sum;
            }
            const v8 dots = hsum16_x8(p);
            memcpy(scores + g * longest + first, &dots, sizeof dots);
        }
    }
    float total[MOST_GROUPS];
    const int64_t columns = position + 1, padded = (columns + LANES - 1) / LANES * LANES;
    for (int g = 0; g < groups; g++) {
        total[g] = softmax_row(scores + g * longest, columns, padded);
    }
    /* the groups a few at a time (their sums stay in registers), each value read once for them */
    const int most_at_once = dim <= 64 ? 4 : dim <= 128 ? 2 : 1;
    for (int g = 0; g < groups; g += most_at_once) {
        const int n = groups - g < most_at_once ? groups - g : most_at_once;
        const float *w = scores + g * longest;
        float *o = out + (size_t)g * dim;
#define WEIGH(G) \
    weigh_values(w, longest, G, row_values, source_values, shared, block_stride, column_stride, position, dim, \
                 total + g, o, ahead) /* G a constant: each count's sums in registers */
        if (n == 4) WEIGH(4);
        else if (n == 3) WEIGH(3);
        else if (n == 2) WEIGH(2);
        else WEIGH(1);
#undef WEIGH
    }
}

/* row_head, its loops built for the common head sizes (64, 128) and for any other */
static void attend_head(const float *query, const float *q_cos, const float *q_sin, const float *row_keys,
                        const float *row_values, const float *source_keys, const float *source_values, int64_t shared,
                        size_t block_stride, size_t column_stride, int64_t position, int groups, int dim,
                        float *scores, int64_t longest, float *out, ahead_t *ahead)
{
    if (dim == 64)
        row_head(query, q_cos, q_sin, row_keys, row_values, source_keys, source_values, shared, block_stride,
                 column_stride, position, groups, 64, scores, longest, out, ahead);
    else if (dim == 128)
        row_head(query, q_cos, q_sin, row_keys, row_values, source_keys, source_values, shared, block_stride,
                 column_stride, position, groups, 128, scores, longest, out, ahead);
    else
        row_head(query, q_cos, q_sin, row_keys, row_values, source_keys, source_values, shared, block_stride,
                 column_stride, position, groups, dim, scores, longest, out, ahead);
}

/* q [rows][heads * dim] (row stride q_stride floats), k and v [rows][kv_heads * dim] (strides
   k_stride, v_stride), cos, sin, q_cos, q_sin [rows][dim] (the queries' rotation carries their
   scaling); keys and values the cache, `held` rows a block, `columns` columns a row; out
   [rows][heads * dim]. Row r's entries are the cache's row places[r] (with `places` NULL, row r;
   rows that left the batch stay in the cache unread until it is compacted). With `sources` (else
   NULL), row r reads its columns below shared[r] from row sources[r]'s entries, which are the same
   there (a prompt's samples: the prompt's entries are read from memory once for all of them and
   from the core's cache after; the bits are those of the row's own copy). Returns 0, -1 for a
   shape not built here, -2 where memory ran out, -3 for a position outside the cache, -4 for a
   source outside the rows or a shared prefix past a row's or its source's position, -5 for a
   place outside the cache's rows or two rows in one place. */
int sess_decode_attention(const float *q, int64_t q_stride, const float *k, int64_t k_stride, const float *v,
                          int64_t v_stride, const float *cos, const float *sin, const float *q_cos,
                          const float *q_sin, float *keys, float *values, const int64_t *positions,
                          const int64_t *sources, const int64_t *shared, const int64_t *places, int64_t held,
                          int64_t columns, int rows, int heads, int kv_heads, int dim, float *out, int threads)
{
    if (dim % LANES || dim > WIDEST || kv_heads <= 0 || heads % kv_heads || heads / kv_heads > MOST_GROUPS)
        return -1;
    for (int r = 0; r < rows; r++)
        if (positions[r] < 0 || positions[r] >= columns) return -3;
    if (places != NULL) /* ascending, so no two rows write one place */
        for (int r = 0; r < rows; r++)
            if (places[r] < 0 || places[r] >= held || (r > 0 && places[r] <= places[r - 1])) return -5;
    if (places == NULL && held != rows) return -5;
    if (sources != NULL)
        for (int r = 0; r < rows; r++) {
            const int64_t source = sources[r];
            if (source < 0 || source >= rows || shared[r] < 0 || shared[r] > positions[r]
                || shared[r] > positions[source])
                return -4;
        }
    const int groups = heads / kv_heads;
    const size_t slot = (size_t)BLOCK * dim, block_stride = (size_t)held * kv_heads * slot;
    int64_t longest = 1;
    for (int r = 0; r < rows; r++)
        if (positions[r] + 1 > longest) longest = positions[r] + 1;
    longest = (longest + LANES - 1) / LANES * LANES; /* a score row's room: whole vectors */
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *scores = malloc(sizeof(float) * (size_t)groups * (size_t)longest);
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int task = 0; task < rows * kv_heads; task++) {
            if (scores == NULL) continue;
            const int r = task / kv_heads, h = task % kv_heads;
            const int64_t position = positions[r], common = sources ? shared[r] : 0;
            const size_t own = entries_of(places, r, h, kv_heads, slot);
            const size_t from_source = entries_of(places, sources ? sources[r] : r, h, kv_heads, slot);
            float *row_keys = keys + own, *row_values = values + own;
            const float *source_keys = keys + from_source, *source_values = values + from_source;
            const size_t here = column_at(position, block_stride, dim);
            rotate(k + r * k_stride + h * dim, cos + (size_t)r * dim, sin + (size_t)r * dim, dim, row_keys + here);
            memcpy(row_values + here, v + r * v_stride + h * dim, sizeof(float) * dim);
            /* the next task's entries asked for a few columns at a time while this one computes:
               its own, and a prompt's where it is the row the prompt's samples read them from (the
               others then find them in the core's cache: the step's matmuls have evicted them) */
            ahead_t ahead = {0};
            if (task + 1 < rows * kv_heads) {
                const int nr = (task + 1) / kv_heads, nh = (task + 1) % kv_heads;
                const size_t at = entries_of(places, nr, nh, kv_heads, slot);
                const int64_t from = sources && sources[nr] != nr ? shared[nr] : 0;
                ahead = (ahead_t){keys + at, values + at, from, positions[nr], block_stride, dim};
            }
            const float *query = q + r * q_stride + (size_t)h * groups * dim;
            const float *qc = q_cos + (size_t)r * dim, *qs = q_sin + (size_t)r * dim;
            float *o = out + ((size_t)r * heads + (size_t)h * groups) * dim;
            attend_head(query, qc, qs, row_keys, row_values, source_keys, source_values, common, block_stride, dim,
                        position, groups, dim, scores, longest, o, &ahead);
        }
        free(scores);
    }
    return failed ? -2 : 0;
}

/* weigh_values for two tokens at once (G query heads each): token 0 over columns 0..positions[0],
   token 1 over 0..positions[1] (positions[0] <= positions[1]), each value read once for both; each
   token's sums are those weigh_values makes for it alone, in the same order */
static inline __attribute__((always_inline)) void
weigh_values_x2(const float *const weights[2], int64_t longest, const int G, const float *row_values,
                const float *source_values, int64_t shared, size_t block_stride, size_t column_stride,
                const int64_t positions[2], const int dim, const float *const total[2], float *const out[2])
{
    v16 acc[2][2][WIDEST / LANES];
    for (int t = 0; t < 2; t++)
        for (int g = 0; g < G; g++)
            for (int j = 0; j < dim / LANES; j++) acc[t][g][j] = splat16(0.0f);
    for (int64_t c = 0; c <= positions[1]; c++) {
        const float *value = column_of(row_values, source_values, shared, c, block_stride, column_stride);
        const int first = c <= positions[0] ? 0 : 1;
        for (int j = 0; j < dim / LANES; j++) {
            const v16 entries = load16(value + j * LANES);
            for (int t = first; t < 2; t++)
                for (int g = 0; g < G; g++)
                    acc[t][g][j] = acc[t][g][j] + splat16(weights[t][g * longest + c]) * entries;
        }
    }
    for (int t = 0; t < 2; t++)
        for (int g = 0; g < G; g++)
            for (int j = 0; j < dim / LANES; j++)
                store16(out[t] + (size_t)g * dim + j * LANES, acc[t][g][j] / total[t][g]);
}

/* row_head for `count` <= TILE consecutive tokens of one prompt (positions[i] = positions[0] + i,
   the same columns below them): each key read once for all of them, each value once a pair, and
   each token's arithmetic row_head's for it alone, to the bit (a score is its column's dot
   product, whatever columns share its 8; a row's softmax and sums run over its own columns) */
static inline __attribute__((always_inline)) void
tile_head(const float *query_in, int64_t q_stride, const float *q_cos, const float *q_sin, const float *row_keys,
          const float *row_values, const float *source_keys, const float *source_values, int64_t shared,
          size_t block_stride, size_t column_stride, const int64_t *positions, int count, int groups, const int dim,
          float *scores, int64_t longest, float *out, size_t out_stride)
{
    float query[TILE][MOST_GROUPS][WIDEST];
    for (int t = 0; t < count; t++)
        for (int g = 0; g < groups; g++)
            rotate(query_in + t * q_stride + (size_t)g * dim, q_cos + (size_t)t * dim, q_sin + (size_t)t * dim, dim,
                   query[t][g]);
    const int64_t last = positions[count - 1];
    for (int64_t first = 0; first <= last; first += 8) {
        const float *key[8];
        for (int i = 0; i < 8; i++) /* past the tile: its last column again (those scores are not read) */
            key[i] = column_of(row_keys, source_keys, shared, first + i <= last ? first + i : last, block_stride,
                               column_stride);
        for (int t = 0; t < count; t++) {
            if (first > positions[t]) continue;
            for (int g = 0; g < groups; g++) {
                v16 p[8];
                for (int i = 0; i < 8; i++) {
                    v16 sum = load16(query[t][g]) * load16(key[i]);
                    for (int d = LANES; d < dim; d += LANES) sum = sum + load16(query[t][g] + d) * load16(key[i] + d);
                    p[i] = sum;
                }
                const v8 dots = hsum16_x8(p);
                memcpy(scores + ((size_t)t * groups + g) * longest + first, &dots, sizeof dots);
            }
        }
    }
    float total[TILE][MOST_GROUPS];
    for (int t = 0; t < count; t++) {
        const int64_t columns = positions[t] + 1, padded = (columns + LANES - 1) / LANES * LANES;
        for (int g = 0; g < groups; g++) {
            total[t][g] = softmax_row(scores + ((size_t)t * groups + g) * longest, columns, padded);
        }
    }
    const int at_once = dim <= 64 ? 2 : 1; /* two tokens' sums in registers: 2 x at_once x dim / 16 */
    int t = 0;
    for (; t + 1 < count; t += 2)
        for (int g = 0; g < groups; g += at_once) {
            const int n = groups - g < at_once ? groups - g : at_once;
            const float *const w[2] = {scores + ((size_t)t * groups + g) * longest,
                                       scores + ((size_t)(t + 1) * groups + g) * longest};
            const float *const tot[2] = {total[t] + g, total[t + 1] + g};
            float *const o[2] = {out + t * out_stride + (size_t)g * dim, out + (t + 1) * out_stride + (size_t)g * dim};
            if (n == 2)
                weigh_values_x2(w, longest, 2, row_values, source_values, shared, block_stride, column_stride,
                                positions + t, dim, tot, o);
            else
                weigh_values_x2(w, longest, 1, row_values, source_values, shared, block_stride, column_stride,
                                positions + t, dim, tot, o);
        }
    if (t < count) /* an odd token: on its own, as row_head weighs */
        for (int g = 0; g < groups; g++)
            weigh_values(scores + ((size_t)t * groups + g) * longest, longest, 1, row_values, source_values, shared,
                         block_stride, column_stride, positions[t], dim, total[t] + g,
                         out + t * out_stride + (size_t)g * dim, NULL);
}

/* A prefill's attention, one layer: token t's query heads attend over its prompt's columns
   0..positions[t], to the bit as a decode step's row_head would. keys (rotated) and values are the
   tokens this prefill computes, [tokens][kv_heads][dim]; a prompt's column c is token lows[t] + c
   below splits[t] (a prefix it shares with other prompts, computed once) and token highs[t] + c
   from there on. q [tokens][heads * dim] (row stride q_stride floats), q_cos, q_sin [tokens][dim]
   (the queries' rotation, carrying their scaling); out [tokens][heads * dim]. Consecutive tokens
   of one prompt go TILE at a time (tile_head: each key read once for them), and a token's result
   depends only on its query and its prompt's entries, so a prompt's tokens come out the same
   prefilled alone, beside other prompts or on a prefix shared with them. Returns 0, -1 for a shape
   not built here, -2 where memory ran out, -3 for columns outside the tokens. */
int sess_prefill_attention(const float *q, int64_t q_stride, const float *q_cos, const float *q_sin,
                           const float *keys, const float *values, const int64_t *positions,
                           const int64_t *splits, const int64_t *lows, const int64_t *highs, int tokens, int heads,
                           int kv_heads, int dim, float *out, int threads)
{
    if (dim % LANES || dim > WIDEST || kv_heads <= 0 || heads % kv_heads || heads / kv_heads > MOST_GROUPS)
        return -1;
    int64_t longest = 1;
    for (int t = 0; t < tokens; t++) {
        const int64_t position = positions[t], split = splits[t], low = lows[t], high = highs[t];
        if (position < 0 || split < 0 || split > position + 1 || low < 0 || high < 0
            || (split > 0 && low + split > tokens) || (split <= position && high + position >= tokens))
            return -3;
        if (position + 1 > longest) longest = position + 1;
    }
    longest = (longest + LANES - 1) / LANES * LANES;
    int *starts = malloc(sizeof(int) * ((size_t)tokens + 1)); /* each tile's first token */
    if (starts == NULL) return -2;
    int tiles = 0;
    for (int t = 0; t < tokens; t++)
        if (tiles == 0 || t - starts[tiles - 1] == TILE || positions[t] != positions[t - 1] + 1
            || splits[t] != splits[t - 1] || lows[t] != lows[t - 1] || highs[t] != highs[t - 1])
            starts[tiles++] = t;
    starts[tiles] = tokens;
    const int groups = heads / kv_heads;
    const size_t column = (size_t)kv_heads * dim, block_stride = (size_t)BLOCK * column;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *scores = malloc(sizeof(float) * TILE * (size_t)groups * (size_t)longest);
        if (scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 4)
        for (int task = 0; task < tiles * kv_heads; task++) {
            if (scores == NULL) continue;
            const int t = starts[task / kv_heads], h = task % kv_heads, count = starts[task / kv_heads + 1] - t;
            const float *own_keys = keys + (size_t)highs[t] * column + (size_t)h * dim;
            const float *own_values = values + (size_t)highs[t] * column + (size_t)h * dim;
            const float *shared_keys = keys + (size_t)lows[t] * column + (size_t)h * dim;
            const float *shared_values = values + (size_t)lows[t] * column + (size_t)h * dim;
            const float *query = q + t * q_stride + (size_t)h * groups * dim;
            const float *qc = q_cos + (size_t)t * dim, *qs = q_sin + (size_t)t * dim;
            float *o = out + ((size_t)t * heads + (size_t)h * groups) * dim;
            const size_t o_stride = (size_t)heads * dim;
            if (dim == 64)
                tile_head(query, q_stride, qc, qs, own_keys, own_values, shared_keys, shared_values, splits[t],
                          block_stride, column, positions + t, count, groups, 64, scores, longest, o, o_stride);
            else
                tile_head(query, q_stride, qc, qs, own_keys, own_values, shared_keys, shared_values, splits[t],
                          block_stride, column, positions + t, count, groups, dim, scores, longest, o, o_stride);
        }
        free(scores);
    }
    free(starts);
    return failed ? -2 : 0;
}

/* sum of x[d]^2, d < n: LANES partial sums in order (the tail's zero-padded), then hsum16 */
static inline float sum_squares(const float *x, int n)
{
    const int full = n - n % LANES;
    v16 p = splat16(0.0f);
    for (int c = 0; c < full; c += LANES) p = p + load16(x + c) * load16(x + c);
    float tail[LANES] = {0};
    memcpy(tail, x + full, sizeof(float) * (n - full));
    return hsum16(p + load16(tail) * load16(tail));
}

/* per row of x [rows][n] (row stride x_stride): with `residual` (stride r_stride), first
   sum = x + residual, written to `sum` [rows][n]; then out [rows][n] = that * rstd * weight,
   rstd = 1 / sqrt(mean of its squares + eps). Returns 0. */
int sess_rms_norm(const float *x, int64_t x_stride, const float *residual, int64_t r_stride, const float *weight,
                  float eps, int rows, int n, float *sum, float *out, int threads)
{
#pragma omp parallel for num_threads(threads) schedule(static) if ((long)rows * n >= 32768)
    for (int r = 0; r < rows; r++) {
        const float *src = x + r * x_stride;
        if (residual != NULL) {
            float *total = sum + (size_t)r * n;
            const float *add = residual + r * r_stride;
            for (int d = 0; d < n; d++) total[d] = src[d] + add[d];
            src = total;
        }
        const float rstd = 1.0f / sqrtf(sum_squares(src, n) / (float)n + eps);
        float *o = out + (size_t)r * n;
        for (int d = 0; d < n; d++) o[d] = (src[d] * rstd) * weight[d];
    }
    return 0;
}

/* silu(g) * u = g * sigmoid(g) * u for 16 lanes, sigmoid from e = exp(-|g|) */
static inline v16 silu_mul16(v16 g, v16 u)
{
    const v16i negative = g < splat16(0.0f);
    const v16 e = exp_neg16(select16(negative, g, -g));
    const v16 sigmoid = select16(negative, e, splat16(1.0f)) / (1.0f + e); /* e / (1 + e) or 1 / (1 + e) */
    return (g * sigmoid) * u;
}

/* out [rows][n] = silu(gate) * up; a row's last n % 16 entries go through the same lanes, padded */
int sess_silu_mul(const float *gate, int64_t g_stride, const float *up, int64_t u_stride, int rows, int n, float *out,
                  int threads)
{
#pragma omp parallel for num_threads(threads) schedule(static) if ((long)rows * n >= 32768)
    for (int r = 0; r < rows; r++) {
        const float *g = gate + r * g_stride, *u = up + r * u_stride;
        float *o = out + (size_t)r * n;
        const int full = n - n % LANES;
        for (int d = 0; d < full; d += LANES) store16(o + d, silu_mul16(load16(g + d), load16(u + d)));
        if (full < n) {
            float gs[LANES] = {0}, us[LANES] = {0}, os[LANES];
            memcpy(gs, g + full, sizeof(float) * (n - full));
            memcpy(us, u + full, sizeof(float) * (n - full));
            store16(os, silu_mul16(load16(gs), load16(us)));
            memcpy(o + full, os, sizeof(float) * (n - full));
        }
    }
    return 0;
}

/* A row's largest logit (NaN entries aside) */
static float row_max(const float *row, int vocab)
{
    const int full = vocab - vocab % LANES;
    v16 top = splat16(-INFINITY);
    for (int d = 0; d < full; d += LANES) {
        const v16 next = load16(row + d);
        top = select16(next > top, next, top);
    }
    float most = top[0];
    for (int l = 1; l < LANES; l++) most = top[l] > most ? top[l] : most;
    for (int d = full; d < vocab; d++) most = row[d] > most ? row[d] : most;
    return most;
}

enum { SPAN = 256 };

/* One tile of a row's logits: the SPAN entries from row + lo, those past the vocabulary (vocab)
   -inf (weight 0) */
static inline void tile_of(const float *row, int lo, int vocab, float entries[SPAN])
{
    const int n = vocab - lo < SPAN ? vocab - lo : SPAN;
    memcpy(entries, row + lo, sizeof(float) * n);
    for (int d = n; d < SPAN; d++) entries[d] = -INFINITY;
}

/* The sum of e^(x / t - most / t) over a tile's entries (tile_of): 16 partial sums over the tile,
   then pairwise (hsum16) */
static inline float tile_sum(const float entries[SPAN], float t, float scaled_most)
{
    v16 sum = splat16(0.0f);
    for (int d = 0; d < SPAN; d += LANES) sum = sum + exp_neg16(load16(entries + d) / t - scaled_most);
    return hsum16(sum);
}

/* ln(x) for a normal x > 0 in double by IEEE operations alone (no library log, whose variants
   differ between CPUs): x = m 2^e with m in [sqrt(1/2), sqrt(2)), ln m = 2 atanh(s) for
   s = (m - 1) / (m + 1), |s| < 0.172, its series to s^23 (the next term under 1e-18). A sum of
   weights is at least 1 (the max's own); NaN (a NaN logit) stays NaN */
static double log_ieee(double x)
{
    if (!(x >= 1.0 && x < INFINITY)) return x == INFINITY ? x : NAN;
    uint64_t bits;
    memcpy(&bits, &x, sizeof bits);
    int e = (int)((bits >> 52) & 0x7ff) - 1023;
    bits = (bits & 0x000fffffffffffffULL) | 0x3ff0000000000000ULL; /* m in [1, 2) */
    double m;
    memcpy(&m, &bits, sizeof m);
    if (m > 1.4142135623730951) {
        m = m * 0.5;
        e += 1;
    }
    const double s = (m - 1.0) / (m + 1.0), z = s * s;
    double series = 1.0 / 23.0;
    for (int k = 21; k >= 1; k -= 2) series = series * z + 1.0 / k;
    return (double)e * 0.69314718055994530942 + 2.0 * s * series;
}

/* A logprob, (x - max) - ln(total), from a token's logit x, its row's max and the row's sum of
   e^(x - max) (in tiles of SPAN as tile_sum takes them, their float sums added in double in
   tile order) */
static inline float logprob_of(float x, float most, double total)
{
    return (float)(((double)x - (double)most) - log_ieee(total));
}

/* The logprob of tokens[r] under softmax(logits[r]) for each row (logprob_of: the row's own
   values alone decide it). Returns 0, or -6 for a token outside the vocabulary. */
int sess_logprobs(const float *logits, int64_t stride, int rows, int vocab, const int64_t *tokens, float *logprobs,
                  int threads)
{
    for (int r = 0; r < rows; r++)
        if (tokens[r] < 0 || tokens[r] >= vocab) return -6;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int r = 0; r < rows; r++) {
        const float *row = logits + r * stride;
        const float most = row_max(row, vocab);
        double total = 0.0;
        float entries[SPAN];
        for (int lo = 0; lo < vocab; lo += SPAN) {
            tile_of(row, lo, vocab, entries);
            total += (double)tile_sum(entries, 1.0f, most);
        }
        logprobs[r] = logprob_of(row[tokens[r]], most, total);
    }
    return 0;
}

/* One token per row drawn from softmax(logits / temperature) by inverse CDF, as token_choice's
   inverse_cdf does it: the row's tiles of SPAN entries summed (tile_sum), their running sum in
   double locates the tile where it first exceeds u times the total, and a double running sum over
   that tile's entries the token (at most the tile's last non-zero entry, where rounding left the
   target past its own sum). The weights are e^(x - max) of x = logit / temperature, unnormalised
   (the draw scales u by their total). With it each row's logprob of its token, as sess_logprobs
   gives it (at temperature 1 from the same tile sums, which are then those it takes). Rows: logits
   [rows][vocab] (row stride `stride`), temperature > 0 and u in [0, 1) per row; tiles a scratch of
   rows * ceil(vocab / SPAN) doubles. Returns 0. */
int sess_draw(const float *logits, int64_t stride, int rows, int vocab, const float *temperature, const double *u,
              double *tiles, int64_t *tokens, float *logprobs, int threads)
{
    const int count = (vocab + SPAN - 1) / SPAN;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int r = 0; r < rows; r++) {
        const float *row = logits + r * stride;
        const float t = temperature[r];
        const float most = row_max(row, vocab);
        const float scaled_most = most / t; /* division rounds monotonically: the max of logit / t */
        double *cdf = tiles + (size_t)r * count;
        double running = 0.0, total = 0.0; /* total: at temperature 1, for the logprob */
        float entries[SPAN], weights[SPAN];
        for (int tile = 0; tile < count; tile++) {
            tile_of(row, tile * SPAN, vocab, entries);
            running += (double)tile_sum(entries, t, scaled_most);
            if (t != 1.0f) total += (double)tile_sum(entries, 1.0f, most);
            cdf[tile] = running;
        }
        if (t == 1.0f) total = running; /* x / 1 is x: the same sums */
        const double target = u[r] * running;
        int tile = 0;
        while (tile < count - 1 && !(cdf[tile] > target)) tile++;
        const double before = tile ? cdf[tile - 1] : 0.0;
        const int lo = tile * SPAN;
        tile_of(row, lo, vocab, entries);
        for (int d = 0; d < SPAN; d += LANES) store16(weights + d, exp_neg16(load16(entries + d) / t - scaled_most));
        int pick = SPAN, last = -1;
        double inner = before;
        for (int d = 0; d < SPAN; d++) {
            inner += (double)weights[d];
            if (weights[d] > 0.0f) last = d;
            if (pick == SPAN && inner > target) pick = d;
        }
        last = last < 0 ? SPAN - 1 : last;
        pick = pick < last ? pick : last;
        const int64_t picked = (int64_t)lo + pick, token = picked < vocab - 1 ? picked : vocab - 1;
        tokens[r] = token;
        logprobs[r] = logprob_of(row[token], most, total);
    }
    return 0;
}
