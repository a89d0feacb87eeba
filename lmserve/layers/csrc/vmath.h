/* exp for the CPU kernels, written once in scalar C and inlined into each caller's `omp simd` loop,
 * where the compiler vectorises it for that function's target (plain, AVX2, AVX-512): libm's expf is
 * a call per element, which made SiLU-and-mul and the attention softmax the slowest part of a batch-8
 * decode step (issue #15). Not `declare simd`: GCC then called an out-of-line SSE2 clone from every
 * target, which rintf kept scalar (9 ns an element: SiLU-and-mul took 4 ms of a 37 ms batch-8 step on
 * an AVX2 machine). Rounding is the add-and-subtract of 1.5 * 2^23 (round to nearest even, like rintf,
 * for |v| < 2^22), which vectorises without SSE4.1.
 * Cody-Waite range reduction and a degree-6 polynomial (Cephes' expf): relative error under 2e-7 on
 * [-87, 88]; inputs clamped there (exp(-87.3) ~ 1e-38, exp(88.3) ~ 2e38). */
#ifndef LM_VMATH_H
#define LM_VMATH_H
#include <stdint.h>
#include <string.h>

static inline __attribute__((always_inline)) float lm_expf(float x) {
  x = x < -87.3f ? -87.3f : (x > 88.3f ? 88.3f : x);
  const float fx = (x * 1.44269504088896341f + 12582912.f) - 12582912.f; /* n = round(x / ln 2) */
  const float r = x - fx * 0.693359375f + fx * 2.12194440e-4f; /* x - n ln 2, in two parts */
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.f;
  const int32_t bits = ((int32_t)fx + 127) << 23; /* 2^n */
  float scale;
  memcpy(&scale, &bits, sizeof scale);
  return y * scale;
}
#endif
