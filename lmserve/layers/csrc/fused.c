/* Fused elementwise ops for the CPU, float32 (issue #15): the same three as the Triton module
 * (layers/fused.py) so the model calls one interface: residual add + RMSNorm, SiLU-and-mul, rotary.
 * Each replaces 3-8 torch ops (and their per-op overhead) on the decode path. Rows in parallel. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "vmath.h"

/* each entry point compiled for AVX-512, AVX2 + FMA and the baseline, picked at load time (ifunc) by
 * feature: not "arch=haswell", whose resolver asks whether the CPU *is* an Intel Haswell (AMD Zen and
 * later Intel AVX2 cores then ran the baseline SSE2 code: SiLU-and-mul at 6 ns an element).
 * "arch=x86-64-v3" (AVX2, FMA, F16C, BMI2) is resolved by the ISA level's feature bit (GCC 12+);
 * older compilers get a plain "avx2" clone (no FMA contraction, same results up to rounding). */
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
#define CLONES __attribute__((target_clones("avx512f", "arch=x86-64-v3", "default")))
#else
#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#endif

/* sum of h[j]^2 over a row of d: 16 running sums (lane l takes j = l mod 16; the tail too), then
 * added pairwise. A fixed order, whatever the ISA, the row's address or the batch (the compiler keeps
 * the lanes in vector registers); the scalar loop it replaces waited on each add in turn (~1 us a row
 * of 576). */
static inline __attribute__((always_inline)) float sum_squares(const float *h, int64_t d) {
  float acc[16] = {0.f};
  int64_t j = 0;
  for (; j + 16 <= d; j += 16)
    for (int l = 0; l < 16; l++) acc[l] += h[j + l] * h[j + l];
  for (int l = 0; j < d; j++, l++) acc[l] += h[j] * h[j];
  for (int w = 8; w > 0; w /= 2)
    for (int l = 0; l < w; l++) acc[l] += acc[l + w];
  return acc[0];
}

/* out = rmsnorm(x + res) * w; new_res = x + res (res may be NULL: then no new_res). x, res: [n, d],
 * row strides sx / sr (elements). Threads start only for enough elements to pay for them (a decode
 * step of 8 rows made 60 of these calls, each starting both threads for ~1 us of work). */
CLONES void lm_add_rmsnorm(const float *x, int64_t sx, const float *res, int64_t sr, const float *w, float eps,
                    int64_t n, int64_t d, float *out, float *new_res, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (n * d > 65536)
  for (int64_t i = 0; i < n; i++) {
    const float *xi = x + i * sx;
    float *oi = out + i * d;
    if (res) {
      const float *ri = res + i * sr;
      float *nr = new_res + i * d;
      for (int64_t j = 0; j < d; j++) nr[j] = xi[j] + ri[j];
      xi = nr;
    }
    const float ss = sum_squares(xi, d);
    const float inv = 1.f / sqrtf(ss / (float)d + eps);
    for (int64_t j = 0; j < d; j++) oi[j] = xi[j] * inv * w[j];
  }
}

/* The gated activations: [n, 2i] gate | up -> [n, i] act(gate) * up. act(g) = g / (1 + exp(e(g))):
 * SiLU e(g) = -g; gelu_tanh(g) = g / 2 (1 + tanh(u)), u = sqrt(2 / pi) (g + 0.044715 g^3), and
 * (1 + tanh(u)) / 2 = 1 / (1 + exp(-2u)) (no cancellation for negative g, where the product is tiny): GeGLU
 * (Gemma). Two loops over chunks of a row, the exps first, then the divisions: in one loop the exp's
 * long dependency chain in front of each vdivps kept the out-of-order window from overlapping
 * iterations (3.3 ns an element on a Zen 3 against 1.0 in two; the same operations, so the same
 * values). */
#define GCHUNK 256
static inline __attribute__((always_inline)) float silu_arg(float g) { return -g; }
static inline __attribute__((always_inline)) float gelu_tanh_arg(float g) {
  return -2.f * 0.7978845608028654f * (g + 0.044715f * g * g * g);
}
#define GATED(NAME, ARG)                                                                   \
  CLONES void NAME(const float *gu, int64_t n, int64_t i, float *out, int nthreads) {      \
    _Pragma("omp parallel for schedule(static) num_threads(nthreads) if (n * i > 262144)") \
    for (int64_t r = 0; r < n; r++) {                                                      \
      const float *g = gu + r * 2 * i, *u = gu + r * 2 * i + i;                            \
      float *o = out + r * i;                                                              \
      float e[GCHUNK];                                                                     \
      for (int64_t j0 = 0; j0 < i; j0 += GCHUNK) {                                         \
        const int64_t m = i - j0 < GCHUNK ? i - j0 : GCHUNK;                               \
        _Pragma("omp simd")                                                                \
        for (int64_t j = 0; j < m; j++) e[j] = lm_expf(ARG(g[j0 + j]));                    \
        _Pragma("omp simd")                                                                \
        for (int64_t j = 0; j < m; j++) o[j0 + j] = g[j0 + j] / (1.f + e[j]) * u[j0 + j];  \
      }                                                                                    \
    }                                                                                      \
  }
GATED(lm_silu_and_mul, silu_arg)
GATED(lm_gelu_tanh_and_mul, gelu_tanh_arg)

/* In place, rotate-half: x [n, h, d] with strides (sn, sh, 1); cos / sin [n, d] (halves equal). */
CLONES void lm_rotary(float *x, int64_t n, int64_t h, int64_t d, int64_t sn, int64_t sh, const float *cos_,
               const float *sin_) {
  const int64_t half = d / 2;
  for (int64_t t = 0; t < n; t++)
    for (int64_t k = 0; k < h; k++) {
      float *b = x + t * sn + k * sh;
      const float *c = cos_ + t * d, *s = sin_ + t * d;
      for (int64_t j = 0; j < half; j++) {
        const float x1 = b[j], x2 = b[half + j];
        b[j] = x1 * c[j] - x2 * s[j];
        b[half + j] = x2 * c[j] + x1 * s[j];
      }
    }
}

/* Structured output (lmserve/structured.py): logits [n, v] float32, bitmask [n, w] int32 with bit j of
 * word i saying whether token 32 i + j may come next (xgrammar's layout); the others set to -inf in
 * place, branch-free within a word (grammar masks mix allowed and refused tokens at random). */
CLONES void lm_apply_bitmask(float *logits, int64_t n, int64_t v, const int32_t *mask, int64_t w, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (n > 1)
  for (int64_t r = 0; r < n; r++) {
    float *l = logits + r * v;
    const uint32_t *m = (const uint32_t *)(mask + r * w);
    const int64_t full = v / 32;
    for (int64_t i = 0; i < full; i++) {
      const uint32_t bits = m[i];
      if (bits == 0xffffffffu) continue;
      float *li = l + i * 32;
#pragma omp simd
      for (int k = 0; k < 32; k++) li[k] = ((bits >> k) & 1u) ? li[k] : -INFINITY;
    }
    for (int64_t t = full * 32; t < v; t++)  /* the last, partial word */
      if (!((m[full] >> (t - full * 32)) & 1u)) l[t] = -INFINITY;
  }
}

/* LoRA (lora/layers.py): y[t] += (x[t] At) Bt for the rows t of group g (row_group[t] == g; every row when
 * row_group is NULL). x (B, k), y (B, n) row-major float32; At (k, r) and Bt (r, n) the adapter's stacked
 * factors, transposed so that both products are axpys over contiguous rows. A fused layer's adapter is
 * block-diagonal in Bt: rows [s rb, (s + 1) rb) of Bt reach only columns spans[2 s] .. spans[2 s + 1]
 * (the shard's outputs; spans NULL: all), so the zeros are never read. Each element's sum runs in a fixed
 * order (u[t][j] over i, then y[t][c] over j), and every element is one thread's: the result does not
 * depend on the batch, the threads or the vector width. u = x At in chunks of 16 of its r columns; then
 * y += u Bt over column chunks, each chunk of Bt read once for all the group's rows. Compiled for each ISA
 * like the ops above: without contraction every clone rounds each element as written (the same bits). */
#define LORA_COLS 256
#define LORA_U 16

CLONES void lm_lora_add(const float *x, int64_t b, int64_t k, const float *at, const float *bt, int64_t r, int64_t n,
                        float *y, const int64_t *row_group, int64_t g, const int64_t *spans, int64_t rb, int nthreads) {
  int64_t *sel = malloc(sizeof(int64_t) * (size_t)(b > 0 ? b : 1)), m = 0;
  if (sel == NULL) abort();
  for (int64_t t = 0; t < b; t++)
    if (row_group == NULL || row_group[t] == g) sel[m++] = t;
  float *u = calloc((size_t)(m * r > 0 ? m * r : 1), sizeof(float));
  if (u == NULL) abort();
  const int64_t uchunks = (r + LORA_U - 1) / LORA_U, cchunks = (n + LORA_COLS - 1) / LORA_COLS;
#pragma omp parallel num_threads(nthreads)
  {
#pragma omp for collapse(2) schedule(static)
    for (int64_t s = 0; s < m; s++) /* u[s][j0:j1] = x[sel[s]] At[:, j0:j1] */
      for (int64_t q = 0; q < uchunks; q++) {
        const int64_t j0 = q * LORA_U, j1 = j0 + LORA_U < r ? j0 + LORA_U : r;
        const float *xt = x + sel[s] * k;
        float *us = u + s * r;
        for (int64_t i = 0; i < k; i++) {
          const float xv = xt[i], *a = at + i * r;
          for (int64_t j = j0; j < j1; j++) us[j] += xv * a[j];
        }
      }
#pragma omp for schedule(static)
    for (int64_t q = 0; q < cchunks; q++) { /* y[sel[s]][c0:c1] += u[s] Bt[:, c0:c1] */
      const int64_t c0 = q * LORA_COLS, c1 = c0 + LORA_COLS < n ? c0 + LORA_COLS : n;
      for (int64_t j = 0; j < r; j++) {
        int64_t lo = c0, hi = c1;
        if (spans != NULL) { /* the block of j reaches its shard's columns only */
          const int64_t *sp = spans + 2 * (j / rb);
          lo = lo > sp[0] ? lo : sp[0];
          hi = hi < sp[1] ? hi : sp[1];
        }
        const float *bj = bt + j * n;
        for (int64_t s = 0; s < m; s++) {
          const float uv = u[s * r + j];
          float *yt = y + sel[s] * n;
          for (int64_t c = lo; c < hi; c++) yt[c] += uv * bj[c];
        }
      }
    }
  }
  free(u);
  free(sel);
}

/* Greedy sampling: idx[r] = torch.argmax(x[r, :v]) for rows of stride `stride`: the first index of the
 * largest value, a NaN counting as the largest (the first NaN's index, as torch). A vector max, then a
 * search for its first position; v > 0. Why: torch's argmax took ~70 us a row of 49,152 and 0.6-1.8 ms for 8
 * rows (1-2 threads) on a Xeon, as much as a tenth of an 8-row decode step. */
CLONES void lm_argmax_rows(const float *x, int64_t n, int64_t v, int64_t stride, int64_t *idx, int nthreads) {
  if (v <= 0) return; /* no index to give (cpu_fused.argmax hands empty rows to torch, which refuses them) */
#pragma omp parallel for schedule(static) num_threads(nthreads) if (n * v > 131072)
  for (int64_t r = 0; r < n; r++) {
    const float *l = x + r * stride;
    float mx = -INFINITY;
    int nan = 0;
#pragma omp simd reduction(max : mx) reduction(| : nan)
    for (int64_t j = 0; j < v; j++) {
      mx = l[j] > mx ? l[j] : mx;
      nan |= l[j] != l[j];
    }
    int64_t best = 0; /* the first hit (no NaN: a chunk of 16 compared at once, then its lanes) */
    if (!nan)
      for (; best + 16 <= v; best += 16) {
        int hit = 0;
#pragma omp simd reduction(| : hit)
        for (int k = 0; k < 16; k++) hit |= l[best + k] == mx;
        if (hit) break;
      }
    if (nan) {
      while (l[best] == l[best]) best++;
    } else {
      while (l[best] != mx) best++; /* (-0.0 == 0.0: the first of either, as torch's compare) */
    }
    idx[r] = best;
  }
}
