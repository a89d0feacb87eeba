/* A probe, not a kernel of the engine (issue #15): the tile kernel's inner product through AMX-INT8
 * (TDPBSUD) instead of AVX-512 VNNI, on the same packed tiles, timed against lm_qgemm_tiles in one
 * process and checked bit for bit against it. Built and run by scripts/cpu_probes/run.sh (part amx).
 *
 * Shape of the AMX variant, per tile of 16 output rows: each 32-column block's int4 weights unpacked into
 * B-tile bytes 4 blocks ahead of their use (the packed layout's 64-byte rows already are B rows: 16
 * outputs x 4 columns; unpacked just before the TILELOADD, the load waits for the vector stores, ~25 ns
 * a block: amx_parts.c), TDPBSUD of the block into one of four C tiles in turn (A = x rows, signed;
 * B = weights, unsigned), the int32 sums stored to a ring in L1, and the VNNI kernel's float epilogue two
 * blocks behind (the same operations in the same order, so the same bits).
 *
 * Why it is not in the engine (BENCHMARKS.md, "VNNI machine, session 33"): the formats' 32-column scale
 * blocks (Q4_1, Q8_0) make every block's sums leave the tile unit before their scaling, and a block's
 * tile operations (two loads, zero, multiply, store) take ~9-10 ns for 4 to 16 rows, which the epilogue
 * overlaps little. At 8 rows that is at most 1.06x the 64 vpdpbusd it replaces; at 16-64 rows 1.1-1.3x,
 * and that gain needs the tile state handled beside oneDNN's (which keeps AMX configurations of its own).
 */
#include "../../lmserve/layers/csrc/qtile.c"
#include "amx.h"
#define TARGETA __attribute__((target("avx512f,avx512bw,avx512vnni,fma,amx-tile,amx-int8")))

TARGETA INLINE void amx_epi(const int32_t *cb, const int mc, const int BITS, const int32_t *xis, const float *xd,
                            const float *xfs, int64_t NS, int64_t KB, int64_t s, __m512 ws, const float *mn, int64_t g, __m512 *acc) {
  _Pragma("GCC unroll 16") for (int m = 0; m < mc; m++) {
    __m512i ia = _mm512_loadu_si512(cb + 16 * m);
    if (BITS == 8) ia = _mm512_add_epi32(ia, _mm512_set1_epi32(-128 * xis[m * NS + s]));
    acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia), _mm512_mul_ps(ws, _mm512_set1_ps(xd[m * KB + s])), acc[m]);
  }
  if (mn) {
    const __m512 wm = _mm512_loadu_ps(mn + g * 16);
    _Pragma("GCC unroll 16") for (int m = 0; m < mc; m++) acc[m] = _mm512_fmadd_ps(wm, _mm512_set1_ps(xfs[m * NS + s]), acc[m]);
  }
}

#define MTA 16
#define AHEAD 4 /* blocks unpacked ahead of their tile operations */
TARGETA INLINE void tile_amx(const int8_t *xq, const float *xd, const int32_t *xis, const float *xfs, const int mc,
                        int64_t K, const uint8_t *w, const int BITS, const float *sc, const float *mn,
                        int64_t spg, float *y, int64_t ldy, int nvalid, int64_t ahead, int64_t sahead) {
  __m512 acc[MTA];
  _Pragma("GCC unroll 16") for (int m = 0; m < mc; m++) acc[m] = _mm512_setzero_ps();
  const int64_t NS = K / 32, KB = K / 32;
  /* rings in L1: a block's int32 sums (read by the epilogue two blocks on) and its unpacked weights */
  static __thread int32_t cbuf[8][MTA * 16] __attribute__((aligned(64)));
  static __thread uint8_t wbuf[32][512] __attribute__((aligned(64)));
#define UNP(su) if (BITS == 4 && (su) < NS) unpack_int4_block(w + (su) * 4 * 64, wbuf[(su) & 31]);
  for (int64_t s = 0; s < AHEAD; s++) UNP(s)
  for (int64_t s = 0; s < NS + 2; s++) {
    if (s < NS) {
      const int64_t k0 = s * 32, g = spg == 1 ? s : s / spg;
      const char *wa = (const char *)(w + (BITS == 8 ? k0 / 4 : k0 / 8) * 64) + ahead;
      for (int j = 0; j < (BITS == 8 ? 8 : 4); j++) _mm_prefetch(wa + 64 * j, _MM_HINT_T0);
      if (s % spg == 0) {
        _mm_prefetch((const char *)(sc + g * 16) + sahead, _MM_HINT_T0);
        if (mn) _mm_prefetch((const char *)(mn + g * 16) + sahead, _MM_HINT_T0);
      }
      UNP(s + AHEAD)
      const void *bp = BITS == 8 ? (const void *)(w + (k0 / 4) * 64) : (const void *)wbuf[s & 31];
      amx_block(s, xq + k0, K, bp, cbuf[s & 7]);
    }
    if (s >= 2) {
      const int64_t e = s - 2, g = spg == 1 ? e : e / spg;
      amx_epi(cbuf[e & 7], mc, BITS, xis, xd, xfs, NS, KB, e, _mm512_loadu_ps(sc + g * 16), mn, g, acc);
    }
  }
  const __mmask16 keep = (__mmask16)(nvalid >= 16 ? 0xFFFF : (1u << nvalid) - 1);
  _Pragma("GCC unroll 16") for (int m = 0; m < mc; m++) _mm512_mask_storeu_ps(y + m * ldy, keep, acc[m]);
}

#define TILEA_MC(BITS) switch (mc) { \
  case 16: tile_amx(xq, xd, xis, xfs, 16, K, w, BITS, sc, mn, spg, y, ldy, nvalid, ahead, sahead); break; \
  case 8: tile_amx(xq, xd, xis, xfs, 8, K, w, BITS, sc, mn, spg, y, ldy, nvalid, ahead, sahead); break; \
  case 4: tile_amx(xq, xd, xis, xfs, 4, K, w, BITS, sc, mn, spg, y, ldy, nvalid, ahead, sahead); break; \
  case 2: tile_amx(xq, xd, xis, xfs, 2, K, w, BITS, sc, mn, spg, y, ldy, nvalid, ahead, sahead); break; \
  default: tile_amx(xq, xd, xis, xfs, mc, K, w, BITS, sc, mn, spg, y, ldy, nvalid, ahead, sahead); break; }

TARGETA static void tile_amx_any(const int8_t *xq, const float *xd, const int32_t *xis, const float *xfs, int mc, int64_t K,
                            const uint8_t *w, int bits, const float *sc, const float *mn, int64_t spg,
                            float *y, int64_t ldy, int nvalid, int64_t ahead, int64_t sahead) {
  if (bits == 8) { TILEA_MC(8) } else { TILEA_MC(4) }
}

/* lm_qgemm_tiles's driver (its loops, copied), with each thread's tile configuration set for its row count
 * and released at the end; groups of 32 columns or a multiple (the probe's formats: Q4_1, Q8_0) */
TARGETA void lm_qgemm_tiles_amx(const float *x, int64_t M, int64_t K, const uint8_t *wq, int bits, int64_t N, const float *sc,
                    const float *mn, int64_t group, float *y, int nthreads, int mta) {
  const int sb = 32;
  const int64_t NS = K / sb, G = K / group, T = (N + 15) / 16, spg = group / sb;
  const int64_t tile_bytes = bits == 8 ? 16 * K : 8 * K;
  int8_t *xq = (int8_t *)malloc((size_t)(M * K));
  float *xd = (float *)malloc(sizeof(float) * (size_t)(M * (K / 32)));
  int32_t *xis = (int32_t *)malloc(sizeof(int32_t) * (size_t)(M * NS));
  float *xfs = (float *)malloc(sizeof(float) * (size_t)(M * NS));
  quant_x_tiles(x, M, K, sb, xq, xd, xis, xfs, nthreads);
#pragma omp parallel num_threads(nthreads)
  {
  int cfg = -1;
  for (int64_t c0 = 0; c0 < M; c0 += MCH) {
    const int64_t c1 = M - c0 < MCH ? M : c0 + MCH;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < T; t++) {
      const int nvalid = N - t * 16 >= 16 ? 16 : (int)(N - t * 16);
      for (int64_t m0 = c0; m0 < c1; m0 += mta) {
        const int mc = c1 - m0 < mta ? (int)(c1 - m0) : mta;
        if (mc != cfg) { amx_config(mc); cfg = mc; }
        const int64_t ahead = PF_TILES * tile_bytes, sahead = PF_TILES * G * 16 * (int64_t)sizeof(float);
        tile_amx_any(xq + m0 * K, xd + m0 * (K / 32), xis + m0 * NS, xfs + m0 * NS, mc, K, wq + t * tile_bytes, bits,
                     sc + t * G * 16, mn ? mn + t * G * 16 : NULL, spg, y + m0 * N + t * 16, N, nvalid, ahead, sahead);
      }
    }
  }
  _tile_release();
  }
  free(xq); free(xd); free(xis); free(xfs);
}

#include <time.h>
static double now(){struct timespec t; clock_gettime(CLOCK_MONOTONIC,&t); return t.tv_sec+t.tv_nsec*1e-9;}
/* amx_tile N K BITS THREADS REPS [MTA]: a layer of N x K random weights, 1..64 rows of x, best of 5 runs of REPS calls */
int main(int argc, char**argv){
  if (argc < 6) { fprintf(stderr, "usage: %s N K BITS THREADS REPS [MTA]\n", argv[0]); return 2; }
  int64_t N=atoi(argv[1]), K=atoi(argv[2]); int bits=atoi(argv[3]); int nth=atoi(argv[4]); int reps=atoi(argv[5]); int mta=argc>6?atoi(argv[6]):16;
  if (!amx_init()) { fprintf(stderr, "no AMX tile state from the kernel\n"); return 1; }
  int64_t tb = bits==8?16*K:8*K; int64_t T=(N+15)/16;
  uint8_t *w=malloc(T*tb); for(int64_t i=0;i<T*tb;i++) w[i]=rand();
  int64_t G=K/32; float *sc=malloc(T*G*16*4), *mn=malloc(T*G*16*4);
  for(int64_t i=0;i<T*G*16;i++){sc[i]=(rand()%1000)/1e5f; mn[i]=-(rand()%1000)/1e4f;}
  int rows[]={1,2,4,5,8,16,32,64};
  float *x=malloc(64*K*4); for(int64_t i=0;i<64*K;i++) x[i]=(rand()%2001-1000)/300.f;
  float *y1=malloc(64*N*4), *y2=malloc(64*N*4);
  for(int ri=0;ri<8;ri++){int M=rows[ri];
    lm_qgemm_tiles(x,M,K,w,bits,N,sc,bits==4?mn:NULL,0,32,y1,nth,1);
    lm_qgemm_tiles_amx(x,M,K,w,bits,N,sc,bits==4?mn:NULL,32,y2,nth,mta);
    int same = memcmp(y1,y2,M*N*4)==0;
    double bv=1e9,ba=1e9;
    for(int r=0;r<5;r++){ double t=now(); for(int i=0;i<reps;i++) lm_qgemm_tiles(x,M,K,w,bits,N,sc,bits==4?mn:NULL,0,32,y1,nth,1); t=(now()-t)/reps; if(t<bv)bv=t;
      t=now(); for(int i=0;i<reps;i++) lm_qgemm_tiles_amx(x,M,K,w,bits,N,sc,bits==4?mn:NULL,32,y2,nth,mta); t=(now()-t)/reps; if(t<ba)ba=t;}
    printf("M=%2d same=%d vnni %7.1f us  amx %7.1f us  ratio %.2f\n",M,same,bv*1e6,ba*1e6,bv/ba);
  }
}
