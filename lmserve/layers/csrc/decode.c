/* The CPU decode plan's layer loop in one call (issue #15): models/cpu_decode.py's CpuDecodePlan.run for
 * a Llama-family layer (add + RMSNorm, qkv, rotary, store + paged attention, o, add + RMSNorm, gate_up,
 * SiLU-and-mul, down), the same kernels with the same arguments in the same order as the Python loop it
 * replaces, so the hidden states are bit for bit the same (tests/test_cpu_decode.py holds it to that).
 * Why: the loop made 240 calls through ctypes and 90 tensor allocations a step, ~0.6-0.9 ms of a 9 ms
 * batch-1 step on two cores.
 *
 * Per layer i (arrays of int64 holding pointers, as Python reads them once):
 *   lin     [L, 4, 8]  qkv, o, gate_up, down: (tiles, bits, n, k, scales, mins or 0, group, half), the tile kernel's
 *   norms   [L, 2]     input and post-attention RMSNorm weights
 *   scales  [L] float  attention scale;  windows [L]: sliding window (0: none)
 *   cache   [L, 4]     K and V halves of the layer's cache, and their scales (an int8 cache; else 0);
 *                      kv_kind: the caches' element type (0 float32, 2 int8: paged_attn.c)
 *   rows  [L, 4]     this step's block tables (B, T) int64, T, lens (B,) int64, slots (B,) int64
 * Buffers (float32, row-major): res, hbuf, tmp [B, hidden]; qkv [B, (H + 2 Hkv) d]; att [B, H d];
 * gate_up [B, 2 I]; act [B, I]; out [B, hidden] (the last layer's down projection). x [B, hidden] is the
 * embedded input. */
#include <math.h>
#include <stdint.h>
#include <string.h>

void lm_lora_add(const float *x, int64_t b, int64_t k, const float *at, const float *bt, int64_t r, int64_t n,
                 float *y, const int64_t *row_group, int64_t g, const int64_t *spans, int64_t rb, int nthreads);
void lm_add_rmsnorm(const float *x, int64_t sx, const float *res, int64_t sr, const float *w, float eps, int64_t n,
                    int64_t d, float *out, float *new_res, int nthreads);
void lm_silu_and_mul(const float *gu, int64_t n, int64_t i, float *out, int nthreads);
void lm_rotary(float *x, int64_t n, int64_t h, int64_t d, int64_t sn, int64_t sh, const float *cos_, const float *sin_);
void lm_qgemm_tiles(const float *x, int64_t M, int64_t K, const uint8_t *wq, int bits, int64_t N, const void *sc,
                    const void *mn, int half, int64_t group, float *y, int nthreads, int vnni);
void lm_paged_decode_attn(const float *q, void *k, void *v, int kind, float *k_scale, float *v_scale,
                          const int64_t *tables, int64_t T, const int64_t *lens, int64_t B, int H, int Hkv, int D,
                          int64_t block_size, float scale, int64_t window, float *out, int use_simd, int nthreads,
                          const void *new_k, const void *new_v, const int64_t *slots, int64_t q_stride,
                          int64_t new_stride);

#define P(v) ((void *)(intptr_t)(v))
#define LIN_ROW 8 /* int64s a linear's row of `lin` */

/* y (B, n) = x (B, k) @ W.T for one linear's row l of `lin` */
static void linear(const int64_t *l, const float *x, int64_t b, float *y, int nthreads, int vnni) {
  lm_qgemm_tiles(x, b, l[3], (const uint8_t *)P(l[0]), (int)l[1], l[2], P(l[4]), P(l[5]), (int)l[7], l[6], y, nthreads,
                 vnni);
}

/* the LoRA deltas of linear j (0 qkv, 1 o, 2 gate_up, 3 down) of layer i for each of the step's G adapter
 * groups: lora [G, L, 4, 5] holds (At, Bt, r, spans, rb) per group, layer and linear (At = 0: the adapter
 * has none; lm_lora_add's arguments) */
static void lora_deltas(const int64_t *lora, int64_t G, int64_t L, const int64_t *row_group, int64_t i, int j,
                        const float *x, int64_t b, int64_t k, float *y, int64_t n, int nthreads) {
  for (int64_t g = 0; g < G; g++) {
    const int64_t *e = lora + ((g * L + i) * 4 + j) * 5;
    if (e[0] != 0)
      lm_lora_add(x, b, k, (const float *)P(e[0]), (const float *)P(e[1]), e[2], n, y, row_group, g,
                  (const int64_t *)P(e[3]), e[4], nthreads);
  }
}

/* residual = x (layer 0) or residual += the last layer's output; hbuf = norm(residual) * w */
static void block_input(int64_t i, const float *x, const float *out, float *res, const float *w, float eps, int64_t b,
                        int64_t hd, float *hbuf, int nthreads) {
  if (i == 0) {
    lm_add_rmsnorm(x, hd, NULL, 0, w, eps, b, hd, hbuf, NULL, nthreads);
    memcpy(res, x, sizeof(float) * (size_t)(b * hd));
  } else {
    lm_add_rmsnorm(out, hd, res, hd, w, eps, b, hd, hbuf, res, nthreads);
  }
}

/* the step's k / v rows of qkv (B, (H + 2 Hkv) d) stored in the layer's cache c (K, V, scales) and
 * attention through its rows r (tables, T, lens, slots) into att (B, H d) */
static void attend(const float *qkv, const int64_t *c, const int64_t *r, int kv_kind, int64_t b, int h, int hkv, int d,
                   int64_t block_size, float scale, int64_t window, float *att, int simd, int nthreads) {
  const int64_t width = (int64_t)(h + 2 * hkv) * d;
  const float *new_k = qkv + (int64_t)h * d;
  lm_paged_decode_attn(qkv, P(c[0]), P(c[1]), kv_kind, (float *)P(c[2]), (float *)P(c[3]), (const int64_t *)P(r[0]), r[1],
                       (const int64_t *)P(r[2]), b, h, hkv, d, block_size, scale, window, att, simd, nthreads, new_k,
                       new_k + (int64_t)hkv * d, (const int64_t *)P(r[3]), width, width);
}

void lm_llama_layers(int64_t L, const int64_t *lin, const int64_t *norms, const float *scales, const int64_t *windows,
                     const int64_t *cache, const int64_t *rows, const float *x, int64_t b, int64_t hd, float eps, int h,
                     int hkv, int d, int64_t block_size, const float *cos_, const float *sin_, int simd, int nthreads,
                     int vnni, int kv_kind, float *res, float *hbuf, float *qkv, float *att, float *tmp, float *gate_up, float *act,
                     float *out, const int64_t *lora, int64_t G, const int64_t *row_group) {
  const int64_t width = (int64_t)(h + 2 * hkv) * d;
  for (int64_t i = 0; i < L; i++) {
    const int64_t *li = lin + i * 4 * LIN_ROW, *r = rows + i * 4;
    const float *w_in = (const float *)P(norms[2 * i]), *w_post = (const float *)P(norms[2 * i + 1]);
    block_input(i, x, out, res, w_in, eps, b, hd, hbuf, nthreads);
    linear(li, hbuf, b, qkv, nthreads, vnni);
    lora_deltas(lora, G, L, row_group, i, 0, hbuf, b, hd, qkv, width, nthreads);
    lm_rotary(qkv, b, h + hkv, d, width, d, cos_, sin_); /* q and k heads */
    attend(qkv, cache + 4 * i, r, kv_kind, b, h, hkv, d, block_size, scales[i], windows[i], att, simd, nthreads);
    linear(li + LIN_ROW, att, b, tmp, nthreads, vnni);
    lora_deltas(lora, G, L, row_group, i, 1, att, b, (int64_t)h * d, tmp, hd, nthreads);
    lm_add_rmsnorm(tmp, hd, res, hd, w_post, eps, b, hd, hbuf, res, nthreads);
    const int64_t gu = li[2 * LIN_ROW + 2]; /* gate_up's n = 2 I */
    linear(li + 2 * LIN_ROW, hbuf, b, gate_up, nthreads, vnni);
    lora_deltas(lora, G, L, row_group, i, 2, hbuf, b, hd, gate_up, gu, nthreads);
    lm_silu_and_mul(gate_up, b, gu / 2, act, nthreads);
    linear(li + 3 * LIN_ROW, act, b, out, nthreads, vnni);
    lora_deltas(lora, G, L, row_group, i, 3, act, b, gu / 2, out, hd, nthreads);
  }
}

void lm_gelu_tanh_and_mul(const float *gu, int64_t n, int64_t i, float *out, int nthreads);

/* models/cpu_decode.py's GemmaDecodePlan.run, kernel for kernel: q / k RMSNorm per head, a rotary
 * table per layer (local and global layers differ), sandwich norms, GeGLU. Per layer i, beside
 * lm_llama_layers' lin, scales, windows, cache and rows:
 *   norms [L, 6]  input, q, k, post-attention, pre-feedforward and post-feedforward RMSNorm weights
 *   rope  [L, 2]  this step's cos and sin (B, d) float32 for the layer's rotary table
 * Buffers as lm_llama_layers', plus normed [B, hidden]. */
void lm_gemma_layers(int64_t L, const int64_t *lin, const int64_t *norms, const float *scales, const int64_t *windows,
                     const int64_t *cache, const int64_t *rows, const int64_t *rope, const float *x, int64_t b,
                     int64_t hd, float eps, int h, int hkv, int d, int64_t block_size, int simd, int nthreads, int vnni,
                     int kv_kind, float *res, float *hbuf, float *qkv, float *att, float *tmp, float *normed,
                     float *gate_up, float *act, float *out, const int64_t *lora, int64_t G, const int64_t *row_group) {
  const int64_t width = (int64_t)(h + 2 * hkv) * d;
  for (int64_t i = 0; i < L; i++) {
    const int64_t *li = lin + i * 4 * LIN_ROW, *r = rows + i * 4, *nw = norms + i * 6;
    const float *w_in = (const float *)P(nw[0]), *w_q = (const float *)P(nw[1]), *w_k = (const float *)P(nw[2]);
    const float *w_post_attn = (const float *)P(nw[3]), *w_pre_ff = (const float *)P(nw[4]);
    const float *w_post_ff = (const float *)P(nw[5]);
    block_input(i, x, out, res, w_in, eps, b, hd, hbuf, nthreads);
    linear(li, hbuf, b, qkv, nthreads, vnni);
    lora_deltas(lora, G, L, row_group, i, 0, hbuf, b, hd, qkv, width, nthreads);
    for (int64_t t = 0; t < b; t++) { /* q and k heads normed in place, a row of d per head */
      float *row = qkv + t * width;
      lm_add_rmsnorm(row, d, NULL, 0, w_q, eps, h, d, row, NULL, nthreads);
      lm_add_rmsnorm(row + (int64_t)h * d, d, NULL, 0, w_k, eps, hkv, d, row + (int64_t)h * d, NULL, nthreads);
    }
    lm_rotary(qkv, b, h + hkv, d, width, d, (const float *)P(rope[2 * i]), (const float *)P(rope[2 * i + 1]));
    attend(qkv, cache + 4 * i, r, kv_kind, b, h, hkv, d, block_size, scales[i], windows[i], att, simd, nthreads);
    linear(li + LIN_ROW, att, b, tmp, nthreads, vnni);
    lora_deltas(lora, G, L, row_group, i, 1, att, b, (int64_t)h * d, tmp, hd, nthreads);
    lm_add_rmsnorm(tmp, hd, NULL, 0, w_post_attn, eps, b, hd, normed, NULL, nthreads); /* the attention block's output norm */
    lm_add_rmsnorm(normed, hd, res, hd, w_pre_ff, eps, b, hd, hbuf, res, nthreads);
    const int64_t gu = li[2 * LIN_ROW + 2];
    linear(li + 2 * LIN_ROW, hbuf, b, gate_up, nthreads, vnni);
    lora_deltas(lora, G, L, row_group, i, 2, hbuf, b, hd, gate_up, gu, nthreads);
    lm_gelu_tanh_and_mul(gate_up, b, gu / 2, act, nthreads);
    linear(li + 3 * LIN_ROW, act, b, tmp, nthreads, vnni);
    lora_deltas(lora, G, L, row_group, i, 3, act, b, gu / 2, tmp, hd, nthreads);
    lm_add_rmsnorm(tmp, hd, NULL, 0, w_post_ff, eps, b, hd, out, NULL, nthreads); /* the MLP block's output, normed */
  }
}

/* ---------------------------------------------------------------------------------------------------------
 * The EAGLE head (spec/eagle_native.py): fc([feature ; embedding]) + one Llama layer (lm_llama_layers with
 * L = 1) + the read-out, its KV entries in a paged pool of its own (K, V [S, Hkv, d] float32, blocks of
 * block_size slots, a block table per sequence), so that a draft costs its kernels and no Python.
 * Shared arguments: hd hidden size; fc the fc linear's row of 8 (2 hd -> hd) and its bias (hd,) float32;
 * cos_tab, sin_tab [P, d] the head's rotary tables. */

/* y (n, hd) = fc([feats ; embeds]) + bias, through xin (n, 2 hd) */
static void head_input(const int64_t *fc, const float *bias, const float *feats, const float *embeds, int64_t n,
                       int64_t hd, float *xin, float *y, int nthreads, int vnni) {
  for (int64_t t = 0; t < n; t++) {
    memcpy(xin + t * 2 * hd, feats + t * hd, sizeof(float) * (size_t)hd);
    memcpy(xin + t * 2 * hd + hd, embeds + t * hd, sizeof(float) * (size_t)hd);
  }
  linear(fc, xin, n, y, nthreads, vnni);
  for (int64_t t = 0; t < n; t++)
    for (int64_t j = 0; j < hd; j++) y[t * hd + j] += bias[j];
}

/* The committed rows' entries (the proposer's observe): n rows of (feature, next token's embedding) at
 * positions pos, their K and V (the layer's input norm w_in, then kv: the k and v projections as one
 * linear, (2 Hkv d) outputs, rotary on k) stored at slots of the pool. Buffers: xin (n, 2 hd), x and hbuf
 * (n, hd), kv (n, 2 Hkv d), c and s (n, d). */
void lm_eagle_kv(int64_t n, const float *feats, const float *embeds, const int64_t *pos, const int64_t *slots,
                 const int64_t *fc, const float *fc_bias, const float *w_in, const int64_t *kv_lin, float eps, int hkv,
                 int d, int64_t hd, const float *cos_tab, const float *sin_tab, float *k_cache, float *v_cache,
                 int nthreads, int vnni, float *xin, float *x, float *hbuf, float *kv, float *c, float *s) {
  const int64_t width = 2 * (int64_t)hkv * d;
  head_input(fc, fc_bias, feats, embeds, n, hd, xin, x, nthreads, vnni);
  lm_add_rmsnorm(x, hd, NULL, 0, w_in, eps, n, hd, hbuf, NULL, nthreads);
  linear(kv_lin, hbuf, n, kv, nthreads, vnni);
  for (int64_t t = 0; t < n; t++) {
    memcpy(c + t * d, cos_tab + pos[t] * d, sizeof(float) * (size_t)d);
    memcpy(s + t * d, sin_tab + pos[t] * d, sizeof(float) * (size_t)d);
  }
  lm_rotary(kv, n, hkv, d, width, d, c, s);
  for (int64_t t = 0; t < n; t++) {
    memcpy(k_cache + slots[t] * hkv * d, kv + t * width, sizeof(float) * (size_t)(hkv * d));
    memcpy(v_cache + slots[t] * hkv * d, kv + t * width + (int64_t)hkv * d, sizeof(float) * (size_t)(hkv * d));
  }
}

/* `rounds` chained drafts for b sequences. In: feats (b, hd) each sequence's newest feature, embeds
 * (b, hd) the embedding of its last token, pos (b,) the feature's position, lens (b,) its entries in the
 * pool, tables (b, T) its blocks (enough for lens + rounds entries). Each round: the layer over one new
 * entry per sequence (stored at the next slot: lm_llama_layers' attention stores it), the predicted
 * feature (the residual stream after the layer) back into feats, logits (b, vs) = readout(feats), the
 * argmax's index into draft (rounds, b) and, for the next round, the embedding of that token: row
 * table[index] of vocab_embeds (vs, hd), the read-out rows' tokens' embeddings; pos and lens advance.
 * lin, norms, scales, windows, cache: lm_llama_layers' arrays for its one layer; rows (4,) int64 holds
 * (tables, T, lens, slots) as addresses, slots (b,) is written here. Buffers: xin (b, 2 hd), x (b, hd),
 * lm_llama_layers' res .. out, c and s (b, d).
 * min_prob > 0: probs (rounds, b) receives each argmax's probability under the round's softmax, and
 * drafting stops after the first round in which no sequence is still confident (every one of its
 * drafts so far at least min_prob); the caller cuts each chain at its first draft below min_prob.
 * Returns the rounds run. */
int64_t lm_eagle_draft(int64_t rounds, int64_t b, float *feats, const float *embeds, int64_t *pos, int64_t *lens,
                    const int64_t *tables, int64_t T, int64_t *slots, const int64_t *rows, int64_t block_size,
                    const int64_t *fc, const float *fc_bias, const int64_t *lin, const int64_t *norms,
                    const float *scales, const int64_t *windows, const int64_t *cache, float eps, int h, int hkv, int d,
                    int64_t hd, const float *cos_tab, const float *sin_tab, const int64_t *readout,
                    const float *vocab_embeds, int simd, int nthreads, int vnni, float min_prob, int64_t *draft,
                    float *probs, float *logits, float *xin, float *x, float *res, float *hbuf, float *qkv, float *att,
                    float *tmp, float *gate_up, float *act, float *out, float *c, float *s, float *next) {
  const int64_t vs = readout[2];
  const float *emb = embeds;
  for (int64_t r = 0; r < rounds; r++) {
    head_input(fc, fc_bias, feats, emb, b, hd, xin, x, nthreads, vnni);
    for (int64_t t = 0; t < b; t++) {
      const int64_t e = lens[t]; /* the new entry's index */
      slots[t] = tables[t * T + e / block_size] * block_size + e % block_size;
      lens[t] = e + 1;
      memcpy(c + t * d, cos_tab + pos[t] * d, sizeof(float) * (size_t)d);
      memcpy(s + t * d, sin_tab + pos[t] * d, sizeof(float) * (size_t)d);
    }
    lm_llama_layers(1, lin, norms, scales, windows, cache, rows, x, b, hd, eps, h, hkv, d, block_size, c, s, simd,
                    nthreads, vnni, 0, res, hbuf, qkv, att, tmp, gate_up, act, out, NULL, 0, NULL);
    for (int64_t i = 0; i < b * hd; i++) feats[i] = res[i] + out[i];
    linear(readout, feats, b, logits, nthreads, vnni);
    for (int64_t t = 0; t < b; t++) {
      const float *l = logits + t * vs;
      int64_t best = 0;
      for (int64_t j = 1; j < vs; j++) best = l[j] > l[best] ? j : best; /* the first of equal maxima, as torch */
      draft[r * b + t] = best;
      if (min_prob > 0.0f) { /* the argmax's probability: 1 / sum_j exp(l_j - l_best) */
        double z = 0.0;
        for (int64_t j = 0; j < vs; j++) z += expf(l[j] - l[best]);
        probs[r * b + t] = (float)(1.0 / z);
      }
      memcpy(next + t * hd, vocab_embeds + best * hd, sizeof(float) * (size_t)hd);
      pos[t] += 1;
    }
    emb = next;
    if (min_prob > 0.0f) { /* any sequence whose chain is still confident? */
      int64_t alive = 0;
      for (int64_t t = 0; t < b && !alive; t++) {
        alive = 1;
        for (int64_t q = 0; q <= r; q++) alive &= probs[q * b + t] >= min_prob;
      }
      if (!alive) return r + 1;
    }
  }
  return rounds;
}
