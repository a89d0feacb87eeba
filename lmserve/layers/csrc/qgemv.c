/* Weight-only quantized GEMV / skinny GEMM for the CPU (issues #14, #15): y[M, N] = x[M, K] @ W[N, K]^T
 * with W kept as int8 or 4-bit integers, a float scale (and optionally a float min) per group of
 * `group` input columns:  W[n, k] = q[n, k] * scales[n, k / group] (+ mins[n, k / group]).
 *
 * The float-x paths, for CPUs without AVX-512 VNNI (those take qtile.c's int8-x tile kernel): every
 * weight byte is read from DRAM once per call, whatever M is (rows of x are blocked inside the loop
 * over one weight row, which stays in L1); each extra row of x costs its multiply-adds (about 1.3x
 * the one-row call at 2 rows, 2.5x at 8 on the default model's linears). Integer products are summed per group in fp32 and scaled once per group;
 * the min term is sum_g mins[n, g] * sum_{k in g} x[m, k], with the group sums of x computed once.
 *
 * Layouts (what layers/quant.py stores, no repacking):
 *   int8: q int8 [N, K] row-major.
 *   int4: q uint8 [N, K / 2], byte j of a row holds column 2j in its low nibble and 2j+1 in its high.
 *         The caller passes x permuted per chunk of 32 columns as [the 16 even columns, the 16 odd
 *         ones] (lm_permute_x4), so the low nibbles of 16 bytes meet 16 contiguous floats.
 *
 * The code paths are picked at run time from what the CPU has (AVX-512F, else AVX2 + FMA, else plain
 * C); each is compiled for its own target with function attributes, so the library builds anywhere.
 * Threads: OpenMP over output rows (the process's libgomp, shared with torch's).
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <stdlib.h>

#define MB 4 /* rows of x per pass over the weight rows */
#define RB 4 /* weight rows per pass */
#define INLINE static inline __attribute__((always_inline))

static float dot_avx512(const float *a, const float *b, int64_t n); /* sum a[i] b[i], AVX-512 */

/* -------------------------------------------------------------------------------- scalar reference */

static void rows_scalar1(const float *x, int64_t m0, int64_t mc, int64_t K, const void *qv, int bits,
                         int64_t n, const float *scales, int64_t G, int64_t group, float *acc) {
  /* acc[m] = sum_g scales[n, g] * sum_{k in g} q[n, k] * x[m0 + m, k]  (x as the caller passed it) */
  for (int64_t m = 0; m < mc; m++) acc[m] = 0.f;
  for (int64_t g = 0; g < G; g++) {
    float part[MB] = {0};
    for (int64_t k = g * group; k < (g + 1) * group; k++) {
      float w;
      if (bits == 8) {
        w = (float)((const int8_t *)qv)[n * K + k];
      } else { /* x permuted: position k of a 32-chunk is column 2(k%16) (+1 for k%32 >= 16) */
        int64_t c = k & ~31, j = k & 31;
        int64_t col = c + (j < 16 ? 2 * j : 2 * (j - 16) + 1);
        uint8_t b = ((const uint8_t *)qv)[n * (K / 2) + col / 2];
        w = (float)((col & 1) ? (b >> 4) : (b & 15));
      }
      for (int64_t m = 0; m < mc; m++) part[m] += w * x[(m0 + m) * K + k];
    }
    for (int64_t m = 0; m < mc; m++) acc[m] += scales[n * G + g] * part[m];
  }
}

static void block_scalar(const float *x, int64_t m0, int64_t mc, int R, int64_t K, const void *qv, int bits,
                         int64_t n, const float *scales, int64_t G, int64_t group, float *acc) {
  float one[MB];
  for (int r = 0; r < R; r++) {
    rows_scalar1(x, m0, mc, K, qv, bits, n + r, scales, G, group, one);
    for (int64_t m = 0; m < mc; m++) acc[m * R + r] = one[m];
  }
}

/* -------------------------------------------------------------------------------- AVX-512 */
/* R (compile-time) weight rows n..n+R-1 against mc (compile-time) rows of x: acc[m * R + r]. Each
 * group's integers are converted and scaled once (w = q * s) and feed mc * R independent FMA chains,
 * enough to hide the FMA latency at M = 1. */

__attribute__((target("avx512f,fma")))
INLINE void rows_avx512(const float *x, int64_t m0, const int mc, const int R, int64_t K, const void *qv, int bits,
                        int64_t n, const float *scales, int64_t G, int64_t group, float *acc) {
  __m512 a[MB * RB];
  for (int i = 0; i < mc * R; i++) a[i] = _mm512_setzero_ps();
  const float *xr = x + m0 * K;
  if (bits == 8) {
    const int8_t *q = (const int8_t *)qv + n * K;
    for (int64_t g = 0; g < G; g++) {
      __m512 s[RB];
      for (int r = 0; r < R; r++) s[r] = _mm512_set1_ps(scales[(n + r) * G + g]);
      for (int64_t k = g * group; k < (g + 1) * group; k += 16) {
        __m512 w[RB];
        for (int r = 0; r < R; r++)
          w[r] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + r * K + k)))), s[r]);
        for (int m = 0; m < mc; m++) {
          __m512 xv = _mm512_loadu_ps(xr + m * K + k);
          for (int r = 0; r < R; r++) a[m * R + r] = _mm512_fmadd_ps(w[r], xv, a[m * R + r]);
        }
      }
    }
  } else {
    const uint8_t *q = (const uint8_t *)qv + n * (K / 2);
    const __m512i lo4 = _mm512_set1_epi32(15);
    for (int64_t g = 0; g < G; g++) {
      __m512 s[RB];
      for (int r = 0; r < R; r++) s[r] = _mm512_set1_ps(scales[(n + r) * G + g]);
      for (int64_t k = g * group; k < (g + 1) * group; k += 32) {
        __m512 wl[RB], wh[RB];
        for (int r = 0; r < R; r++) {
          __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + r * (K / 2) + k / 2)));
          wl[r] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(b, lo4)), s[r]);
          wh[r] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)), s[r]);
        }
        for (int m = 0; m < mc; m++) {
          __m512 xl = _mm512_loadu_ps(xr + m * K + k), xh = _mm512_loadu_ps(xr + m * K + k + 16);
          for (int r = 0; r < R; r++) {
            a[m * R + r] = _mm512_fmadd_ps(wl[r], xl, a[m * R + r]);
            a[m * R + r] = _mm512_fmadd_ps(wh[r], xh, a[m * R + r]);
          }
        }
      }
    }
  }
  for (int i = 0; i < mc * R; i++) acc[i] = _mm512_reduce_add_ps(a[i]);
}

#define CASES(FN, R)                                                                     \
  switch (mc) {                                                                          \
    case 4: FN(x, m0, 4, R, K, qv, bits, n, scales, G, group, acc); break;               \
    case 3: FN(x, m0, 3, R, K, qv, bits, n, scales, G, group, acc); break;               \
    case 2: FN(x, m0, 2, R, K, qv, bits, n, scales, G, group, acc); break;               \
    default: FN(x, m0, 1, R, K, qv, bits, n, scales, G, group, acc); break;              \
  }

__attribute__((target("avx512f,fma")))
static void block_avx512(const float *x, int64_t m0, int64_t mc, int R, int64_t K, const void *qv, int bits,
                         int64_t n, const float *scales, int64_t G, int64_t group, float *acc) {
  if (R == RB) { CASES(rows_avx512, RB) } else { CASES(rows_avx512, 1) } /* fixed counts: registers */
}

/* -------------------------------------------------------------------------------- AVX2 (16 registers) */

__attribute__((target("avx2,fma")))
INLINE float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

__attribute__((target("avx2,fma")))
INLINE void rows_avx2(const float *x, int64_t m0, const int mc, const int R, int64_t K, const void *qv, int bits,
                      int64_t n, const float *scales, int64_t G, int64_t group, float *acc) {
  __m256 a[MB * RB];
  for (int i = 0; i < mc * R; i++) a[i] = _mm256_setzero_ps();
  const float *xr = x + m0 * K;
  if (bits == 8) {
    const int8_t *q = (const int8_t *)qv + n * K;
    for (int64_t g = 0; g < G; g++) {
      __m256 s[RB];
      for (int r = 0; r < R; r++) s[r] = _mm256_set1_ps(scales[(n + r) * G + g]);
      for (int64_t k = g * group; k < (g + 1) * group; k += 8) {
        __m256 w[RB];
        for (int r = 0; r < R; r++)
          w[r] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + r * K + k)))), s[r]);
        for (int m = 0; m < mc; m++) {
          __m256 xv = _mm256_loadu_ps(xr + m * K + k);
          for (int r = 0; r < R; r++) a[m * R + r] = _mm256_fmadd_ps(w[r], xv, a[m * R + r]);
        }
      }
    }
  } else {
    const uint8_t *q = (const uint8_t *)qv + n * (K / 2);
    const __m256i lo4 = _mm256_set1_epi32(15);
    for (int64_t g = 0; g < G; g++) {
      __m256 s[RB];
      for (int r = 0; r < R; r++) s[r] = _mm256_set1_ps(scales[(n + r) * G + g]);
      for (int64_t k = g * group; k < (g + 1) * group; k += 16) {
        /* bytes k/2 .. k/2+7 hold columns k .. k+15: the 8 even ones at x[c + (k%32)/2 ..], the odd ones 16 later */
        const int64_t c = k & ~31, h = (k & 31) / 2;
        __m256 wl[RB], wh[RB];
        for (int r = 0; r < R; r++) {
          __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + r * (K / 2) + k / 2)));
          wl[r] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b, lo4)), s[r]);
          wh[r] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)), s[r]);
        }
        for (int m = 0; m < mc; m++) {
          __m256 xl = _mm256_loadu_ps(xr + m * K + c + h), xh = _mm256_loadu_ps(xr + m * K + c + 16 + h);
          for (int r = 0; r < R; r++) {
            a[m * R + r] = _mm256_fmadd_ps(wl[r], xl, a[m * R + r]);
            a[m * R + r] = _mm256_fmadd_ps(wh[r], xh, a[m * R + r]);
          }
        }
      }
    }
  }
  for (int i = 0; i < mc * R; i++) acc[i] = hsum256(a[i]);
}

__attribute__((target("avx2,fma")))
static void block_avx2(const float *x, int64_t m0, int64_t mc, int R, int64_t K, const void *qv, int bits,
                       int64_t n, const float *scales, int64_t G, int64_t group, float *acc) {
  if (R == RB) { CASES(rows_avx2, RB) } else { CASES(rows_avx2, 1) }
}

/* -------------------------------------------------------------------------------- entry points */

/* 2: AVX-512F, 1: AVX2 + FMA, 0: plain C. `limit` caps it (0..2) so tests can run every path. */
int lm_isa(int limit) {
  __builtin_cpu_init();
  int isa = __builtin_cpu_supports("avx512f") ? 2 : (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) ? 1 : 0;
  return isa < limit ? isa : limit;
}

/* x [M, K] -> xp [M, K]: each chunk of 32 columns as its 16 even columns then its 16 odd ones. */
void lm_permute_x4(const float *x, int64_t M, int64_t K, float *xp) {
  for (int64_t m = 0; m < M; m++)
    for (int64_t c = 0; c < K; c += 32)
      for (int j = 0; j < 16; j++) {
        xp[m * K + c + j] = x[m * K + c + 2 * j];
        xp[m * K + c + 16 + j] = x[m * K + c + 2 * j + 1];
      }
}

/* y [M, N] = x [M, K] @ W^T. bits 8: q int8 [N, K]; bits 4: q uint8 [N, K / 2] and x permuted
 * (lm_permute_x4). scales, mins: float [N, G], G = K / group (mins may be NULL). group: a multiple of 16
 * (int8) or 32 (int4) dividing K. isa: from lm_isa. */
void lm_qgemm(const float *x, int64_t M, int64_t K, const void *q, int bits, int64_t N, const float *scales,
              const float *mins, int64_t group, float *y, int isa, int nthreads) {
  const int64_t G = K / group;
  float *xsum = NULL; /* [M, G]: sum of x over each group, for the min term */
  if (mins) {
    xsum = (float *)malloc(sizeof(float) * (size_t)(M * G));
    for (int64_t m = 0; m < M; m++)
      for (int64_t g = 0; g < G; g++) {
        float s = 0.f;
        for (int64_t k = g * group; k < (g + 1) * group; k++) s += x[m * K + k];
        xsum[m * G + g] = s;
      }
  }
  const int64_t NB = (N + RB - 1) / RB; /* blocks of RB weight rows (the last may be short) */
#pragma omp parallel for schedule(static) num_threads(nthreads)
  for (int64_t nb = 0; nb < NB; nb++) {
    const int64_t n0 = nb * RB;
    const int R = N - n0 >= RB ? RB : 1;
    for (int64_t n = n0; n < n0 + RB && n < N; n += R) {
      float acc[MB * RB];
      for (int64_t m0 = 0; m0 < M; m0 += MB) {
        const int64_t mc = M - m0 < MB ? M - m0 : MB;
        if (isa == 2) block_avx512(x, m0, mc, R, K, q, bits, n, scales, G, group, acc);
        else if (isa == 1) block_avx2(x, m0, mc, R, K, q, bits, n, scales, G, group, acc);
        else block_scalar(x, m0, mc, R, K, q, bits, n, scales, G, group, acc);
        for (int64_t m = 0; m < mc; m++)
          for (int r = 0; r < R; r++) {
            float v = acc[m * R + r];
            if (mins)
              if (isa == 2) v += dot_avx512(mins + (n + r) * G, xsum + (m0 + m) * G, G);
              else for (int64_t g = 0; g < G; g++) v += mins[(n + r) * G + g] * xsum[(m0 + m) * G + g];
            y[(m0 + m) * N + n + r] = v;
          }
      }
    }
  }
  free(xsum);
}

/* sum_g a[g] * b[g]: the min term of one output */
__attribute__((target("avx512f,fma")))
static float dot_avx512(const float *a, const float *b, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  int64_t g = 0;
  for (; g + 16 <= n; g += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + g), _mm512_loadu_ps(b + g), acc);
  const __mmask16 rest = (__mmask16)((1u << (n - g)) - 1);
  acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(rest, a + g), _mm512_maskz_loadu_ps(rest, b + g), acc);
  return _mm512_reduce_add_ps(acc);
}
