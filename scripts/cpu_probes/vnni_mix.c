/* The VNNI tile kernel's instruction mix with no memory in the way (issue #15's bound): per 32-column
 * sub-block and x row, 8 vpdpbusd into a fresh int32 sum, then the epilogue's conversion, scale product
 * and two fused multiply-adds (the scaling and Q4_1's mins), for 8 rows side by side as qtile.c's tile()
 * runs them; and the same loop without the epilogue. Prints ns per sub-block of 8 rows x 16 outputs
 * (4,096 multiply-adds). Built and run by scripts/cpu_probes/run.sh (part mix). Usage: vnni_mix [iterations] */
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#define TARGET __attribute__((target("avx512f,avx512bw,avx512vnni,fma")))
int xq[8][8]; /* x's 4-byte groups, a row each (read through memory each sub-block, as the kernel does) */
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }

TARGET static __attribute__((noinline)) float run(long n, int epilogue) {
  __m512i wv[8];
  __m512 acc[8];
  for (int j = 0; j < 8; j++) wv[j] = _mm512_set1_epi32(0x01020304 * (j + 1)), acc[j] = _mm512_setzero_ps();
  __m512 ws = _mm512_set1_ps(1e-3f), wm = _mm512_set1_ps(-1e-4f);
  for (long i = 0; i < n; i++) {
    __m512i ia[8];
#pragma GCC unroll 8
    for (int m = 0; m < 8; m++) ia[m] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++)
#pragma GCC unroll 8
      for (int m = 0; m < 8; m++) ia[m] = _mm512_dpbusd_epi32(ia[m], wv[j], _mm512_set1_epi32(xq[m][j]));
    if (epilogue) {
#pragma GCC unroll 8
      for (int m = 0; m < 8; m++) {
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[m]), _mm512_mul_ps(ws, _mm512_set1_ps(1.0f + m)), acc[m]);
        acc[m] = _mm512_fmadd_ps(wm, _mm512_set1_ps(0.5f + m), acc[m]);
      }
    } else {
#pragma GCC unroll 8
      for (int m = 0; m < 8; m++) acc[m] = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(acc[m]), ia[m]));
    }
    __asm__ volatile("" : "+v"(wv[0]), "+v"(wv[1]), "+v"(wv[2]), "+v"(wv[3]), "+v"(wv[4]), "+v"(wv[5]), "+v"(wv[6]),
                     "+v"(wv[7]), "+v"(ws)::"memory");
  }
  float s = 0;
  for (int m = 0; m < 8; m++) s += _mm512_reduce_add_ps(acc[m]);
  return s;
}

int main(int argc, char **argv) {
  for (int m = 0; m < 8; m++)
    for (int j = 0; j < 8; j++) xq[m][j] = 0x05fd0307 + 0x01000000 * m + j;
  const long n = argc > 1 ? atol(argv[1]) : 20000000;
  for (int rep = 0; rep < 2; rep++)
    for (int e = 0; e < 2; e++) {
      const double t = now();
      const float s = run(n, e);
      printf("%s: %.2f ns a sub-block of 8 rows (%g)\n", e ? "vpdpbusd + epilogue" : "vpdpbusd only (+1 xor)",
             (now() - t) / n * 1e9, s != s ? 0. : 1.);
    }
  return 0;
}
