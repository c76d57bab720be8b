// int8 codes on int8 activations (Q8_0 x Q8_0 semantics) for CPUs with AVX2 but without
// AVX512-VNNI (most laptops): gemv_vnni.c's int8 math (x rounded per group of G to int8 steps,
// d = absmax / 127, round to nearest even) with VPMADDUBSW on |w| and x carrying w's sign
// (|w| <= 128, |xq| <= 127: the 16-bit pair sums never saturate) and VPMADDWD into int32 lanes.
// Per group: the integer dot to fp32, one FMA by s * dx. The same symbols as the VNNI build
// (ops/qgemv.q8_is_vnni: "the int8-activation int8 GEMV"); the fp32 sums run over 8 lanes, so the
// two builds differ in the last bits. A row's bits never depend on M. Reference:
// ops/qgemv.qgemv_act_ref.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include "scales.h"

#if !(defined(__AVX512VNNI__) && defined(__AVX512BW__)) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

void ds_gemv_q8(const int8_t* w, const void* s, const float* x, float* y, long N, long K, long G,
                int num_threads, int scale_kind);
void ds_gemm_q8(const int8_t* w, const void* s, const float* x, float* y, long M, long N, long K,
                long G, int num_threads, int scale_kind);

// marks this build's int8-activation GEMV as the AVX2 one (ops/native.isa_paths)
int ds_int8_act_avx2(void) { return 1; }

#define MAX_G 512  // as gemv_vnni.c's VNNI_MAX_G

static int shape_ok(long K, long G) {  // gemv_vnni.c's q8_vnni_shape_ok
  return (G == 32 && K % 64 == 0) || (G % 64 == 0 && G <= MAX_G && K % G == 0);
}

// x [K] -> xq [K] int8 and dx [K/G]; x / d, not x * (1/d): 1/d overflows for denormal d
static void quantize_x(const float* x, int8_t* xq, float* dx, long K, long G) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
  for (long g = 0; g < K / G; g++) {
    const float* xg = x + g * G;
    __m256 amax = _mm256_setzero_ps();
    int nan = 0;  // max_ps drops NaNs; a NaN in x must still reach y (as in torch)
    for (long k = 0; k < G; k += 8) {
      const __m256 v = _mm256_loadu_ps(xg + k);
      nan |= _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    const float d = nan ? NAN : _mm_cvtss_f32(m) / 127.f;
    const __m256 dv = _mm256_set1_ps(d);
    for (long k = 0; k < G; k += 8) {  // cvtps rounds to nearest even (the default MXCSR mode)
      __m256i q = _mm256_setzero_si256();
      if (d > 0.f) q = _mm256_cvtps_epi32(_mm256_div_ps(_mm256_loadu_ps(xg + k), dv));
      q = _mm256_min_epi32(_mm256_max_epi32(q, lo), hi);
      const __m128i q16 = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
      _mm_storel_epi64((__m128i*)(xq + g * G + k), _mm_packs_epi16(q16, q16));
    }
    dx[g] = d;
  }
}

static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// one weight row (scales from index s0 on) against one quantized activation row
static float row_q8(const int8_t* w, const void* s, int sk, long s0, const int8_t* xq,
                    const float* dx, long K, long G) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 total = _mm256_setzero_ps();
  for (long g = 0; g < K / G; g++) {
    __m256i acc = _mm256_setzero_si256();
    for (long k = g * G; k < (g + 1) * G; k += 32) {
      const __m256i wv = _mm256_loadu_si256((const __m256i*)(w + k));
      const __m256i xv = _mm256_loadu_si256((const __m256i*)(xq + k));
      const __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(wv), _mm256_sign_epi8(xv, wv));
      acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, ones));
    }
    const float f = ds_scale(s, s0 + g, sk) * dx[g];
    total = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), _mm256_set1_ps(f), total);
  }
  return hsum8(total);
}

void ds_gemm_q8_vnni(const int8_t* w, const void* s, const float* x, float* y, long M, long N,
                     long K, long G, int num_threads, int scale_kind) {
  if (!shape_ok(K, G)) {  // the bits of a ds_gemv_q8 per row
    ds_gemm_q8(w, s, x, y, M, N, K, G, num_threads, scale_kind);
    return;
  }
  int8_t* xq = malloc(M * K);
  float* dx = malloc(sizeof(float) * M * (K / G));
  if (xq == NULL || dx == NULL) abort();  // out of memory: stop rather than write through NULL
  for (long m = 0; m < M; m++) quantize_x(x + m * K, xq + m * K, dx + m * (K / G), K, G);
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (long n = 0; n < N; n++)
    for (long m = 0; m < M; m++)
      y[m * N + n] = row_q8(w + n * K, s, scale_kind, n * (K / G), xq + m * K, dx + m * (K / G),
                            K, G);
  free(xq), free(dx);
}

void ds_gemv_q8_vnni(const int8_t* w, const void* s, const float* x, float* y, long N, long K,
                     long G, int num_threads, int scale_kind) {
  if (!shape_ok(K, G)) {
    ds_gemv_q8(w, s, x, y, N, K, G, num_threads, scale_kind);
    return;
  }
  ds_gemm_q8_vnni(w, s, x, y, 1, N, K, G, num_threads, scale_kind);
}
#endif
