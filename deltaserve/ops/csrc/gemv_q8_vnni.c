// int8 decode GEMVs on int8 activations (AVX512-VNNI): llama.cpp's Q8_0 x Q8_0 semantics, split
// from gemv_quant.c (the fp32-activation kernels). ops/qgemv.py holds the reference
// (qgemv_q8_act_ref) and picks between the two per shape.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include "simd.h"

#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

void ds_gemv_q8(const int8_t* w, const float* s, const float* x, float* y, long N, long K, long G,
                int num_threads);
void ds_gemm_q8(const int8_t* w, const float* s, const float* x, float* y, long M, long N, long K,
                long G, int num_threads);

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// int8 x int8 (llama.cpp Q8_0 x Q8_0): x is quantized per group of G (symmetric, d = absmax/127,
// round to nearest even), then each 64-byte chunk is one VPDPBUSD. DPBUSD wants u8 x s8: the
// weights go in as w ^ 0x80 = w + 128, and -128 * sum(xq over the group) in lane 0 of the group's
// int32 accumulator takes the 128 back out. ops/qgemv.py (qgemv_q8_act_ref) holds the reference.
#define VNNI_ROWS 4
#define VNNI_MAX_G 512  // 128 * G * 127 (the correction) stays exact in int32 and in fp32 lanes

// xq int8 [K], dx fp32 [K/G], corr int32 [K/G] = -128 * sum(xq of group g).
// x / d, not x * (1/d): 1/d overflows for denormal d, and 0 * inf would be NaN.
static void quantize_x_q8(const float* x, int8_t* xq, float* dx, int32_t* corr, long K, long G) {
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  for (long g = 0; g < K / G; g++) {
    const float* xg = x + g * G;
    __m512 amax = _mm512_setzero_ps();
    __mmask16 nan = 0;  // max_ps drops NaNs; a NaN in x must still reach y (as in torch)
    for (long k = 0; k < G; k += 16) {
      const __m512 v = _mm512_loadu_ps(xg + k);
      amax = _mm512_max_ps(amax, _mm512_abs_ps(v));
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    }
    const float d = nan ? NAN : _mm512_reduce_max_ps(amax) / 127.f;
    const __m512 dv = _mm512_set1_ps(d);
    __m512i sum = _mm512_setzero_si512();
    for (long k = 0; k < G; k += 16) {  // cvtps rounds to nearest even (the default MXCSR mode)
      __m512i q = _mm512_setzero_si512();
      if (d > 0.f) q = _mm512_cvtps_epi32(_mm512_div_ps(_mm512_loadu_ps(xg + k), dv));
      q = _mm512_min_epi32(_mm512_max_epi32(q, lo), hi);
      sum = _mm512_add_epi32(sum, q);
      _mm_storeu_si128((__m128i*)(xq + g * G + k), _mm512_cvtepi32_epi8(q));
    }
    dx[g] = d;
    corr[g] = -128 * _mm512_reduce_add_epi32(sum);
  }
}

// R rows share each xq load; the next block's codes are prefetched (as block_q8). Per group: the
// int32 dot goes to fp32 (exact: |lane| < 2^24) and is FMAed with s[n,g] * dx[g].
static inline __attribute__((always_inline)) void block_vnni(
    const int8_t* w, const float* s, const int8_t* xq, const float* dx, const int32_t* corr,
    float* y, long n0, long K, long G, const int R) {
  const __m512i flip = _mm512_set1_epi8((char)0x80);
  const long num_groups = K / G;
  const int8_t* rows = w + n0 * K;
  __m512 total[VNNI_ROWS];
  for (int r = 0; r < R; r++) total[r] = _mm512_setzero_ps();
  for (long g = 0; g < num_groups; g++) {
    const __m512i c = _mm512_zextsi128_si512(_mm_cvtsi32_si128(corr[g]));
    __m512i acc[VNNI_ROWS];
    for (int r = 0; r < R; r++) acc[r] = c;
    for (long k = g * G; k < (g + 1) * G; k += 64) {
      const __m512i xv = _mm512_loadu_si512(xq + k);
      for (int r = 0; r < R; r++) {
        const int8_t* p = rows + r * K + k;
        _mm_prefetch((const char*)(p + R * K), _MM_HINT_T0);
        __m512i u = _mm512_xor_si512(_mm512_loadu_si512(p), flip);
        acc[r] = _mm512_dpbusd_epi32(acc[r], u, xv);
      }
    }
    for (int r = 0; r < R; r++) {
      const float f = s[(n0 + r) * num_groups + g] * dx[g];
      total[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r]), _mm512_set1_ps(f), total[r]);
    }
  }
  for (int r = 0; r < R; r++) y[n0 + r] = _mm512_reduce_add_ps(total[r]);
}

void ds_gemv_q8_vnni(const int8_t* w, const float* s, const float* x, float* y, long N, long K,
                     long G, int num_threads) {
  if (G % 64 || K % G || G > VNNI_MAX_G) {
    ds_gemv_q8(w, s, x, y, N, K, G, num_threads);
    return;
  }
  // K is a multiple of 64 here: xq fills whole lines; dx and corr follow (8 bytes per group)
  int8_t* xq = aligned_alloc(64, K + (K / G * 8 + 63) / 64 * 64);
  float* dx = (float*)(xq + K);
  int32_t* corr = (int32_t*)(dx + K / G);
  quantize_x_q8(x, xq, dx, corr, K, G);
  const long num_blocks = N / VNNI_ROWS;
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (long b = 0; b < num_blocks; b++)
    block_vnni(w, s, xq, dx, corr, y, b * VNNI_ROWS, K, G, VNNI_ROWS);
  for (long n = num_blocks * VNNI_ROWS; n < N; n++)  // at most 3 rows
    block_vnni(w, s, xq, dx, corr, y, n, K, G, 1);
  free(xq);
}

// M activation rows (a decode batch, draft rows): each block of weight rows meets every row's
// quantized x while it sits in L1, so the codes stream from memory once, not M times. Per (row,
// output) the arithmetic is block_vnni's in its order: the bits of M ds_gemv_q8_vnni calls.
void ds_gemm_q8_vnni(const int8_t* w, const float* s, const float* x, float* y, long M, long N,
                     long K, long G, int num_threads) {
  if (G % 64 || K % G || G > VNNI_MAX_G) {
    ds_gemm_q8(w, s, x, y, M, N, K, G, num_threads);  // the bits of a ds_gemv_q8 per row
    return;
  }
  const long stride = K + (K / G * 8 + 63) / 64 * 64;  // per row: xq, then dx and corr
  int8_t* xq = aligned_alloc(64, stride * M);
  for (long m = 0; m < M; m++) {
    float* dx = (float*)(xq + m * stride + K);
    quantize_x_q8(x + m * K, xq + m * stride, dx, (int32_t*)(dx + K / G), K, G);
  }
  const long num_blocks = N / VNNI_ROWS;
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (long b = 0; b <= num_blocks; b++) {
    const long n0 = b * VNNI_ROWS, rows = b < num_blocks ? VNNI_ROWS : N - n0;
    for (long m = 0; m < M; m++) {
      const int8_t* q = xq + m * stride;
      const float* dx = (const float*)(q + K);
      const int32_t* corr = (const int32_t*)(dx + K / G);
      if (rows == VNNI_ROWS) {
        block_vnni(w, s, q, dx, corr, y + m * N, n0, K, G, VNNI_ROWS);
      } else {  // the last (at most 3) weight rows, one at a time as ds_gemv_q8_vnni does
        for (long r = 0; r < rows; r++) block_vnni(w, s, q, dx, corr, y + m * N, n0 + r, K, G, 1);
      }
    }
  }
  free(xq);
}
#endif
