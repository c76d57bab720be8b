// Decode GEMV for bf16 weights: y[n] = sum_k float(w[n,k]) * x[k], fp32 activations and accumulation.
// Rows are split over OpenMP threads in blocks of 8 that share each x load; the next block is
// prefetched in software (measured 15 -> 25 GB/s on a 2-core AVX-512 Xeon; ops/gemv.py has the
// torch reference and tests/ops/test_gemv.py the parity test).
#include <stdint.h>
#include <string.h>
#if defined(__SSE__)
#include <xmmintrin.h>
// Flush-to-zero + denormals-are-zero for this thread: decayed states underflow into denormals,
// whose arithmetic is ~100x slower; values below 1e-38 do not matter at fp32 precision.
#define DS_FTZ() _mm_setcsr(_mm_getcsr() | 0x8040)
#else
#define DS_FTZ()
#endif
#include "simd.h"

// a * b + c stays two roundings wherever it is written here, so a scalar expression repeated in a
// GEMV and its multi-row form gives the same bits in both (the compiler may fuse one and not the
// other, as the AVX2 build did); the vector FMAs are explicit intrinsics.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#define ROWS 8

static inline float bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

// y[m*N + n] for rows n0..n1 and M activation rows (the single-row GEMV passes M = 1).
static void rows_scalar_m(const uint16_t* w, const float* x, float* y, long n0, long n1, long M,
                          long N, long K) {
  for (long m = 0; m < M; m++) {
    for (long n = n0; n < n1; n++) {
      const uint16_t* r = w + n * K;
      float acc = 0.f;
      for (long k = 0; k < K; k++) acc += bf16_to_f32(r[k]) * x[m * K + k];
      y[m * N + n] = acc;
    }
  }
}

#if DS_SIMD16

static void block_simd(const uint16_t* w, const float* x, float* y, long n0, long K) {
  const uint16_t* r = w + n0 * K;
  vf16 acc[ROWS];
  for (int i = 0; i < ROWS; i++) acc[i] = vf_zero();
  long k = 0;
  for (; k + 32 <= K; k += 32) {
    vf16 x0 = vf_load(x + k), x1 = vf_load(x + k + 16);
    for (int i = 0; i < ROWS; i++) {
      ds_prefetch(r + (i + ROWS) * K + k);
      acc[i] = vf_fma(vf_load_bf16(r + i * K + k), x0, acc[i]);
      acc[i] = vf_fma(vf_load_bf16(r + i * K + k + 16), x1, acc[i]);
    }
  }
  for (int i = 0; i < ROWS; i++) {
    float tail = 0.f;
    for (long t = k; t < K; t++) tail += bf16_to_f32(r[i * K + t]) * x[t];
    y[n0 + i] = vf_sum(acc[i]) + tail;
  }
}
#endif

void ds_gemv_bf16(const uint16_t* w, const float* x, float* y, long N, long K, int num_threads) {
  long num_blocks = N / ROWS;
#pragma omp parallel num_threads(num_threads)
  {
  DS_FTZ();
#pragma omp for schedule(static)
  for (long b = 0; b < num_blocks; b++) {
#if DS_SIMD16
    block_simd(w, x, y, b * ROWS, K);
#else
    __builtin_prefetch(w + (b + 1) * ROWS * K);
    rows_scalar_m(w, x, y, b * ROWS, (b + 1) * ROWS, 1, N, K);
#endif
  }
  }
  rows_scalar_m(w, x, y, num_blocks * ROWS, N, 1, N, K);
}

// Small-batch GEMM for bf16 weights: y[m,n] = sum_k float(w[n,k]) * x[m,k] for M activation rows
// (continuous batching's decode steps). Each block of 4 weight rows is streamed from memory once
// and meets the activation rows 4 at a time while it sits in L1: weight traffic as for one row,
// 16 accumulators per (4 weight rows x 4 activation rows) tile.
#define WR 4
#if defined(__AVX512F__)
#define XR 4
#else  // AVX2: 16 registers, and each vf16 takes two
#define XR 2
#endif
#if DS_SIMD16
static void tile_simd(const uint16_t* w, const float* x, float* y, long n0, long m0, long nx,
                        long N, long K) {
  vf16 acc[XR][WR];
  for (int m = 0; m < XR; m++)
    for (int r = 0; r < WR; r++) acc[m][r] = vf_zero();
  const uint16_t* rows = w + n0 * K;
  long k = 0;
  for (; k + 16 <= K; k += 16) {
    vf16 wv[WR];
    for (int r = 0; r < WR; r++) wv[r] = vf_load_bf16(rows + r * K + k);
    for (int m = 0; m < XR; m++) {
      if (m >= nx) break;
      vf16 xv = vf_load(x + (m0 + m) * K + k);
      for (int r = 0; r < WR; r++) acc[m][r] = vf_fma(wv[r], xv, acc[m][r]);
    }
  }
  for (int m = 0; m < nx; m++) {
    for (int r = 0; r < WR; r++) {
      float tail = 0.f;
      for (long t = k; t < K; t++) tail += bf16_to_f32(rows[r * K + t]) * x[(m0 + m) * K + t];
      y[(m0 + m) * N + n0 + r] = vf_sum(acc[m][r]) + tail;
    }
  }
}
#endif

void ds_gemm_bf16(const uint16_t* w, const float* x, float* y, long M, long N, long K,
                  int num_threads) {
  long num_blocks = N / WR;
#pragma omp parallel num_threads(num_threads)
  {
  DS_FTZ();
#pragma omp for schedule(static)
  for (long b = 0; b < num_blocks; b++) {
#if DS_SIMD16
    if (b + 1 < num_blocks) ds_prefetch(w + (b + 1) * WR * K);
    for (long m0 = 0; m0 < M; m0 += XR)
      tile_simd(w, x, y, b * WR, m0, M - m0 < XR ? M - m0 : XR, N, K);
#else
    rows_scalar_m(w, x, y, b * WR, (b + 1) * WR, M, N, K);
#endif
  }
  }
  rows_scalar_m(w, x, y, num_blocks * WR, N, M, N, K);
}
