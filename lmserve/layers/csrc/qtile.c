/* Weight-only quantized GEMM for AVX-512 VNNI CPUs on weights repacked in tiles of 16 output rows
 * (issue #15): y[M, N] = dequant(quant(x)) @ W^T, W[n, k] = q[n, k] * scales[n, g] (+ mins[n, g]),
 * g = k / group.
 *
 * Why a second layout: with a weight row per vector (qgemv.c) every 64 columns of every (x row, weight
 * row) pair cost a vpdpbusd, a conversion and two float ops, so each extra row of x cost almost as much
 * as the first. Here one vector holds 4 columns of 16 weight rows (a lane a row), so x's 4 bytes are
 * a broadcast, and a lane's int32 sum runs over a whole sub-block (32 columns, 16 for groups of 16)
 * before one conversion and one scaling per x row for all 16 outputs: 8 vpdpbusd + 3 float ops per
 * 512 products per x row (llama.cpp's repacked "Q4_0x8" layouts do the same).
 *
 * x is quantized per block of 32 columns (int8, scale max|x| / 127, round half away from zero), so the result equals x's dequantized blocks times the weight up to fp32 summation order.
 *
 * Packed layout (cpu_native.pack_tiles builds it; N padded to a multiple of 16 with zero rows):
 *   int8: uint8 [N / 16, K / 4, 16, 4]   q + 128 (vpdpbusd multiplies unsigned by signed bytes; the
 *         128 * sum(x) this adds is subtracted by starting each sum at -128 * sum(xq) of the sub-block)
 *   int4: uint8 [N / 16, K / 8, 16, 4]   byte b of row i: column 8j + b in the low nibble, 8j + 4 + b
 *         in the high one (one 64-byte load gives two vpdpbusd operands: & 15, and >> 4 & 15)
 *   scales, mins: [N / 16, G, 16], float32, or float16 (IEEE binary16) where every value is one exactly
 *         (half = 1: a GGUF file's Q4_0 / Q4_1 / Q5_0 / Q8_0 block scales are; 320 bytes instead of 384 a
 *         16 x 32 unit of int4 + mins, 544 instead of 576 for int8; the same float32 values once widened,
 *         so the same outputs bit for bit)
 * Shape rules: K % 32 == 0; group == 16 or a multiple of 32 dividing K.
 * Threads: OpenMP over tiles of 16 output rows, x rows 8 at a time inside a tile (4 in the AVX2
 * variant; the tile's bytes stay in L1 for the next pass), and x in chunks of 64 rows (they stay in L2) for long inputs.
 *
 * The AVX2 variant (CPUs without AVX-512 VNNI; variant 0 of lm_qgemm_tiles) reads the same layout, a
 * 64-byte chunk as two 256-bit halves of 8 rows each. It has no vpdpbusd: vpmaddubsw multiplies unsigned
 * by signed bytes into saturating int16 pairs, then vpmaddwd by ones widens them to int32 (llama.cpp's
 * AVX2 dot products do the same). int4: the weight nibble (0..15) is the unsigned operand and x the
 * signed one; a pair is at most 2 * 15 * 127 = 3810, so the int16 sums of a 32-column sub-block (8
 * pairs: 30480) never saturate and widen once. int8: the stored q + 128 becomes q again (xor 0x80), and
 * |x| times q with x's sign (vpsignb) keeps the unsigned operand <= 127 (pairs <= 2 * 127 * 127): exact for q
 * in -127..127; a weight holding -128 is refused for this variant (pack_tiles flags it), since vpsignb
 * cannot negate it.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#define MT 8    /* x rows per pass over a tile */
#define MCH 64  /* x rows per chunk (prefill): xq of a chunk stays in cache across the tiles */
#ifndef PF_TILES
#define PF_TILES 2 /* software prefetch distance, in tiles */
#endif
#define TARGET __attribute__((target("avx512f,avx512bw,avx512vnni,fma")))
#define TARGET2 __attribute__((target("avx2,fma,f16c")))
#define MT2 4 /* x rows per pass over a tile in the AVX2 variant (measured against 2, 6 and 8 on a Zen 3:
                 best or tied; the accumulators and a block's operands mostly stay in the 16 ymm) */
#define INLINE static inline __attribute__((always_inline))

int lm_has_avx2(void) {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

/* the tile kernel's AVX2 variant: AVX2 and FMA, and F16C for float16 scales */
int lm_has_tiles_avx2(void) { return lm_has_avx2() && __builtin_cpu_supports("f16c"); }

int lm_has_vnni(void) {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni");
}

/* A 32-column block's scale d (x ~ d * xq) and its reciprocal from the block's max |x|. A block with a
 * NaN or an infinity gets d = NaN, so every product it enters is NaN (int8 cannot hold them; quantized
 * as finite values they gave a finite or an opposite-signed result); a block so small that 1 / d
 * overflows (max |x| under ~3.7e-37) is quantized as zeros (it gave -127 everywhere, the opposite sign). */
static inline void block_scale(float amax, float *d, float *id) {
  if (!(amax <= 3.402823466e38f)) { /* NaN or inf */
    *d = NAN, *id = 0.f;
    return;
  }
  *d = amax / 127.f;
  *id = *d > 0 ? 1.f / *d : 0.f;
  if (!(*id <= 3.402823466e38f)) *d = 0.f, *id = 0.f;
}

/* x [M, K] -> xq int8 [M, K], xd [M, K / 32] block scales, and per sub-block of sb columns: xis
 * [M, K / sb] (the sum of xq, for int8's +128) and xfs [M, K / sb] (the sum of dequantized x, for the
 * mins term). Rounding: half away from zero, as llama.cpp's quantize_row_q8_0. */
TARGET static void quant_x_tiles(const float *x, int64_t M, int64_t K, int sb, int8_t *xq, float *xd, int32_t *xis,
                                 float *xfs, int nthreads) {
  const int64_t KB = K / 32, NS = K / sb;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (M > 4)
  for (int64_t m = 0; m < M; m++) {
    for (int64_t b = 0; b < KB; b++) {
      const float *xr = x + m * K + b * 32;
      const __m512 v0 = _mm512_loadu_ps(xr), v1 = _mm512_loadu_ps(xr + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
      const int bad = _mm512_cmp_ps_mask(v0, v0, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(v1, v1, _CMP_UNORD_Q);
      float d, id;
      block_scale(bad ? NAN : amax, &d, &id);
      xd[m * KB + b] = d;
      const __m512 vid = _mm512_set1_ps(id), half = _mm512_set1_ps(0.5f);
      const __m512i sign = _mm512_set1_epi32((int)0x80000000);
      __m512i q[2];
      for (int h = 0; h < 2; h++) { /* round half away from zero: trunc(v + copysign(0.5, v)) */
        const __m512 v = _mm512_mul_ps(h ? v1 : v0, vid);
        const __m512 hv = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(half),
                                                              _mm512_and_si512(_mm512_castps_si512(v), sign)));
        __m512i qi = _mm512_cvttps_epi32(_mm512_add_ps(v, hv));
        qi = _mm512_max_epi32(_mm512_min_epi32(qi, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
        q[h] = qi;
        _mm_storeu_si128((__m128i *)(xq + m * K + b * 32 + 16 * h), _mm512_cvtepi32_epi8(qi));
      }
      if (sb == 32) {
        const int32_t s = _mm512_reduce_add_epi32(_mm512_add_epi32(q[0], q[1]));
        xis[m * NS + b] = s;
        xfs[m * NS + b] = (float)s * d;
      } else {
        for (int h = 0; h < 2; h++) {
          const int32_t s = _mm512_reduce_add_epi32(q[h]);
          xis[m * NS + 2 * b + h] = s;
          xfs[m * NS + 2 * b + h] = (float)s * d;
        }
      }
    }
  }
}

/* bytes a scale (or min): float16 (half) or float32 */
static inline int64_t scale_size(int half) { return half ? 2 : 4; }

/* 16 scales (or mins) from element i of a float32 or float16 (half) array, as float32 */
TARGET INLINE __m512 scales16(const void *p, int64_t i, int half) {
  return half ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i)))
              : _mm512_loadu_ps((const float *)p + i);
}

/* One tile (16 output rows) against mc rows of x: out[m, 0..nvalid) for m < mc. BITS, SB, mc fixed
 * at compile time (the accumulators stay in registers). */
TARGET INLINE void tile(const int8_t *xq, const float *xd, const int32_t *xis, const float *xfs, const int mc,
                        int64_t K, const uint8_t *w, const int BITS, const int SB, const void *sc, const void *mn,
                        const int half, int64_t spg, float *y, int64_t ldy, int nvalid, int64_t ahead, int64_t sahead) {
  __m512 acc[MT];
  _Pragma("GCC unroll 8") for (int m = 0; m < mc; m++) acc[m] = _mm512_setzero_ps();
  const int64_t NS = K / SB, KB = K / 32;
  const __m512i lo4 = _mm512_set1_epi8(15);
  for (int64_t s = 0; s < NS; s++) {
    const int64_t k0 = s * SB, g = spg == 1 ? s : s / spg; /* no idiv in the common case */
    { /* this sub-block's bytes PF_TILES tiles on, requested now: in cache when that tile comes, so the
         stream from memory overlaps the multiply-adds of several x rows */
      const char *wa = (const char *)(w + (BITS == 8 ? k0 / 4 : k0 / 8) * 64) + ahead;
      for (int j = 0; j < (BITS == 8 ? SB / 4 : SB / 8); j++) _mm_prefetch(wa + 64 * j, _MM_HINT_T0);
      if (s % spg == 0) {
        _mm_prefetch((const char *)sc + g * 16 * scale_size(half) + sahead, _MM_HINT_T0);
        if (mn) _mm_prefetch((const char *)mn + g * 16 * scale_size(half) + sahead, _MM_HINT_T0);
      }
    }
    __m512i wv[8]; /* operand j < SB / 4: columns k0 + 4j .. k0 + 4j + 3 of the 16 rows (a fixed size: a VLA was
                     stored to the stack each sub-block) */
    if (BITS == 8) {
      for (int j = 0; j < SB / 4; j++) wv[j] = _mm512_loadu_si512((const void *)(w + (k0 / 4 + j) * 64));
    } else {
      for (int j = 0; j < SB / 8; j++) {
        const __m512i v = _mm512_loadu_si512((const void *)(w + (k0 / 8 + j) * 64));
        wv[2 * j] = _mm512_and_si512(v, lo4);
        wv[2 * j + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo4);
      }
    }
    const __m512 ws = scales16(sc, g * 16, half);
    /* the rows' int32 sums side by side, operand j of every row before operand j + 1 of any: a row's
       sum is still a chain of SB / 4 dependent vpdpbusd (5 cycles each), but consecutive instructions
       are other rows', so the chains overlap; the same exact int32 sums. With the loops over rows
       unrolled (GCC kept acc[] on the stack: a load and store a row and sub-block) and wv a fixed
       array, one thread on a 3072 x 576 int4 layer in L2: 109 -> 88 us at 8 rows, 31 -> 25 us at 1
       (Sapphire Rapids; vpdpbusd issues on two ports there, ~6 G a second a core in a bare loop) */
    __m512i ia[MT];
    _Pragma("GCC unroll 8") for (int m = 0; m < mc; m++)
      ia[m] = BITS == 8 ? _mm512_set1_epi32(-128 * xis[m * NS + s]) : _mm512_setzero_si512();
    for (int j = 0; j < SB / 4; j++) {
      _Pragma("GCC unroll 8") for (int m = 0; m < mc; m++)
        ia[m] = _mm512_dpbusd_epi32(ia[m], wv[j], _mm512_set1_epi32(((const int32_t *)(xq + m * K + k0))[j]));
    }
    _Pragma("GCC unroll 8") for (int m = 0; m < mc; m++)
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[m]), _mm512_mul_ps(ws, _mm512_set1_ps(xd[m * KB + k0 / 32])), acc[m]);
    if (mn) {
      const __m512 wm = scales16(mn, g * 16, half);
      _Pragma("GCC unroll 8") for (int m = 0; m < mc; m++) acc[m] = _mm512_fmadd_ps(wm, _mm512_set1_ps(xfs[m * NS + s]), acc[m]);
    }
  }
  const __mmask16 keep = (__mmask16)(nvalid >= 16 ? 0xFFFF : (1u << nvalid) - 1);
  _Pragma("GCC unroll 8") for (int m = 0; m < mc; m++) _mm512_mask_storeu_ps(y + m * ldy, keep, acc[m]);
}

#define TILE_MC(BITS, SB)                                                                               \
  switch (mc) {                                                                                         \
    case 8: tile(xq, xd, xis, xfs, 8, K, w, BITS, SB, sc, mn, half, spg, y, ldy, nvalid, ahead, sahead); break;              \
    case 7: tile(xq, xd, xis, xfs, 7, K, w, BITS, SB, sc, mn, half, spg, y, ldy, nvalid, ahead, sahead); break;              \
    case 6: tile(xq, xd, xis, xfs, 6, K, w, BITS, SB, sc, mn, half, spg, y, ldy, nvalid, ahead, sahead); break;              \
    case 5: tile(xq, xd, xis, xfs, 5, K, w, BITS, SB, sc, mn, half, spg, y, ldy, nvalid, ahead, sahead); break;              \
    case 4: tile(xq, xd, xis, xfs, 4, K, w, BITS, SB, sc, mn, half, spg, y, ldy, nvalid, ahead, sahead); break;              \
    case 3: tile(xq, xd, xis, xfs, 3, K, w, BITS, SB, sc, mn, half, spg, y, ldy, nvalid, ahead, sahead); break;              \
    case 2: tile(xq, xd, xis, xfs, 2, K, w, BITS, SB, sc, mn, half, spg, y, ldy, nvalid, ahead, sahead); break;              \
    default: tile(xq, xd, xis, xfs, 1, K, w, BITS, SB, sc, mn, half, spg, y, ldy, nvalid, ahead, sahead); break;             \
  }

TARGET static void tile_any(const int8_t *xq, const float *xd, const int32_t *xis, const float *xfs, int mc, int64_t K,
                            const uint8_t *w, int bits, int sb, const void *sc, const void *mn, int half, int64_t spg,
                            float *y, int64_t ldy, int nvalid, int64_t ahead, int64_t sahead) {
  if (bits == 8 && sb == 32) { TILE_MC(8, 32) }
  else if (bits == 8) { TILE_MC(8, 16) }
  else if (sb == 32) { TILE_MC(4, 32) }
  else { TILE_MC(4, 16) }
}

/* quant_x_tiles with AVX2: the same values (the same float operations in the same order). */
TARGET2 static void quant_x_tiles2(const float *x, int64_t M, int64_t K, int sb, int8_t *xq, float *xd, int32_t *xis,
                                   float *xfs, int nthreads) {
  const int64_t KB = K / 32, NS = K / sb;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (M > 4)
  for (int64_t m = 0; m < M; m++) {
    for (int64_t b = 0; b < KB; b++) {
      const float *xr = x + m * K + b * 32;
      const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
      __m256 v[4], mx = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
      for (int i = 0; i < 4; i++) {
        v[i] = _mm256_loadu_ps(xr + 8 * i);
        mx = _mm256_max_ps(mx, _mm256_and_ps(v[i], absmask));  /* (max_ps drops a NaN: seen below) */
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v[i], v[i], _CMP_UNORD_Q));
      }
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
      const float amax = _mm_cvtss_f32(m4);
      float d, id;
      block_scale(_mm256_movemask_ps(nan) ? NAN : amax, &d, &id);
      xd[m * KB + b] = d;
      const __m256 vid = _mm256_set1_ps(id), half = _mm256_set1_ps(0.5f);
      const __m256i sign = _mm256_set1_epi32((int)0x80000000);
      int32_t sums[2] = {0, 0};
      for (int i = 0; i < 4; i++) { /* round half away from zero: trunc(v + copysign(0.5, v)) */
        const __m256 t = _mm256_mul_ps(v[i], vid);
        const __m256 hv = _mm256_or_ps(half, _mm256_and_ps(t, _mm256_castsi256_ps(sign)));
        __m256i qi = _mm256_cvttps_epi32(_mm256_add_ps(t, hv));
        qi = _mm256_max_epi32(_mm256_min_epi32(qi, _mm256_set1_epi32(127)), _mm256_set1_epi32(-127));
        int32_t lanes[8];
        _mm256_storeu_si256((__m256i *)lanes, qi);
        for (int l = 0; l < 8; l++) {
          xq[m * K + b * 32 + 8 * i + l] = (int8_t)lanes[l];
          sums[i / 2] += lanes[l];
        }
      }
      if (sb == 32) {
        xis[m * NS + b] = sums[0] + sums[1];
        xfs[m * NS + b] = (float)(sums[0] + sums[1]) * d;
      } else {
        for (int h = 0; h < 2; h++) {
          xis[m * NS + 2 * b + h] = sums[h];
          xfs[m * NS + 2 * b + h] = (float)sums[h] * d;
        }
      }
    }
  }
}

/* 8 scales (or mins) from element i of a float32 or float16 (half) array, as float32 */
TARGET2 INLINE __m256 scales8(const void *p, int64_t i, int half) {
  return half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i))) : _mm256_loadu_ps((const float *)p + i);
}

/* tile() for AVX2, one half: output rows 8h .. 8h + 7 of the tile against mc <= MT2 rows of x (half 0
 * prefetches ahead; half 1 finds the tile's lines in L1). A half at a time keeps the accumulators and
 * a sub-block's weight operands in the 16 ymm registers. */
TARGET2 INLINE void tile2h(const int8_t *xq, const float *xd, const float *xfs, const int mc, int64_t K,
                           const uint8_t *w, const int BITS, const int SB, const void *sc, const void *mn, const int half,
                           int64_t spg,
                           float *y, int64_t ldy, int nvalid, int64_t ahead, int64_t sahead, const int h) {
  __m256 acc[MT2];
  for (int m = 0; m < mc; m++) acc[m] = _mm256_setzero_ps();
  const int64_t NS = K / SB, KB = K / 32;
  const __m256i lo4 = _mm256_set1_epi8(15), flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
  for (int64_t s = 0; s < NS; s++) {
    const int64_t k0 = s * SB, g = spg == 1 ? s : s / spg; /* no idiv in the common case */
    if (h == 0) {
      const char *wa = (const char *)(w + (BITS == 8 ? k0 / 4 : k0 / 8) * 64) + ahead;
      for (int j = 0; j < (BITS == 8 ? SB / 4 : SB / 8); j++) _mm_prefetch(wa + 64 * j, _MM_HINT_T0);
      if (s % spg == 0) {
        _mm_prefetch((const char *)sc + g * 16 * scale_size(half) + sahead, _MM_HINT_T0);
        if (mn) _mm_prefetch((const char *)mn + g * 16 * scale_size(half) + sahead, _MM_HINT_T0);
      }
    }
    __m256i wv[8]; /* operand j < SB / 4: columns k0 + 4j .. k0 + 4j + 3 of rows 8h .. 8h + 7 (a fixed size: no alloca) */
    if (BITS == 8) {
      for (int j = 0; j < SB / 4; j++)
        wv[j] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(w + (k0 / 4 + j) * 64 + 32 * h)), flip);
    } else {
      for (int j = 0; j < SB / 8; j++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(w + (k0 / 8 + j) * 64 + 32 * h));
        wv[2 * j] = _mm256_and_si256(v, lo4);
        wv[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo4);
      }
    }
    const __m256 ws = scales8(sc, g * 16 + 8 * h, half);
    for (int m = 0; m < mc; m++) {
      const int32_t *xr = (const int32_t *)(xq + m * K + k0);
      __m256i ia;
      if (BITS == 4) { /* int16 sums over the sub-block, widened once */
        __m256i s16 = _mm256_maddubs_epi16(wv[0], _mm256_set1_epi32(xr[0]));
        for (int j = 1; j < SB / 4; j++) s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(wv[j], _mm256_set1_epi32(xr[j])));
        ia = _mm256_madd_epi16(s16, ones);
      } else {
        ia = _mm256_setzero_si256();
        for (int j = 0; j < SB / 4; j++) {
          const __m256i xb = _mm256_set1_epi32(xr[j]);
          const __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(xb), _mm256_sign_epi8(wv[j], xb));
          ia = _mm256_add_epi32(ia, _mm256_madd_epi16(p, ones));
        }
      }
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia), _mm256_mul_ps(ws, _mm256_set1_ps(xd[m * KB + k0 / 32])), acc[m]);
    }
    if (mn) {
      const __m256 wm = scales8(mn, g * 16 + 8 * h, half);
      for (int m = 0; m < mc; m++) acc[m] = _mm256_fmadd_ps(wm, _mm256_set1_ps(xfs[m * NS + s]), acc[m]);
    }
  }
  const int valid = nvalid - 8 * h;
  if (valid >= 8) {
    for (int m = 0; m < mc; m++) _mm256_storeu_ps(y + m * ldy + 8 * h, acc[m]);
  } else if (valid > 0) {
    const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(valid), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    for (int m = 0; m < mc; m++) _mm256_maskstore_ps(y + m * ldy + 8 * h, keep, acc[m]);
  }
}

TARGET2 INLINE void tile2(const int8_t *xq, const float *xd, const float *xfs, const int mc, int64_t K,
                          const uint8_t *w, const int BITS, const int SB, const void *sc, const void *mn, const int half,
                          int64_t spg,
                          float *y, int64_t ldy, int nvalid, int64_t ahead, int64_t sahead) {
  tile2h(xq, xd, xfs, mc, K, w, BITS, SB, sc, mn, half, spg, y, ldy, nvalid, ahead, sahead, 0);
  if (nvalid > 8) tile2h(xq, xd, xfs, mc, K, w, BITS, SB, sc, mn, half, spg, y, ldy, nvalid, ahead, sahead, 1);
}

#define TILE2_MC(BITS, SB)                                                                          \
  switch (mc) {                                                                                     \
    case 4: tile2(xq, xd, xfs, 4, K, w, BITS, SB, sc, mn, half, spg, y, ldy, nvalid, ahead, sahead); break; \
    case 3: tile2(xq, xd, xfs, 3, K, w, BITS, SB, sc, mn, half, spg, y, ldy, nvalid, ahead, sahead); break; \
    case 2: tile2(xq, xd, xfs, 2, K, w, BITS, SB, sc, mn, half, spg, y, ldy, nvalid, ahead, sahead); break; \
    default: tile2(xq, xd, xfs, 1, K, w, BITS, SB, sc, mn, half, spg, y, ldy, nvalid, ahead, sahead); break; \
  }

TARGET2 static void tile2_any(const int8_t *xq, const float *xd, const float *xfs, int mc, int64_t K, const uint8_t *w,
                              int bits, int sb, const void *sc, const void *mn, int half, int64_t spg, float *y, int64_t ldy,
                              int nvalid, int64_t ahead, int64_t sahead) {
  if (bits == 8 && sb == 32) { TILE2_MC(8, 32) }
  else if (bits == 8) { TILE2_MC(8, 16) }
  else if (sb == 32) { TILE2_MC(4, 32) }
  else { TILE2_MC(4, 16) }
}

/* y [M, N] = x [M, K] @ W^T with W packed as above (wq: the tiles, sc / mn: [N / 16, G, 16], float32, or
 * float16 with half = 1; mn may be NULL). vnni 1: the AVX-512 VNNI kernel (needs lm_has_vnni()); 0: the
 * AVX2 one (needs lm_has_tiles_avx2(), and int8 weights in -127..127). */
void lm_qgemm_tiles(const float *x, int64_t M, int64_t K, const uint8_t *wq, int bits, int64_t N, const void *sc,
                    const void *mn, int half, int64_t group, float *y, int nthreads, int vnni) {
  const int sb = group == 16 ? 16 : 32;
  const int64_t NS = K / sb, G = K / group, T = (N + 15) / 16, spg = group / sb;
  const int64_t tile_bytes = bits == 8 ? 16 * K : 8 * K, scale_bytes = G * 16 * scale_size(half); /* a tile's */
  int8_t *xq = (int8_t *)malloc((size_t)(M * K));
  float *xd = (float *)malloc(sizeof(float) * (size_t)(M * (K / 32)));
  int32_t *xis = (int32_t *)malloc(sizeof(int32_t) * (size_t)(M * NS));
  float *xfs = (float *)malloc(sizeof(float) * (size_t)(M * NS));
  if (!xq || !xd || !xis || !xfs) { /* no result is better than a wrong one */
    fprintf(stderr, "lmserve: out of memory in lm_qgemm_tiles (M=%lld, K=%lld)\n", (long long)M, (long long)K);
    abort();
  }
  if (vnni) quant_x_tiles(x, M, K, sb, xq, xd, xis, xfs, nthreads);
  else quant_x_tiles2(x, M, K, sb, xq, xd, xis, xfs, nthreads);
  const int mt = vnni ? MT : MT2;
#pragma omp parallel num_threads(nthreads)
  for (int64_t c0 = 0; c0 < M; c0 += MCH) {
    const int64_t c1 = M - c0 < MCH ? M : c0 + MCH;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; t++) {
      const int nvalid = N - t * 16 >= 16 ? 16 : (int)(N - t * 16);
      for (int64_t m0 = c0; m0 < c1; m0 += mt) {
        const int mc = c1 - m0 < mt ? (int)(c1 - m0) : mt;
        const int64_t ahead = PF_TILES * tile_bytes, sahead = PF_TILES * scale_bytes;
        if (vnni)
          tile_any(xq + m0 * K, xd + m0 * (K / 32), xis + m0 * NS, xfs + m0 * NS, mc, K, wq + t * tile_bytes, bits, sb,
                   (const char *)sc + t * scale_bytes, mn ? (const char *)mn + t * scale_bytes : NULL, half, spg,
                   y + m0 * N + t * 16, N, nvalid, ahead, sahead);
        else
          tile2_any(xq + m0 * K, xd + m0 * (K / 32), xfs + m0 * NS, mc, K, wq + t * tile_bytes, bits, sb,
                    (const char *)sc + t * scale_bytes, mn ? (const char *)mn + t * scale_bytes : NULL, half, spg,
                    y + m0 * N + t * 16, N, nvalid, ahead, sahead);
      }
    }
  }
  free(xq); free(xd); free(xis); free(xfs);
}
