/* Every kernel sess's sampler calls, with its exact C types: the one declaration the C sources
   (few_rows.c, fused_ops.c) are compiled against and engine/native/kernels.py reads to type the
   Python side (each argument's ctypes width, each tensor's dtype from its pointer type). Each
   returns 0, or a negative status the caller turns into an error. */

#ifndef SESS_KERNELS_H
#define SESS_KERNELS_H

#include <stdint.h>

int sess_few_rows(const float *x, int rows, int k, const float *w, int n, int tile, int block, float *y,
                  int threads);

int sess_decode_attention(const float *q, int64_t q_stride, const float *k, int64_t k_stride, const float *v,
                          int64_t v_stride, const float *cos, const float *sin, const float *q_cos,
                          const float *q_sin, float *keys, float *values, const int64_t *positions,
                          const int64_t *sources, const int64_t *shared, const int64_t *places, int64_t held,
                          int64_t columns, int rows, int heads, int kv_heads, int dim, float *out, int threads);

int sess_prefill_attention(const float *q, int64_t q_stride, const float *q_cos, const float *q_sin,
                           const float *keys, const float *values, const int64_t *positions,
                           const int64_t *splits, const int64_t *lows, const int64_t *highs, int tokens, int heads,
                           int kv_heads, int dim, float *out, int threads);

int sess_rms_norm(const float *x, int64_t x_stride, const float *residual, int64_t r_stride, const float *weight,
                  float eps, int rows, int n, float *sum, float *out, int threads);

int sess_silu_mul(const float *gate, int64_t g_stride, const float *up, int64_t u_stride, int rows, int n,
                  float *out, int threads);

int sess_draw(const float *logits, int64_t stride, int rows, int vocab, const float *temperature, const double *u,
              double *tiles, int64_t *tokens, float *logprobs, int threads);

int sess_logprobs(const float *logits, int64_t stride, int rows, int vocab, const int64_t *tokens, float *logprobs,
                  int threads);

#endif
