/* One decode step's attention alone (issue #15): the default model's shape (30 layers, 9 query heads, 3 kv
 * heads, head dim 64), B sequences of L keys each, blocks of 16 slots scattered at random in a 512 MiB
 * float32 pool (bench_rows.py's; no block is shared), lm_paged_decode_attn once per layer on THREADS
 * threads; best and mean of 50 steps, and the K / V bytes read (int8: with their scales) over the best
 * time. The step's new keys are not written (the engine's step stores them in the same call).
 * Usage: attn_step B L [KIND: 0 float32, 2 int8] [THREADS, 2] */
#include "../../lmserve/layers/csrc/paged_attn.c"
#include <stdio.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
int main(int argc, char **argv) {
  if (argc < 3) { fprintf(stderr, "usage: %s B L [KIND] [THREADS]\n", argv[0]); return 2; }
  const int B = atoi(argv[1]), L = atoi(argv[2]), kind = argc > 3 ? atoi(argv[3]) : 0, nth = argc > 4 ? atoi(argv[4]) : 2, reps = 50;
  enum { H = 9, Hkv = 3, D = 64, NL = 30 };
  const int64_t bs = 16, esize = kind == 2 ? 1 : 4;
  const int64_t S = 512LL * 1024 * 1024 / NL / (2 * Hkv * D * 4); /* slots a layer */
  const int64_t nblk = S / bs, T = (L + bs) / bs + 1;
  void *k[NL], *v[NL];
  float *ksc[NL], *vsc[NL];
  for (int l = 0; l < NL; l++) {
    /* written, not calloc'd: untouched pages would all read the one zero page, from cache */
    k[l] = malloc(S * Hkv * D * esize), v[l] = malloc(S * Hkv * D * esize);
    memset(k[l], 0, S * Hkv * D * esize), memset(v[l], 0, S * Hkv * D * esize);
    ksc[l] = malloc(S * Hkv * 2 * 4), vsc[l] = malloc(S * Hkv * 2 * 4);
    for (int64_t i = 0; i < S * Hkv * 2; i++) ksc[l][i] = vsc[l][i] = 0.01f;
  }
  int64_t *tables = malloc(sizeof(int64_t) * B * T), *lens = malloc(sizeof(int64_t) * B);
  if (B * T > nblk) { fprintf(stderr, "B x L needs more blocks than the pool's %lld\n", (long long)nblk); return 2; }
  int64_t *perm = malloc(sizeof(int64_t) * nblk); /* blocks drawn without replacement: each read is its own bytes */
  srand(1);
  for (int64_t i = 0; i < nblk; i++) perm[i] = i;
  for (int64_t i = nblk - 1; i > 0; i--) {
    const int64_t j = rand() % (i + 1), t = perm[i];
    perm[i] = perm[j], perm[j] = t;
  }
  for (int b = 0; b < B; b++) {
    lens[b] = L;
    for (int t = 0; t < T; t++) tables[b * T + t] = perm[b * T + t];
  }
  float *q = malloc(sizeof(float) * B * H * D), *out = malloc(sizeof(float) * B * H * D);
  for (int i = 0; i < B * H * D; i++) q[i] = (rand() % 100) / 100.f;
  double best = 1e9, total = 0;
  for (int r = 0; r < reps; r++) {
    const double t0 = now();
    for (int l = 0; l < NL; l++)
      lm_paged_decode_attn(q, k[l], v[l], kind, ksc[l], vsc[l], tables, T, lens, B, H, Hkv, D, bs, 0.125f, 0, out, 2,
                           nth, NULL, NULL, NULL, H * D, 0);
    const double t = now() - t0;
    total += t, best = t < best ? t : best;
  }
  const double bytes = (double)B * L * NL * 2 * Hkv * (D * esize + (kind == 2 ? 4 * (D / kv_group(D)) : 0));
  printf("%d sequences x %d keys, %s cache, %d threads: best %.3f ms, mean %.3f ms; %.1f MB of K / V, %.1f GB/s at best\n", B, L,
         kind == 2 ? "int8" : "float32", nth, best * 1e3, total / reps * 1e3, bytes / 1e6, bytes / best / 1e9);
  return 0;
}
