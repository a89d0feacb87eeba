/* Paged decode attention for the CPU (issue #15): one new query token per sequence, keys and values
 * read in place from the paged cache through the block table (no gather into a dense copy).
 *
 *   q      float [B, H, D]        the decode tokens' queries
 *   k, v   [S, Hkv, D] float32 (kind 0), bf16 (1) or int8 (2), S = blocks * block_size cache slots;
 *          int8: k_scale, v_scale [S, Hkv, D / g] float32, a scale per g channels (g = 32, or D when D
 *          is not a multiple of 32), element ~ q * scale (kv/cache.py's QuantizedKV, its layout and
 *          its quantization: absmax / 127 per group, round half to even)
 *   tables int64 [B, T]           block ids of each sequence
 *   lens   int64 [B]              context length (the new token included)
 *   out    float [B, H, D]
 * Query head h reads kv head h / (H / Hkv) (GQA / MQA). window > 0: only the last `window` keys
 * (sliding-window layers). Two passes over the keys per (sequence, kv head): scores for every query
 * head of the group, a max-subtracted softmax, then the weighted sum of values; fp32 throughout.
 * Parallel over (sequence, kv head) pairs with OpenMP. A verification step's rows of one sequence
 * (consecutive rows, each one key longer, the same blocks) are attended together by the vector loops
 * (AVX-512, AVX2): one read of each key and value row for all of them, each row's result bit for bit
 * its own (finite caches).
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vmath.h"

static inline float bf16_to_f32(uint16_t b) {
  union { uint32_t u; float f; } c;
  c.u = (uint32_t)b << 16;
  return c.f;
}

/* channels per int8 scale (kv/cache.py kv_group_size) */
static inline int kv_group(int D) { return D % 32 == 0 ? 32 : D; }

/* row idx of a [S * Hkv, D] cache half as float32: bf16 widened, int8 times its group's scale (sc: the
 * half's scales [S * Hkv, D / g]) */
static inline void row_kv(const void *base, int64_t idx, int kind, const float *sc, int D, float *dst) {
  if (kind == 1) { const uint16_t *p = (const uint16_t *)base + idx * D; for (int i = 0; i < D; i++) dst[i] = bf16_to_f32(p[i]); }
  else if (kind == 2) {
    const int8_t *p = (const int8_t *)base + idx * D;
    const int g = kv_group(D);
    const float *r = sc + idx * (D / g);
    for (int i = 0; i < D; i++) dst[i] = (float)p[i] * r[i / g];
  }
  else memcpy(dst, (const float *)base + idx * D, sizeof(float) * (size_t)D);
}

/* Each of the G rows of scores [G, stride] to the softmax of its first n entries (max subtracted), and
 * out [G, D] zeroed. */
static inline void softmax_strided(float *scores, int G, int64_t n, int64_t stride, float *out, int D) {
  for (int g = 0; g < G; g++) {
    float *sg = scores + g * stride;
    float mx = -INFINITY, sum = 0.f;
#pragma omp simd reduction(max : mx) /* (a vector max: the scalar loop waited on each compare in turn) */
    for (int64_t j = 0; j < n; j++) mx = sg[j] > mx ? sg[j] : mx;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < n; j++) { sg[j] = lm_expf(sg[j] - mx); sum += sg[j]; }
    const float inv = 1.f / sum;
    for (int64_t j = 0; j < n; j++) sg[j] *= inv;
    for (int i = 0; i < D; i++) out[g * D + i] = 0.f;
  }
}

/* A run's scores [R, nq, n] (row r: its first n0 + r keys) to each row's softmax, the entries past a row's
 * keys zeroed (the value pass reads them: a zero probability leaves a sum as it was, for finite values),
 * and the rows' outputs (row r at out + r * o_rstride, [nq, D]) zeroed. */
static inline __attribute__((always_inline)) void softmax_run(float *scores, int R, int nq, int64_t n0, int64_t n,
                                                              float *out, int64_t o_rstride, int D) {
  for (int r = 0; r < R; r++) {
    float *sr = scores + (int64_t)r * nq * n;
    softmax_strided(sr, nq, n0 + r, n, out + r * o_rstride, D);
    for (int q2 = 0; q2 < nq; q2++)
      for (int64_t j = n0 + r; j < n; j++) sr[q2 * n + j] = 0.f;
  }
}

/* Each of the G rows of scores [G, n] to its softmax (max subtracted), and out [G, D] zeroed. */
static inline void softmax_rows(float *scores, int G, int64_t n, float *out, int D) {
  softmax_strided(scores, G, n, n, out, D);
}

/* scores [G, len - first]; q, out: the group's G heads [G, D]. Plain C, inlined into a plain and an
 * AVX2 + FMA copy below (the compiler vectorises the `omp simd` loops for each target). */
static inline __attribute__((always_inline)) void attend_body(
    const float *q, const void *k, const void *v, int kind, const float *ks, const float *vs, const int64_t *table,
    int64_t len, int64_t first, int64_t bs, int Hkv, int kvh, int G, int D, float scale, float *scores, float *row,
    float *out) {
  const int64_t n = len - first;
  for (int64_t j = 0; j < n; j++) {
    const int64_t pos = first + j, slot = table[pos / bs] * bs + pos % bs;
    row_kv(k, slot * Hkv + kvh, kind, ks, D, row);
    for (int g = 0; g < G; g++) {
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int i = 0; i < D; i++) s += q[g * D + i] * row[i];
      scores[g * n + j] = s * scale;
    }
  }
  softmax_rows(scores, G, n, out, D);
  for (int64_t j = 0; j < n; j++) {
    const int64_t pos = first + j, slot = table[pos / bs] * bs + pos % bs;
    row_kv(v, slot * Hkv + kvh, kind, vs, D, row);
    for (int g = 0; g < G; g++) {
      const float p = scores[g * n + j];
#pragma omp simd
      for (int i = 0; i < D; i++) out[g * D + i] += p * row[i];
    }
  }
}

#define ATTEND_ARGS const float *q, const void *k, const void *v, int kind, const float *ks, const float *vs, \
    const int64_t *table, int64_t len, int64_t first, int64_t bs, int Hkv, int kvh, int G, int D, float scale, \
    float *scores, float *row, float *out
__attribute__((target("avx2,fma"))) static void attend_avx2(ATTEND_ARGS) {
  attend_body(q, k, v, kind, ks, vs, table, len, first, bs, Hkv, kvh, G, D, scale, scores, row, out);
}
static void attend_c(ATTEND_ARGS) {
  attend_body(q, k, v, kind, ks, vs, table, len, first, bs, Hkv, kvh, G, D, scale, scores, row, out);
}

/* Row index (in D-element rows of the [S, Hkv, D] cache) of every key of one sequence and kv head, in
 * order: keys[j] = ((table[pos / bs] * bs + pos % bs) * Hkv + kvh) * D for pos = first + j. Walked a
 * block at a time (no division per key: a 64-bit idiv per key and pass cost more than the key's
 * arithmetic). */
static inline void key_rows(const int64_t *table, int64_t len, int64_t first, int64_t bs, int Hkv, int kvh, int D,
                            int64_t *keys) {
  for (int64_t p = first; p < len;) {
    const int64_t b = p / bs, off = p - b * bs, m = bs - off < len - p ? bs - off : len - p;
    const int64_t base = table[b] * bs + off;
    for (int64_t t = 0; t < m; t++) keys[p - first + t] = ((base + t) * Hkv + kvh) * D;
    p += m;
  }
}

/* AVX2 + FMA, head dim a multiple of 8 (up to 256): dot products 8 lanes at a time, each key's summed
 * horizontally on its own (the AVX-512 loop below sums four keys' together: the two loops' bits differ,
 * each is batch-invariant). Scores: a key's row read once for the G heads of its group. Values: a pass over the keys
 * for each pair of 8-lane chunks and up to 3 heads, their 6 sums in registers (a running sum in
 * memory, loaded and stored for every key, head and chunk, made the pass latency-bound). The rows a
 * few keys on are prefetched: blocks lie anywhere in the pool, so the hardware prefetcher cannot
 * follow. keys: scratch for n row indices. */
#define MAXC8 32 /* 8-lane chunks of a head: D up to 256 */
#define PF_KEYS 8 /* software prefetch distance, in keys */
#define MAX_RUN 16 /* rows of one sequence attended together (cpu_attn.ROWS_PER_SEQ) */
/* 8 channels from element off of a cache half as float32: bf16 widened; int8 converted and times the
 * scale at sc (its group's: QuantizedKV's dequantize, the same float32 product) */
__attribute__((target("avx2,fma")))
static inline __m256 load8(const void *base, int64_t off, int kind, const float *sc) {
  if (kind == 1) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + off))), 16));
  if (kind == 2)
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)base + off)))),
                         _mm256_broadcast_ss(sc));
  return _mm256_loadu_ps((const float *)base + off);
}

__attribute__((target("avx2,fma")))
static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

/* The value pass's (row, head) pairs i0 .. i0 + 2 of kv head h (i = r * G + head; fewer at the end: the
 * missing ones repeat the first): their score rows [n] and output rows [D]. Returns how many are real. */
static inline int triple(float *scores, float *out, int i0, int R, int G, int h, int nq, int64_t n, int D,
                         int64_t o_rstride, const float *sp[3], float *op[3]) {
  const int gn = R * G - i0 < 3 ? R * G - i0 : 3;
  for (int t = 0; t < 3; t++) {
    const int i = i0 + (t < gn ? t : 0), r = i / G, gh = h * G + i % G;
    sp[t] = scores + ((int64_t)r * nq + gh) * n;
    op[t] = out + r * o_rstride + (int64_t)gh * D;
  }
  return gn;
}

/* R rows of one sequence at once (a verification's new tokens: row r has len + r keys, first == 0
 * when R > 1; its queries at q + r * q_rstride, its output at out + r * o_rstride): each key's and
 * value's row is read from memory once for all R rows. Every (row, head) pair's scores, softmax and
 * weighted sum are those of the same row attended alone, in the same order (a shorter row's
 * probabilities past its own keys are zeros, and a fused multiply-add of zero leaves a sum as it was,
 * for finite values: an inf or NaN value past a row's keys would reach it here). */
__attribute__((target("avx2,fma")))
static inline __attribute__((always_inline)) void attend_avx2_body(
    const float *q, const void *k, const void *v, int kind, const float *ks, const float *vs, const int64_t *table,
    int64_t len, int64_t first, int64_t bs, int Hkv, int kvh, int nkv, int G, const int C, float scale, float *scores,
    int64_t *keys, float *out, int R, int64_t q_rstride, int64_t o_rstride) {
  const int64_t n0 = len - first, n = n0 + R - 1; /* row r: its first n0 + r keys; scores [R, nkv * G, n] */
  const int D = 8 * C, nq = nkv * G;
  const int esize = kind == 1 ? 2 : kind == 2 ? 1 : 4;
  const int g = kv_group(D), ng = D / g; /* int8: channels per scale, scales per row */
  key_rows(table, len + R - 1, first, bs, Hkv, kvh, D, keys);
  for (int64_t j = 0; j < n; j++) {
    if (j + PF_KEYS < n) { /* the kv heads' rows are adjacent in a slot: one run of lines */
      const int64_t ahead = keys[j + PF_KEYS] * esize;
      for (int64_t b = 0; b < (int64_t)nkv * D * esize; b += 64) {
        _mm_prefetch((const char *)k + ahead + b, _MM_HINT_T0);
        _mm_prefetch((const char *)v + ahead + b, _MM_HINT_T1);
      }
    }
    for (int h = 0; h < nkv; h++) {
      const int64_t row = keys[j] + (int64_t)h * D;
      const float *sr = kind == 2 ? ks + row / D * ng : NULL;
      __m256 kc[MAXC8];
      for (int c = 0; c < C; c++) kc[c] = load8(k, row + 8 * c, kind, sr + (kind == 2 ? 8 * c / g : 0));
      for (int r = j < n0 ? 0 : (int)(j - n0 + 1); r < R; r++) /* the rows that see key j */
        for (int g = h * G; g < (h + 1) * G; g++) {
          const float *qr = q + r * q_rstride + g * D;
          __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(qr), kc[0]);
          for (int c = 1; c < C; c++) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qr + 8 * c), kc[c], acc);
          scores[((int64_t)r * nq + g) * n + j] = hsum8(acc) * scale;
        }
    }
  }
  softmax_run(scores, R, nq, n0, n, out, o_rstride, D);
  for (int h = 0; h < nkv; h++)
    for (int c0 = 0; c0 < C; c0 += 2) {
      const int two = c0 + 1 < C;
      for (int i0 = 0; i0 < R * G; i0 += 3) { /* (row, head) pairs i = r * G + head of kv head h, 3 at a time */
        const float *sp[3];
        float *op[3];
        const int gn = triple(scores, out, i0, R, G, h, nq, n, D, o_rstride, sp, op);
        const int64_t m = n0 + (i0 + gn - 1) / G; /* keys of the triple's longest (last) row */
        const float *s0 = sp[0], *s1 = sp[1], *s2 = sp[2];
        __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00;
        for (int64_t j = 0; j < m; j++) {
          const int64_t row = keys[j] + (int64_t)h * D + 8 * c0;
          const float *sr = kind == 2 ? vs + (keys[j] / D + h) * ng : NULL;
          const __m256 v0 = load8(v, row, kind, sr + (kind == 2 ? 8 * c0 / g : 0));
          const __m256 v1 = two ? load8(v, row + 8, kind, sr + (kind == 2 ? (8 * c0 + 8) / g : 0)) : v0;
          const __m256 p0 = _mm256_broadcast_ss(s0 + j), p1 = _mm256_broadcast_ss(s1 + j), p2 = _mm256_broadcast_ss(s2 + j);
          a00 = _mm256_fmadd_ps(p0, v0, a00); a01 = _mm256_fmadd_ps(p0, v1, a01);
          a10 = _mm256_fmadd_ps(p1, v0, a10); a11 = _mm256_fmadd_ps(p1, v1, a11);
          a20 = _mm256_fmadd_ps(p2, v0, a20); a21 = _mm256_fmadd_ps(p2, v1, a21);
        }
        const __m256 a[3][2] = {{a00, a01}, {a10, a11}, {a20, a21}};
        for (int t = 0; t < gn; t++) {
          _mm256_storeu_ps(op[t] + 8 * c0, a[t][0]);
          if (two) _mm256_storeu_ps(op[t] + 8 * c0 + 8, a[t][1]);
        }
      }
    }
}

/* nkv kv heads from kvh on (their query heads' rows of q and out adjacent) for R rows of one sequence
 * (attend_avx2_body), scores [R, nkv * G, len - first + R - 1] */
#define AVX2_ARGS const float *q, const void *k, const void *v, int kind, const float *ks, const float *vs, \
    const int64_t *table, int64_t len, int64_t first, int64_t bs, int Hkv, int kvh, int nkv, int G, int D, float scale, \
    float *scores, int64_t *keys, float *out, int R, int64_t q_rstride, int64_t o_rstride
#define AVX2_PASS(C) attend_avx2_body(q, k, v, kind, ks, vs, table, len, first, bs, Hkv, kvh, nkv, G, C, scale, scores, \
                                      keys, out, R, q_rstride, o_rstride)
/* the common head dims with the chunk count fixed (the K row and the loops in registers), any other by count */
__attribute__((target("avx2,fma"))) static void attend_avx2_64(AVX2_ARGS) { (void)D; AVX2_PASS(8); }
__attribute__((target("avx2,fma"))) static void attend_avx2_128(AVX2_ARGS) { (void)D; AVX2_PASS(16); }
__attribute__((target("avx2,fma"))) static void attend_avx2_any(AVX2_ARGS) { AVX2_PASS(D / 8); }
static void attend_avx2v(AVX2_ARGS) {
  void (*f)(AVX2_ARGS) = D == 64 ? attend_avx2_64 : D == 128 ? attend_avx2_128 : attend_avx2_any;
  f(q, k, v, kind, ks, vs, table, len, first, bs, Hkv, kvh, nkv, G, D, scale, scores, keys, out, R, q_rstride,
    o_rstride);
}

/* AVX-512, head dim a multiple of 16 (up to 256): attend_avx2_body's algorithm (a task's kv heads and a
 * verification's rows together, each key and value row read once for them, prefetched a few keys on)
 * with 16 lanes, and two changes for the wider registers:
 * - scores: 4 keys at a time per (row, head), their 4 dot products reduced together (a transposition
 *   of 4 vectors: ~11 shuffles and adds for 4 keys, where one key's horizontal sum took ~8). Each key's
 *   sum is the same tree of the same lanes wherever it falls in the group, so a row's scores do not
 *   depend on which keys share its groups (a key past the last is a zero vector);
 * - values: up to 4 chunks of 16 channels of 3 (row, head) pairs, 12 sums in registers per pass.
 * int8 and bf16 rows are widened into kbuf (4 keys' rows, float) once per key for all the rows and heads. */
#define MAXC 16 /* 16-lane chunks of a head: D up to 256 */
#define TARGET512 __attribute__((target("avx512f,fma")))

/* 16 channels from element off of a cache half as float32 (load8's widening, 16 lanes) */
TARGET512 static inline __m512 load16(const void *base, int64_t off, int kind, const float *sc) {
  if (kind == 1) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)base + off))), 16));
  if (kind == 2)
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)base + off)))),
                         _mm512_set1_ps(*sc));
  return _mm512_loadu_ps((const float *)base + off);
}

/* [sum a, sum b, sum c, sum d]: within each 128-bit lane positions (0 + 2) + (1 + 3), then lanes (0 + 2) +
 * (1 + 3); the same tree for each of the four inputs */
TARGET512 static inline __m128 hsum4x16(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b)); /* a0+a2 b0+b2 a1+a3 b1+b3 */
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512 s = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2))); /* a b c d per lane */
  const __m512 t = _mm512_add_ps(s, _mm512_shuffle_f32x4(s, s, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm512_castps512_ps128(_mm512_add_ps(t, _mm512_shuffle_f32x4(t, t, _MM_SHUFFLE(2, 3, 0, 1))));
}

TARGET512 static inline __attribute__((always_inline)) void attend_avx512_body(
    const float *q, const void *k, const void *v, int kind, const float *ks, const float *vs, const int64_t *table,
    int64_t len, int64_t first, int64_t bs, int Hkv, int kvh, int nkv, int G, const int C, float scale, float *scores,
    int64_t *keys, float *kbuf, float *out, int R, int64_t q_rstride, int64_t o_rstride) {
  const int64_t n0 = len - first, n = n0 + R - 1; /* row r: its first n0 + r keys; scores [R, nkv * G, n] */
  const int D = 16 * C, nq = nkv * G;
  const int esize = kind == 1 ? 2 : kind == 2 ? 1 : 4;
  const int g = kv_group(D), ng = D / g; /* int8: channels per scale, scales per row */
  const __m512 zero = _mm512_setzero_ps();
  key_rows(table, len + R - 1, first, bs, Hkv, kvh, D, keys);
  for (int64_t j0 = 0; j0 < n; j0 += 4) {
    const int nj = n - j0 < 4 ? (int)(n - j0) : 4;
    if (j0 + PF_KEYS < n) /* the next group's rows, PF_KEYS keys on (a slot's kv heads adjacent: one run) */
      for (int64_t j = j0 + PF_KEYS; j < j0 + PF_KEYS + 4 && j < n; j++)
        for (int64_t b = 0; b < (int64_t)nkv * D * esize; b += 64) {
          _mm_prefetch((const char *)k + keys[j] * esize + b, _MM_HINT_T0);
          _mm_prefetch((const char *)v + keys[j] * esize + b, _MM_HINT_T1);
        }
    const int rmin = j0 < n0 ? 0 : (int)(j0 - n0 + 1); /* the rows that see key j0 (and some see the rest) */
    for (int h = 0; h < nkv; h++) {
      const float *kr[4];
      for (int t = 0; t < nj; t++) {
        const int64_t row = keys[j0 + t] + (int64_t)h * D;
        if (kind == 0) { kr[t] = (const float *)k + row; continue; }
        const float *sr = kind == 2 ? ks + row / D * ng : NULL;
        for (int c = 0; c < C; c++)
          _mm512_storeu_ps(kbuf + t * D + 16 * c, load16(k, row + 16 * c, kind, sr + (kind == 2 ? 16 * c / g : 0)));
        kr[t] = kbuf + t * D;
      }
      for (int r = rmin; r < R; r++)
        for (int gh = h * G; gh < (h + 1) * G; gh++) {
          const float *qr = q + r * q_rstride + gh * D;
          __m512 a[4] = {zero, zero, zero, zero};
          for (int c = 0; c < C; c++) {
            const __m512 qc = _mm512_loadu_ps(qr + 16 * c);
            for (int t = 0; t < 4; t++)
              if (t < nj) a[t] = c == 0 ? _mm512_mul_ps(qc, _mm512_loadu_ps(kr[t])) : _mm512_fmadd_ps(qc, _mm512_loadu_ps(kr[t] + 16 * c), a[t]);
          }
          const __m128 s4 = _mm_mul_ps(hsum4x16(a[0], a[1], a[2], a[3]), _mm_set1_ps(scale));
          float *dst = scores + ((int64_t)r * nq + gh) * n + j0;
          if (nj == 4) _mm_storeu_ps(dst, s4);
          else {
            float s[4];
            _mm_storeu_ps(s, s4);
            for (int t = 0; t < nj; t++) dst[t] = s[t];
          }
        }
    }
  }
  softmax_run(scores, R, nq, n0, n, out, o_rstride, D);
  for (int h = 0; h < nkv; h++)
    for (int c0 = 0; c0 < C; c0 += 4) {
      const int nc = C - c0 < 4 ? C - c0 : 4;
      for (int i0 = 0; i0 < R * G; i0 += 3) { /* (row, head) pairs i = r * G + head of kv head h, 3 at a time */
        const float *sp[3];
        float *op[3];
        const int gn = triple(scores, out, i0, R, G, h, nq, n, D, o_rstride, sp, op);
        const int64_t m = n0 + (i0 + gn - 1) / G; /* keys of the triple's longest (last) row */
        __m512 a[3][4];
        for (int t = 0; t < 3; t++)
          for (int c = 0; c < 4; c++) a[t][c] = zero;
        for (int64_t j = 0; j < m; j++) {
          const int64_t row = keys[j] + (int64_t)h * D + 16 * c0;
          const float *sr = kind == 2 ? vs + (keys[j] / D + h) * ng : NULL;
          __m512 vc[4] = {zero, zero, zero, zero};
          for (int c = 0; c < 4; c++)
            if (c < nc) vc[c] = load16(v, row + 16 * c, kind, sr + (kind == 2 ? (16 * (c0 + c)) / g : 0));
          for (int t = 0; t < 3; t++) {
            const __m512 p = _mm512_set1_ps(sp[t][j]);
            for (int c = 0; c < 4; c++)
              if (c < nc) a[t][c] = _mm512_fmadd_ps(p, vc[c], a[t][c]);
          }
        }
        for (int t = 0; t < gn; t++)
          for (int c = 0; c < nc; c++) _mm512_storeu_ps(op[t] + 16 * (c0 + c), a[t][c]);
      }
    }
}

#define AVX512_PASS(C) attend_avx512_body(q, k, v, kind, ks, vs, table, len, first, bs, Hkv, kvh, nkv, G, C, scale, \
                                          scores, keys, kbuf, out, R, q_rstride, o_rstride)
#define AVX512_ARGS AVX2_ARGS, float *kbuf
TARGET512 static void attend_avx512_64(AVX512_ARGS) { (void)D; AVX512_PASS(4); }
TARGET512 static void attend_avx512_128(AVX512_ARGS) { (void)D; AVX512_PASS(8); }
TARGET512 static void attend_avx512_any(AVX512_ARGS) { AVX512_PASS(D / 16); }
static void attend_avx512v(AVX512_ARGS) {
  void (*f)(AVX512_ARGS) = D == 64 ? attend_avx512_64 : D == 128 ? attend_avx512_128 : attend_avx512_any;
  f(q, k, v, kind, ks, vs, table, len, first, bs, Hkv, kvh, nkv, G, D, scale, scores, keys, out, R, q_rstride,
    o_rstride, kbuf);
}

int lm_attn_avx512(void) {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f");
}

/* An int8 cache row's quantization (kv/cache.py quantize, bit for bit: scale = max |x| / 127 over each
 * group of g channels by IEEE division, element = x / scale (1 where the scale is 0) clamped to
 * [-127, 127] and rounded half to even; a NaN or an infinity makes its group's scale NaN / inf, as torch's
 * amax does, so the group reads back NaN): x [D] float32 -> dst [D], sc [D / g]. */
static void quantize_row(const float *x, int D, int8_t *dst, float *sc) {
  const int g = kv_group(D);
  for (int i0 = 0; i0 < D; i0 += g) {
    float amax = 0.f;
    for (int i = i0; i < i0 + g; i++) amax = fabsf(x[i]) > amax || isnan(x[i]) ? fabsf(x[i]) : amax;  /* NaN stays */
    const float s = amax / 127.f, div = s > 0.f ? s : 1.f;
    sc[i0 / g] = s;
    for (int i = i0; i < i0 + g; i++) {
      float y = x[i] / div;
      y = y < -127.f ? -127.f : (y > 127.f ? 127.f : y);
      dst[i] = isnan(y) ? 0 : (int8_t)nearbyintf(y);  /* (a NaN element's scale is NaN or inf: it reads NaN) */
    }
  }
}

/* Before attending, new_k / new_v [B, Hkv, D] (the cache's element type, or float32 for an int8 cache,
 * quantized here; NULL: none) are written at cache slots `slots` [B] (a slot < 0 is skipped): the store
 * and the attention in one call. q_stride / new_stride: elements between sequences' rows of q and of
 * new_k / new_v (views of one qkv buffer). kind: the cache's element type (0 float32, 1 bf16, 2 int8
 * with k_scale / v_scale, else NULL). */
void lm_paged_decode_attn(const float *q, void *k, void *v, int kind, float *k_scale, float *v_scale,
                          const int64_t *tables, int64_t T, const int64_t *lens, int64_t B, int H, int Hkv, int D,
                          int64_t block_size, float scale, int64_t window, float *out, int use_simd, int nthreads,
                          const void *new_k, const void *new_v, const int64_t *slots, int64_t q_stride,
                          int64_t new_stride) {
  const int G = H / Hkv;
  if (new_k && kind == 2) {
    const int ng = D / kv_group(D);
    for (int64_t b = 0; b < B; b++) {
      if (slots[b] < 0) continue;
      for (int h = 0; h < Hkv; h++) {
        const int64_t row = slots[b] * Hkv + h, from = b * new_stride + (int64_t)h * D;
        quantize_row((const float *)new_k + from, D, (int8_t *)k + row * D, k_scale + row * ng);
        quantize_row((const float *)new_v + from, D, (int8_t *)v + row * D, v_scale + row * ng);
      }
    }
  } else if (new_k) {
    const size_t row = (size_t)Hkv * (size_t)D * (kind == 1 ? 2 : 4); /* bytes of one slot */
    for (int64_t b = 0; b < B; b++) {
      if (slots[b] < 0) continue;
      const size_t from = (size_t)(b * new_stride) * (kind == 1 ? 2 : 4);
      memcpy((char *)k + slots[b] * row, (const char *)new_k + from, row);
      memcpy((char *)v + slots[b] * row, (const char *)new_v + from, row);
    }
  }
  int64_t maxlen = 0;
  for (int64_t b = 0; b < B; b++) maxlen = lens[b] > maxlen ? lens[b] : maxlen;
  const int avx512 = use_simd == 2 && D % 16 == 0 && D <= 16 * MAXC;
  const int avx2v = !avx512 && use_simd && D % 8 == 0 && D <= 8 * MAXC8;
  const int vec = avx512 || avx2v; /* the loops that take runs of rows and several kv heads a task */
  /* runs of rows (the vector loops): consecutive rows of one sequence, each one key longer than the one
   * before and reading the run's first row's blocks (a verification's new tokens), attended together so
   * that each key and value row is read once for the run (not where a window drops keys). At most `cap`
   * rows a run: MAX_RUN, and few enough that one sequence's rows still give every thread a task. */
  int64_t cap = vec ? (B * Hkv) / (nthreads > 0 ? nthreads : 1) : 1;
  cap = cap < 1 ? 1 : cap > MAX_RUN ? MAX_RUN : cap;
  int64_t *runs = (int64_t *)malloc(sizeof(int64_t) * (size_t)(B + 1));
  int64_t nruns = 0, longest = 1;
  for (int64_t b = 0; b < B; b++) {
    const int64_t r0 = nruns > 0 ? runs[nruns - 1] : 0; /* the current run's first row */
    const size_t blocks = (size_t)((lens[b] + block_size - 1) / block_size); /* the blocks row b reads */
    const int join = vec && b > 0 && b - r0 < cap && lens[b] == lens[b - 1] + 1 && lens[b - 1] > 0
                     && (window <= 0 || lens[b] <= window)
                     && !memcmp(tables + b * T, tables + r0 * T, sizeof(int64_t) * blocks);
    if (!join) runs[nruns++] = b;
    longest = b + 1 - runs[nruns - 1] > longest ? b + 1 - runs[nruns - 1] : longest;
  }
  runs[nruns] = B;
  /* kv heads per task: all of a sequence's when there are sequences enough to share out (the vector
   * loops): a slot's heads are adjacent, so a task then reads whole slot rows (a stream the memory
   * system serves about twice as fast as a head's 1 / Hkv of each row), else one */
  const int per = vec && nruns >= 2 * (int64_t)nthreads ? Hkv : 1;
  const int64_t tasks = nruns * (Hkv / per);
#pragma omp parallel num_threads(nthreads) if (nthreads > 1 && tasks > 1)
  {
    float *scores = (float *)malloc(sizeof(float) * (size_t)(longest * per * G * (maxlen > 0 ? maxlen : 1)));
    float *row = (float *)malloc(sizeof(float) * (size_t)D);
    int64_t *keys = (int64_t *)malloc(sizeof(int64_t) * (size_t)(maxlen > 0 ? maxlen : 1));
    float *kbuf = avx512 ? (float *)malloc(sizeof(float) * (size_t)(4 * D)) : NULL; /* 4 keys' rows, widened */
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < tasks; t++) {
      const int64_t b = runs[t / (Hkv / per)];
      const int R = (int)(runs[t / (Hkv / per) + 1] - b);
      const int kvh = (int)(t % (Hkv / per)) * per;
      const int64_t len = lens[b];
      const int64_t first = window > 0 && len > window ? len - window : 0;
      const float *qg = q + b * q_stride + (int64_t)kvh * G * D;
      float *og = out + (b * H + (int64_t)kvh * G) * D;
      if (len <= 0) { memset(og, 0, sizeof(float) * (size_t)(per * G * D)); continue; }
      if (avx512)
        attend_avx512v(qg, k, v, kind, k_scale, v_scale, tables + b * T, len, first, block_size, Hkv, kvh, per, G, D,
                       scale, scores, keys, og, R, q_stride, (int64_t)H * D, kbuf);
      else if (avx2v)
        attend_avx2v(qg, k, v, kind, k_scale, v_scale, tables + b * T, len, first, block_size, Hkv, kvh, per, G, D, scale,
                     scores, keys, og, R, q_stride, (int64_t)H * D);
      else if (use_simd)
        attend_avx2(qg, k, v, kind, k_scale, v_scale, tables + b * T, len, first, block_size, Hkv, kvh, G, D, scale, scores,
                    row, og);
      else
        attend_c(qg, k, v, kind, k_scale, v_scale, tables + b * T, len, first, block_size, Hkv, kvh, G, D, scale, scores,
                 row, og);
    }
    free(scores);
    free(row);
    free(keys);
    free(kbuf);
  }
  free(runs);
}
