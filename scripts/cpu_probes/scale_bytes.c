/* What float16 scales save (issue #15): one pass over the default model's 121 tile-kernel linears (30 x qkv
 * 960 x 576, o 576 x 576, gate_up 3072 x 576, down 576 x 1536 as int4 + mins, Q4_1's shape; the 49,152 x 576
 * LM head as int8, Q8_0's), random tiles and float16-valued scales, with the scales and mins read as
 * float32 (half = 0) and as float16 (half = 1), the two alternated pass after pass; medians and the best
 * pass, and whether every output was the same bit for bit. Built and run by scripts/cpu_probes/run.sh.
 * Usage: scale_bytes THREADS PASSES */
#include "../../lmserve/layers/csrc/qtile.c"

#include <string.h>
#include <time.h>

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static int by_value(const void *a, const void *b) { const double x = *(const double *)a, y = *(const double *)b; return (x > y) - (x < y); }

typedef struct { int64_t n, k; int bits; uint8_t *w; float *sc, *mn; uint16_t *sch, *mnh; } Layer;

int main(int argc, char **argv) {
  if (argc < 3) { fprintf(stderr, "usage: %s THREADS PASSES\n", argv[0]); return 2; }
  const int nth = atoi(argv[1]), passes = atoi(argv[2]) < 64 ? atoi(argv[2]) : 64;
  if (!lm_has_vnni()) { fprintf(stderr, "no AVX-512 VNNI here\n"); return 1; }
  static Layer ls[121];
  int nl = 0;
  const int64_t shapes[4][2] = {{960, 576}, {576, 576}, {3072, 576}, {576, 1536}};
  for (int l = 0; l < 30; l++)
    for (int j = 0; j < 4; j++) ls[nl++] = (Layer){shapes[j][0], shapes[j][1], 4};
  ls[nl++] = (Layer){49152, 576, 8};
  srand(1);
  for (int i = 0; i < nl; i++) {
    Layer *a = &ls[i];
    const int64_t T = (a->n + 15) / 16, tb = a->bits == 8 ? 16 * a->k : 8 * a->k, S = T * (a->k / 32) * 16;
    a->w = malloc(T * tb), a->sc = malloc(S * 4), a->mn = malloc(S * 4), a->sch = malloc(S * 2), a->mnh = malloc(S * 2);
    for (int64_t j = 0; j < T * tb; j++) a->w[j] = (uint8_t)rand();
    for (int64_t j = 0; j < S; j++) {
      const _Float16 s = (_Float16)((rand() % 1000) / 1e5f), m = (_Float16)(-(rand() % 1000) / 1e4f);
      a->sc[j] = (float)s, a->mn[j] = (float)m;
      memcpy(a->sch + j, &s, 2), memcpy(a->mnh + j, &m, 2);
    }
  }
  float *x = malloc(16 * 1536 * 4), *y1 = malloc(16 * 49152 * 4), *y2 = malloc(16 * 49152 * 4);
  for (int i = 0; i < 16 * 1536; i++) x[i] = (rand() % 2001 - 1000) / 300.f;
  const int rows[] = {1, 2, 4, 8, 16};
  for (int ri = 0; ri < 5; ri++) {
    const int M = rows[ri];
    double t32[64], t16[64];
    int same = 1;
    for (int i = 0; i < nl; i++) { /* every layer's outputs, both ways */
      const Layer *a = &ls[i];
      lm_qgemm_tiles(x, M, a->k, a->w, a->bits, a->n, a->sc, a->bits == 4 ? a->mn : NULL, 0, 32, y1, nth, 1);
      lm_qgemm_tiles(x, M, a->k, a->w, a->bits, a->n, a->sch, a->bits == 4 ? a->mnh : NULL, 1, 32, y2, nth, 1);
      same &= !memcmp(y1, y2, sizeof(float) * M * a->n);
    }
    for (int p = 0; p < passes; p++)
      for (int h = 0; h < 2; h++) {
        const double t = now();
        for (int i = 0; i < nl; i++) {
          const Layer *a = &ls[i];
          lm_qgemm_tiles(x, M, a->k, a->w, a->bits, a->n, h ? (const void *)a->sch : a->sc,
                         a->bits == 4 ? (h ? (const void *)a->mnh : a->mn) : NULL, h, 32, y1, nth, 1);
        }
        (h ? t16 : t32)[p] = now() - t;
      }
    qsort(t32, passes, sizeof(double), by_value), qsort(t16, passes, sizeof(double), by_value);
    printf("%2d rows: float32 scales %.3f ms (best %.3f), float16 %.3f ms (best %.3f): %.3fx; outputs %s\n", M,
           t32[passes / 2] * 1e3, t32[0] * 1e3, t16[passes / 2] * 1e3, t16[0] * 1e3, t32[passes / 2] / t16[passes / 2],
           same ? "bit-identical" : "DIFFER");
  }
  return 0;
}
