/* The AMX variant's parts for one tile of 16 outputs (K = 576: 18 blocks of 32 columns, everything in L1),
 * alone and together, in ns a 32-column block, beside the VNNI kernel's tile on the same bytes (issue #15;
 * run by run.sh, part amx). Parts: the tile operations (TILELOADD of x rows and of the block's weights,
 * TILEZERO, TDPBSUD, TILESTORED of the int32 sums), the int4 unpack into the B tile's bytes (vector
 * stores), the float epilogue (the VNNI kernel's: convert, scale, multiply-add, the mins' term), the
 * epilogue two blocks behind the tile operations. Unpacking a block just before its TILELOADD stalls the
 * load until the stores leave the core (~25 ns a block); unpacked 4 blocks ahead it costs ~2-7 ns. What is
 * left: the tile operations, ~9-10 ns a block for 4, 8 or 16 rows, which the epilogue overlaps little
 * (most of it at 4 rows, a fifth at 8, none at 16). Timing only: the outputs mean nothing (in the "4
 * ahead" cases the first blocks read ring slots never unpacked; the VNNI line's passes share x's scales).
 * Usage: amx_parts ROWS (4, 8 or 16) */
#include "../../lmserve/layers/csrc/qtile.c"
#include "amx.h"
#include <time.h>
#define TARGETA __attribute__((target("avx512f,avx512bw,avx512vnni,fma,f16c,amx-tile,amx-int8")))
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }

enum { UNPACK = 1, EPI = 2, AMX = 4 };
/* the parts in MODE for one tile; unpack `ahead` blocks before the block's tile operations */
TARGETA static inline __attribute__((always_inline)) void parts(const int8_t *xq, const float *xd, const float *xfs, const int mc,
    int64_t K, const uint8_t *w, const uint16_t *sc, const uint16_t *mn, float *y, const int MODE, int ahead) {
  __m512 acc[16];
  _Pragma("GCC unroll 16") for (int m = 0; m < mc; m++) acc[m] = _mm512_setzero_ps();
  const int64_t NS = K / 32;
  static __thread int32_t cbuf[8][16 * 16] __attribute__((aligned(64)));
  static __thread uint8_t wbuf[32][512] __attribute__((aligned(64)));
  for (int64_t s = 0; s < NS + 2; s++) {
    if (s < NS) {
      const int64_t k0 = s * 32, su = (s + ahead) % NS;
      if (MODE & UNPACK) unpack_int4_block(w + su * 4 * 64, wbuf[(s + ahead) & 31]);
      if (MODE & AMX) amx_block(s, xq + k0, K, wbuf[s & 31], cbuf[s & 7]);
    }
    if ((MODE & EPI) && s >= 2) {
      const int64_t e = s - 2;
      const int32_t *cb = cbuf[e & 7];
      const __m512 ws = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sc + e * 16)));
      const __m512 wm = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mn + e * 16)));
      _Pragma("GCC unroll 16") for (int m = 0; m < mc; m++) {
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(cb + 16 * m)),
                                 _mm512_mul_ps(ws, _mm512_set1_ps(xd[m * NS + e])), acc[m]);
        acc[m] = _mm512_fmadd_ps(wm, _mm512_set1_ps(xfs[m * NS + e]), acc[m]);
      }
    }
  }
  _Pragma("GCC unroll 16") for (int m = 0; m < mc; m++) _mm512_storeu_ps(y + m * 16, acc[m]);
}

#define ROWS(MODE) switch (mc) { case 16: parts(xq, xd, xfs, 16, K, w, sc, mn, y, MODE, ahead); break; \
  case 8: parts(xq, xd, xfs, 8, K, w, sc, mn, y, MODE, ahead); break; default: parts(xq, xd, xfs, 4, K, w, sc, mn, y, MODE, ahead); }
TARGETA __attribute__((noinline)) static void run(int mode, int ahead, const int8_t *xq, const float *xd, const float *xfs, int mc,
                                                  int64_t K, const uint8_t *w, const uint16_t *sc, const uint16_t *mn, float *y) {
  switch (mode) {
    case AMX: ROWS(AMX) break;
    case EPI: ROWS(EPI) break;
    case AMX | EPI: ROWS(AMX | EPI) break;
    case AMX | UNPACK: ROWS(AMX | UNPACK) break;
    default: ROWS(AMX | UNPACK | EPI) break;
  }
}

TARGETA int main(int argc, char **argv) {
  if (argc < 2) { fprintf(stderr, "usage: %s ROWS (4, 8 or 16)\n", argv[0]); return 2; }
  if (!amx_init()) { fprintf(stderr, "no AMX tile state from the kernel\n"); return 1; }
  const int mc = atoi(argv[1]) >= 16 ? 16 : atoi(argv[1]) >= 8 ? 8 : 4;
  const int64_t K = 576, NS = K / 32;
  const int reps = 200000;
  int8_t *xq = aligned_alloc(64, 16 * K);
  float *xd = malloc(16 * NS * 4), *xfs = malloc(16 * NS * 4), y[256];
  uint8_t *w = aligned_alloc(64, 8 * K);
  uint16_t *sc = malloc(NS * 32), *mn = malloc(NS * 32);
  int32_t xis[16 * 18] = {0};
  for (int i = 0; i < 16 * K; i++) xq[i] = (int8_t)(rand() % 255 - 127);
  for (int i = 0; i < 8 * K; i++) w[i] = (uint8_t)rand();
  for (int i = 0; i < 16 * NS; i++) xd[i] = 0.01f, xfs[i] = 0.1f;
  for (int i = 0; i < 16 * NS; i++) sc[i] = 0x2000, mn[i] = 0xa000; /* float16 values */
  amx_config(mc);
  const struct { int mode, ahead; const char *what; } cases[] = {
    {AMX, 0, "tile operations"}, {EPI, 0, "epilogue"}, {AMX | EPI, 0, "tile operations + epilogue"},
    {AMX | UNPACK, 0, "unpack just before + tile operations"}, {AMX | UNPACK, 4, "unpack 4 ahead + tile operations"},
    {AMX | UNPACK | EPI, 4, "all (unpack 4 ahead)"}};
  printf("# %d rows, ns a 32-column block of 16 outputs (best of 5 x %d tiles)\n", mc, reps);
  for (int c = 0; c < 6; c++) {
    double best = 1e9;
    for (int r = 0; r < 5; r++) {
      double t = now();
      for (int i = 0; i < reps; i++) run(cases[c].mode, cases[c].ahead, xq, xd, xfs, mc, K, w, sc, mn, y);
      t = (now() - t) / reps / NS * 1e9;
      best = t < best ? t : best;
    }
    printf("%-40s %6.2f\n", cases[c].what, best);
  }
  double best = 1e9;
  const int vm = mc > 8 ? 8 : mc, passes = mc / vm; /* the VNNI kernel takes 8 rows a pass */
  for (int r = 0; r < 5; r++) {
    double t = now();
    for (int i = 0; i < reps; i++)
      for (int p = 0; p < passes; p++) tile_any(xq + p * vm * K, xd, xis, xfs, vm, K, w, 4, 32, sc, mn, 1, 1, y, 16, 16, 0, 0);
    t = (now() - t) / reps / NS * 1e9;
    best = t < best ? t : best;
  }
  printf("%-40s %6.2f\n", "the VNNI kernel's tile (int4 + mins)", best);
  _tile_release();
  return 0;
}
