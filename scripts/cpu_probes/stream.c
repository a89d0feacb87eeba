/* The read bandwidth the tile kernel's weight stream is bounded by (issue #15): THREADS threads sum a
 * buffer of MIB mebibytes of int32 with AVX-512 loads, one pass after another; GB/s of the best and median
 * pass. 96 MiB is about the default model's tiles (96.4 MB; they stay in a last-level cache that large, as between decode
 * steps); 1024 MiB is past any. Usage: stream THREADS PASSES MIB */
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static int by_value(const void *a, const void *b) { const double x = *(const double *)a, y = *(const double *)b; return (x > y) - (x < y); }
__attribute__((target("avx512f"))) int main(int argc, char **argv) {
  if (argc < 4) { fprintf(stderr, "usage: %s THREADS PASSES MIB\n", argv[0]); return 2; }
  const int nth = atoi(argv[1]), passes = atoi(argv[2]) < 1 ? 1 : atoi(argv[2]) < 64 ? atoi(argv[2]) : 64;
  const size_t n = (size_t)atoi(argv[3]) << 18; /* int32s */
  int32_t *a = aligned_alloc(64, n * 4);
  memset(a, 0, n * 4);
  double t[64];
  long long check = 0;
  for (int p = 0; p < passes; p++) {
    const double t0 = now();
    __m512i total = _mm512_setzero_si512();
#pragma omp parallel num_threads(nth)
    {
      __m512i s0 = _mm512_setzero_si512(), s1 = s0, s2 = s0, s3 = s0;
#pragma omp for schedule(static)
      for (size_t i = 0; i < n; i += 64) {
        s0 = _mm512_add_epi32(s0, _mm512_load_si512(a + i));
        s1 = _mm512_add_epi32(s1, _mm512_load_si512(a + i + 16));
        s2 = _mm512_add_epi32(s2, _mm512_load_si512(a + i + 32));
        s3 = _mm512_add_epi32(s3, _mm512_load_si512(a + i + 48));
      }
#pragma omp critical
      total = _mm512_add_epi32(total, _mm512_add_epi32(_mm512_add_epi32(s0, s1), _mm512_add_epi32(s2, s3)));
    }
    t[p] = now() - t0;
    check += _mm512_reduce_add_epi32(total);
  }
  qsort(t, passes, sizeof(double), by_value);
  printf("%d threads, %s MiB: best %.1f GB/s, median %.1f GB/s (checksum %lld)\n", nth, argv[3], n * 4 / t[0] / 1e9,
         n * 4 / t[passes / 2] / 1e9, check);
  return 0;
}
