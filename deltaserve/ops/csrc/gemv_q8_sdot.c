// int8 weights on int8 activations for ARM CPUs with the dot-product extension (Armv8.2+ SDOT:
// Apple M1 and later, Graviton 2+, Ampere, recent Snapdragons): the VNNI kernels' math
// (gemv_vnni.c; ops/qgemv.qgemv_act_ref is the spec) under the same symbols, as gemv_q8_avx2.c is
// on AVX2: x rounded per group to int8 (d = absmax / 127, nearest even), exact int32 dots by
// SDOT, per group y += s * dx * dot. Only int8 / Q8_0 so far: 4-bit, q1 and the blocks keep fp32
// activations on ARM. Checked under qemu-user: tests/ops/test_arm_parity.py.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "scales.h"
#include "simd.h"

#if defined(__aarch64__) && defined(__ARM_NEON) && defined(__ARM_FEATURE_DOTPROD) && \
    !defined(DS_NO_NEON)
#include <arm_neon.h>

#define SDOT_MAX_G 512
void ds_gemv_q8(const int8_t* w, const void* s, const float* x, float* y, long N, long K, long G,
                int num_threads, int scale_kind);
void ds_gemm_q8(const int8_t* w, const void* s, const float* x, float* y, long M, long N, long K,
                long G, int num_threads, int scale_kind);

int ds_int8_act_sdot(void) { return 1; }

static int shape_ok(long K, long G) {  // gemv_vnni.c's q8_vnni_shape_ok
  return (G == 32 && K % 64 == 0) || (G % 64 == 0 && G <= SDOT_MAX_G && K % G == 0);
}

// x [K] -> xq [K] int8 and dx [K/G]; x / d, not x * (1/d): 1/d overflows for denormal d. A NaN
// anywhere in a group makes its d NaN, so it reaches y (as in torch).
static void quantize_x(const float* x, int8_t* xq, float* dx, long K, long G) {
  for (long g = 0; g < K / G; g++) {
    const float* xg = x + g * G;
    float amax = 0.f;
    int nan = 0;
    for (long k = 0; k < G; k++) {
      nan |= isnan(xg[k]);
      amax = fmaxf(amax, fabsf(xg[k]));
    }
    const float d = nan ? NAN : amax / 127.f;
    for (long k = 0; k < G; k++) {
      float q = d > 0.f ? nearbyintf(xg[k] / d) : 0.f;  // the default mode: nearest even
      q = q < -127.f ? -127.f : q > 127.f ? 127.f : q;
      xq[g * G + k] = (int8_t)q;
    }
    dx[g] = d;
  }
}

// one weight row (scales from index s0 on) against one quantized activation row
static float row_q8(const int8_t* w, const void* s, int sk, long s0, const int8_t* xq,
                    const float* dx, long K, long G) {
  float total = 0.f;
  for (long g = 0; g < K / G; g++) {
    int32x4_t acc = vdupq_n_s32(0);
    for (long k = g * G; k < (g + 1) * G; k += 16)
      acc = vdotq_s32(acc, vld1q_s8(w + k), vld1q_s8(xq + k));
    total += (float)vaddvq_s32(acc) * dx[g] * ds_scale(s, s0 + g, sk);
  }
  return total;
}

#include "q8_act_driver.h"  // ds_gemm_q8_vnni, ds_gemv_q8_vnni
#endif
