// Decode GEMVs that read quantized weights directly: fp32 activations and accumulation; scales
// (and biases) fp32, fp16 or bf16 as scale_kind says (scales.h), widened exactly.
//   q8: w = s * q, q int8 [N,K], s [N,K/G]
//   a4: w = s * q + b, q 4-bit codes, byte i of a row holds elements 2i (low) and 2i+1 (high)
//   q1: w = s * (2b - 1), bit k%8 of byte k/8 is element k
// Per group: dot(codes, x) times the scale, plus bias times sum(x over the group) (a4) or minus
// sum(x) (q1), so each code is touched once. ops/qgemv.py holds the torch reference. int8 and
// 4-bit codes on int8 activations (VNNI) live in gemv_vnni.c.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include "scales.h"
#include "simd.h"

// a * b + c stays two roundings wherever it is written here, so a scalar expression repeated in a
// GEMV and its multi-row form gives the same bits in both (the compiler may fuse one and not the
// other, as the AVX2 build did); the vector FMAs are explicit intrinsics.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

// 16 when the vector paths are built (AVX-512 or AVX2 + FMA), 0 where only the scalar loops run:
// the multi-row kernels then save nothing over a GEMV per row (ops/qgemv.qgemm_max_rows).
int ds_simd_lanes(void) { return DS_SIMD16 ? 16 : 0; }

// The paths this build compiled, as ops/native.isa_paths reads them (what -march gave the
// compiler, not what the CPU has): bit 0 AVX2 + FMA vector loops, bit 1 AVX-512 ones, bit 2 F16C
// scale widening. The VNNI and AMX kernels show as their symbols.
int ds_simd_isa(void) {
#if defined(__F16C__)
  return DS_SIMD_ISA | 4;
#else
  return DS_SIMD_ISA;
#endif
}

static void group_sums(const float* x, float* xs, long K, long G) {
  for (long g = 0; g < K / G; g++) {
    float s = 0.f;
    for (long k = 0; k < G; k++) s += x[g * G + k];
    xs[g] = s;
  }
}

static float row_q8(const int8_t* w, const void* s, int sk, const float* x, long K, long G) {
  float acc = 0.f;
#if DS_SIMD16
  if (G % 16 == 0) {  // per-group partial sums scaled as vectors: one horizontal sum per row
    vf16 total = vf_zero();
    for (long g = 0; g < K / G; g++) {
      vf16 v = vf_zero();
      for (long k = g * G; k < (g + 1) * G; k += 16) {
        v = vf_fma(vf_load_i8(w + k), vf_load(x + k), v);
      }
      total = vf_fma(v, vf_set1(ds_scale(s, g, sk)), total);
    }
    return vf_sum(total);
  }
#endif
  for (long g = 0; g < K / G; g++) {
    float part = 0.f;
    for (long k = g * G; k < (g + 1) * G; k++) part += (float)w[k] * x[k];
    acc += part * ds_scale(s, g, sk);
  }
  return acc;
}

// xe/xo: x at even / odd positions, so low and high nibbles each meet a contiguous x vector.
static float row_a4(const uint8_t* w, const void* s, const void* b, int sk, const float* xe,
                    const float* xo, const float* xs, long K, long G) {
  float acc = 0.f;
#if DS_SIMD16
  if (G % 32 == 0) {
    vf16 total = vf_zero();
    for (long g = 0; g < K / G; g++) {
      vf16 v = vf_zero();
      for (long i = g * G / 2; i < (g + 1) * G / 2; i += 16) {
        vf16 lo, hi;
        vf_load_u4(w + i, &lo, &hi);
        v = vf_fma(lo, vf_load(xe + i), v);
        v = vf_fma(hi, vf_load(xo + i), v);
      }
      total = vf_fma(v, vf_set1(ds_scale(s, g, sk)), total);
      acc += ds_scale(b, g, sk) * xs[g];
    }
    return acc + vf_sum(total);
  }
#endif
  for (long g = 0; g < K / G; g++) {
    const uint8_t* wg = w + g * G / 2;
    const float* eg = xe + g * G / 2;
    const float* og = xo + g * G / 2;
    float part = 0.f;
    long i = 0;
#if DS_SIMD16
    vf16 v = vf_zero();
    for (; i + 16 <= G / 2; i += 16) {
      vf16 lo, hi;
      vf_load_u4(wg + i, &lo, &hi);
      v = vf_fma(lo, vf_load(eg + i), v);
      v = vf_fma(hi, vf_load(og + i), v);
    }
    part = vf_sum(v);
#endif
    for (; i < G / 2; i++) part += (float)(wg[i] & 0xF) * eg[i] + (float)(wg[i] >> 4) * og[i];
    acc += part * ds_scale(s, g, sk) + ds_scale(b, g, sk) * xs[g];
  }
  return acc;
}

static float row_q1(const uint8_t* w, const void* s, int sk, const float* x, const float* xs,
                    long K, long G) {
  float acc = 0.f;
  for (long g = 0; g < K / G; g++) {
    const uint8_t* wg = w + g * G / 8;
    const float* xg = x + g * G;
    float part = 0.f;
    long k = 0;
#if DS_SIMD16
    vf16 v = vf_zero();
    for (; k + 16 <= G; k += 16) {
      v = vf_mask_add(v, (uint16_t)(wg[k / 8] | (wg[k / 8 + 1] << 8)), vf_load(xg + k));
    }
    part = vf_sum(v);
#endif
    for (; k < G; k++) part += ((wg[k / 8] >> (k % 8)) & 1) ? xg[k] : 0.f;
    acc += ds_scale(s, g, sk) * (2.f * part - xs[g]);
  }
  return acc;
}

#if DS_SIMD16
#define Q8_ROWS 4
// Q8_ROWS rows at once share each x load; the next block's codes are prefetched (bf16 kernel's
// recipe: one row at a time streamed ~12 GB/s on the vocabulary head here).
static void block_q8(const int8_t* w, const void* s, int sk, const float* x, float* y, long n0,
                     long K, long G) {
  vf16 total[Q8_ROWS];
  for (int r = 0; r < Q8_ROWS; r++) total[r] = vf_zero();
  const int8_t* rows = w + n0 * K;
  for (long g = 0; g < K / G; g++) {
    vf16 v[Q8_ROWS];
    for (int r = 0; r < Q8_ROWS; r++) v[r] = vf_zero();
    for (long k = g * G; k < (g + 1) * G; k += 16) {
      vf16 xv = vf_load(x + k);
      for (int r = 0; r < Q8_ROWS; r++) {
        const int8_t* p = rows + r * K + k;
        ds_prefetch(p + Q8_ROWS * K);
        v[r] = vf_fma(vf_load_i8(p), xv, v[r]);
      }
    }
    for (int r = 0; r < Q8_ROWS; r++)
      total[r] = vf_fma(v[r], vf_set1(ds_scale(s, (n0 + r) * (K / G) + g, sk)), total[r]);
  }
  for (int r = 0; r < Q8_ROWS; r++) y[n0 + r] = vf_sum(total[r]);
}
#endif

void ds_gemv_q8(const int8_t* w, const void* s, const float* x, float* y, long N, long K, long G,
                int num_threads, int scale_kind) {
  long first_tail = 0;
#if DS_SIMD16
  if (G % 16 == 0) {
    long num_blocks = N / Q8_ROWS;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (long b = 0; b < num_blocks; b++) block_q8(w, s, scale_kind, x, y, b * Q8_ROWS, K, G);
    first_tail = num_blocks * Q8_ROWS;
  }
#endif
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (long n = first_tail; n < N; n++)
    y[n] = row_q8(w + n * K, ds_scale_at(s, n * (K / G), scale_kind), scale_kind, x, K, G);
}

#if DS_SIMD16
// block_q8 for activation rows m0 and (if two) m0 + 1 of a multi-row call: each chunk of codes is
// widened once for both rows, and every (row, weight row) accumulator takes block_q8's FMAs in
// block_q8's order, so each row gets the bits of its own GEMV; y is [M, N].
static void block_q8_rows(const int8_t* w, const void* s, int sk, const float* x, float* y, long n0,
                          long m0, int two, long N, long K, long G) {
  const float *x0 = x + m0 * K, *x1 = two ? x0 + K : x0;
  vf16 total[2][Q8_ROWS];
  for (int m = 0; m < 2; m++)
    for (int r = 0; r < Q8_ROWS; r++) total[m][r] = vf_zero();
  const int8_t* rows = w + n0 * K;
  for (long g = 0; g < K / G; g++) {
    vf16 v[2][Q8_ROWS];
    for (int m = 0; m < 2; m++)
      for (int r = 0; r < Q8_ROWS; r++) v[m][r] = vf_zero();
    for (long k = g * G; k < (g + 1) * G; k += 16) {
      const vf16 xa = vf_load(x0 + k), xb = vf_load(x1 + k);
      for (int r = 0; r < Q8_ROWS; r++) {
        const int8_t* p = rows + r * K + k;
        ds_prefetch(p + Q8_ROWS * K);
        const vf16 codes = vf_load_i8(p);
        v[0][r] = vf_fma(codes, xa, v[0][r]);
        v[1][r] = vf_fma(codes, xb, v[1][r]);
      }
    }
    for (int m = 0; m < 2; m++)
      for (int r = 0; r < Q8_ROWS; r++)
        total[m][r] =
            vf_fma(v[m][r], vf_set1(ds_scale(s, (n0 + r) * (K / G) + g, sk)), total[m][r]);
  }
  for (int m = 0; m < 1 + two; m++)
    for (int r = 0; r < Q8_ROWS; r++) y[(m0 + m) * N + n0 + r] = vf_sum(total[m][r]);
}
#endif

// M activation rows (decode batches, draft rows) over int8 codes on fp32 x (the exact kernel: no
// VNNI, or DELTASERVE_EXACT_INT8_ACT=1): codes stream once and are widened once per two rows;
// the bits of M ds_gemv_q8 calls.
void ds_gemm_q8(const int8_t* w, const void* s, const float* x, float* y, long M, long N, long K,
                long G, int num_threads, int scale_kind) {
  long first_tail = 0;
#if DS_SIMD16
  if (G % 16 == 0) {
    const long num_blocks = N / Q8_ROWS;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (long b = 0; b < num_blocks; b++)
      for (long m0 = 0; m0 < M; m0 += 2)
        block_q8_rows(w, s, scale_kind, x, y, b * Q8_ROWS, m0, m0 + 1 < M, N, K, G);
    first_tail = num_blocks * Q8_ROWS;
  }
#endif
#pragma omp parallel for num_threads(num_threads) schedule(static) collapse(2)
  for (long m = 0; m < M; m++)
    for (long n = first_tail; n < N; n++)
      y[m * N + n] = row_q8(w + n * K, ds_scale_at(s, n * (K / G), scale_kind), scale_kind,
                            x + m * K, K, G);
}

#if DS_SIMD16
// as block_q8: Q8_ROWS rows share each x load; codes of the next block prefetched
static void block_a4(const uint8_t* w, const void* s, const void* b, int sk, const float* xe,
                     const float* xo, const float* xs, float* y, long n0, long K, long G) {
  const long bytes = K / 2, num_groups = K / G;
  vf16 total[Q8_ROWS];
  float bias[Q8_ROWS];
  for (int r = 0; r < Q8_ROWS; r++) total[r] = vf_zero(), bias[r] = 0.f;
  const uint8_t* rows = w + n0 * bytes;
  for (long g = 0; g < num_groups; g++) {
    vf16 v[Q8_ROWS];
    for (int r = 0; r < Q8_ROWS; r++) v[r] = vf_zero();
    for (long i = g * G / 2; i < (g + 1) * G / 2; i += 16) {
      vf16 e = vf_load(xe + i), o = vf_load(xo + i);
      for (int r = 0; r < Q8_ROWS; r++) {
        const uint8_t* p = rows + r * bytes + i;
        ds_prefetch(p + Q8_ROWS * bytes);
        vf16 lo, hi;
        vf_load_u4(p, &lo, &hi);
        v[r] = vf_fma(lo, e, v[r]);
        v[r] = vf_fma(hi, o, v[r]);
      }
    }
    for (int r = 0; r < Q8_ROWS; r++) {
      long idx = (n0 + r) * num_groups + g;
      total[r] = vf_fma(v[r], vf_set1(ds_scale(s, idx, sk)), total[r]);
      bias[r] += ds_scale(b, idx, sk) * xs[g];
    }
  }
  for (int r = 0; r < Q8_ROWS; r++) y[n0 + r] = bias[r] + vf_sum(total[r]);
}
#endif

void ds_gemv_a4(const uint8_t* w, const void* s, const void* b, const float* x, float* y, long N,
                long K, long G, int num_threads, int scale_kind) {
  float* xe = malloc(sizeof(float) * (K / 2 + K / G + 1) * 2);
  float* xo = xe + K / 2;
  float* xs = xo + K / 2;
  for (long i = 0; i < K / 2; i++) {
    xe[i] = x[2 * i];
    xo[i] = x[2 * i + 1];
  }
  group_sums(x, xs, K, G);
  long first_tail = 0;
#if DS_SIMD16
  if (G % 32 == 0) {
    long num_blocks = N / Q8_ROWS;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (long blk = 0; blk < num_blocks; blk++)
      block_a4(w, s, b, scale_kind, xe, xo, xs, y, blk * Q8_ROWS, K, G);
    first_tail = num_blocks * Q8_ROWS;
  }
#endif
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (long n = first_tail; n < N; n++)
    y[n] = row_a4(w + n * (K / 2), ds_scale_at(s, n * (K / G), scale_kind),
                  ds_scale_at(b, n * (K / G), scale_kind), scale_kind, xe, xo, xs, K, G);
  free(xe);
}

#if DS_SIMD16
// block_a4 for activation rows m0 and (if two) m0 + 1 of a multi-row call: each 16-byte chunk of
// codes is unpacked once for both rows, and every (row, weight row) accumulator takes block_a4's
// FMAs in block_a4's order, so each row gets the bits of its own GEMV. xe/xo/xs hold each row's
// even / odd x and group sums (row strides K/2, K/2, K/G); y is [M, N].
static void block_a4_rows(const uint8_t* w, const void* s, const void* b, int sk, const float* xe,
                          const float* xo, const float* xs, float* y, long n0, long m0, int two,
                          long N, long K, long G) {
  const long bytes = K / 2, num_groups = K / G;
  // a lone last row (two == 0) stands in for the missing second one: nothing past row M - 1 is
  // read, and its duplicate results are never stored
  const float *e0 = xe + m0 * bytes, *o0 = xo + m0 * bytes, *e1 = two ? e0 + bytes : e0;
  const float *o1 = two ? o0 + bytes : o0, *xs0 = xs + m0 * num_groups;
  const float* xs_row[2] = {xs0, two ? xs0 + num_groups : xs0};
  vf16 total[2][Q8_ROWS];
  float bias[2][Q8_ROWS];
  for (int m = 0; m < 2; m++)
    for (int r = 0; r < Q8_ROWS; r++) total[m][r] = vf_zero(), bias[m][r] = 0.f;
  const uint8_t* rows = w + n0 * bytes;
  for (long g = 0; g < num_groups; g++) {
    vf16 v[2][Q8_ROWS];
    for (int m = 0; m < 2; m++)
      for (int r = 0; r < Q8_ROWS; r++) v[m][r] = vf_zero();
    for (long i = g * G / 2; i < (g + 1) * G / 2; i += 16) {
      const vf16 ea = vf_load(e0 + i), oa = vf_load(o0 + i);
      const vf16 eb = vf_load(e1 + i), ob = vf_load(o1 + i);
      for (int r = 0; r < Q8_ROWS; r++) {
        const uint8_t* p = rows + r * bytes + i;
        ds_prefetch(p + Q8_ROWS * bytes);
        vf16 lo, hi;
        vf_load_u4(p, &lo, &hi);
        v[0][r] = vf_fma(hi, oa, vf_fma(lo, ea, v[0][r]));
        v[1][r] = vf_fma(hi, ob, vf_fma(lo, eb, v[1][r]));
      }
    }
    for (int m = 0; m < 2; m++) {
      for (int r = 0; r < Q8_ROWS; r++) {
        const long idx = (n0 + r) * num_groups + g;
        total[m][r] = vf_fma(v[m][r], vf_set1(ds_scale(s, idx, sk)), total[m][r]);
        bias[m][r] += ds_scale(b, idx, sk) * xs_row[m][g];
      }
    }
  }
  for (int m = 0; m < 1 + two; m++)
    for (int r = 0; r < Q8_ROWS; r++)
      y[(m0 + m) * N + n0 + r] = bias[m][r] + vf_sum(total[m][r]);
}
#endif

// M activation rows (decode batches, draft rows) over 4-bit affine codes: the codes stream from
// memory once and each chunk is unpacked once per two rows; the bits of M ds_gemv_a4 calls.
void ds_gemm_a4(const uint8_t* w, const void* s, const void* b, const float* x, float* y,
                long M, long N, long K, long G, int num_threads, int scale_kind) {
  const long half = K / 2, num_groups = K / G;
  float* xe = malloc(sizeof(float) * M * (K + num_groups + 1));
  if (xe == NULL) abort();  // out of memory: stop rather than write through NULL
  float *xo = xe + M * half, *xs = xo + M * half;
  for (long m = 0; m < M; m++) {
    for (long i = 0; i < half; i++) {
      xe[m * half + i] = x[m * K + 2 * i];
      xo[m * half + i] = x[m * K + 2 * i + 1];
    }
    group_sums(x + m * K, xs + m * num_groups, K, G);
  }
  long first_tail = 0;
#if DS_SIMD16
  if (G % 32 == 0) {
    const long num_blocks = N / Q8_ROWS;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (long blk = 0; blk < num_blocks; blk++)
      for (long m0 = 0; m0 < M; m0 += 2)
        block_a4_rows(w, s, b, scale_kind, xe, xo, xs, y, blk * Q8_ROWS, m0, m0 + 1 < M, N, K,
                      G);
    first_tail = num_blocks * Q8_ROWS;
  }
#endif
#pragma omp parallel for num_threads(num_threads) schedule(static) collapse(2)
  for (long m = 0; m < M; m++)
    for (long n = first_tail; n < N; n++)
      y[m * N + n] = row_a4(w + n * half, ds_scale_at(s, n * num_groups, scale_kind),
                            ds_scale_at(b, n * num_groups, scale_kind), scale_kind, xe + m * half,
                            xo + m * half, xs + m * num_groups, K, G);
  free(xe);
}

#if DS_SIMD16
// Q8_ROWS rows share each x load: per 16 weights one masked add of x (the set bits), per group
// one FMA of that partial sum with 2*s into the row's vector, so one horizontal sum per row
// (row_q1 summed every group horizontally: compute-bound at ~10% of the memory roofline).
static void block_q1(const uint8_t* w, const void* s, int sk, const float* x, const float* xs,
                     float* y, long n0, long K, long G) {
  const long bytes = K / 8, num_groups = K / G;
  vf16 total[Q8_ROWS];
  float bias[Q8_ROWS];
  for (int r = 0; r < Q8_ROWS; r++) total[r] = vf_zero(), bias[r] = 0.f;
  const uint8_t* rows = w + n0 * bytes;
  for (long g = 0; g < num_groups; g++) {
    vf16 v[Q8_ROWS];
    for (int r = 0; r < Q8_ROWS; r++) v[r] = vf_zero();
    for (long k = g * G; k < (g + 1) * G; k += 16) {
      const vf16 xv = vf_load(x + k);
      for (int r = 0; r < Q8_ROWS; r++) {
        const uint8_t* p = rows + r * bytes + k / 8;
        ds_prefetch(p + Q8_ROWS * bytes);
        v[r] = vf_mask_add(v[r], (uint16_t)(p[0] | (p[1] << 8)), xv);
      }
    }
    for (int r = 0; r < Q8_ROWS; r++) {
      const float sc = ds_scale(s, (n0 + r) * num_groups + g, sk);
      total[r] = vf_fma(v[r], vf_set1(2.f * sc), total[r]);
      bias[r] += sc * xs[g];
    }
  }
  for (int r = 0; r < Q8_ROWS; r++) y[n0 + r] = vf_sum(total[r]) - bias[r];
}
#endif

void ds_gemv_q1(const uint8_t* w, const void* s, const float* x, float* y, long N, long K, long G,
                int num_threads, int scale_kind) {
  float* xs = malloc(sizeof(float) * (K / G + 1));
  group_sums(x, xs, K, G);
  long first_tail = 0;
#if DS_SIMD16
  if (G % 16 == 0) {
    const long num_blocks = N / Q8_ROWS;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (long blk = 0; blk < num_blocks; blk++)
      block_q1(w, s, scale_kind, x, xs, y, blk * Q8_ROWS, K, G);
    first_tail = num_blocks * Q8_ROWS;
  }
#endif
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (long n = first_tail; n < N; n++)
    y[n] = row_q1(w + n * (K / 8), ds_scale_at(s, n * (K / G), scale_kind), scale_kind, x, xs, K,
                  G);
  free(xs);
}

// Whole-matrix dequantization into a caller's fp32 buffer (prefill): one pass, rows over threads.
// kind: 0 = q8, 1 = a4, 2 = q1; the same formulas as the GEMVs above.
void ds_dequant(int kind, const uint8_t* w, const void* s, const void* b, float* out, long N,
                long K, long G, int num_threads, int scale_kind) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (long n = 0; n < N; n++) {
    float* o = out + n * K;
    for (long g = 0; g < K / G; g++) {  // per group: one scale, an inner loop gcc vectorizes
      float* og = o + g * G;
      const float sc = ds_scale(s, n * (K / G) + g, scale_kind);
      if (kind == 0) {
        const int8_t* r = (const int8_t*)w + n * K + g * G;
        for (long k = 0; k < G; k++) og[k] = (float)r[k] * sc;
      } else if (kind == 1) {
        const uint8_t* r = w + n * (K / 2) + g * G / 2;
        const float bias = ds_scale(b, n * (K / G) + g, scale_kind);
        for (long i = 0; i < G / 2; i++) {
          og[2 * i] = (float)(r[i] & 0xF) * sc + bias;
          og[2 * i + 1] = (float)(r[i] >> 4) * sc + bias;
        }
      } else {
        const uint8_t* r = w + n * (K / 8) + g * G / 8;
        for (long k = 0; k < G; k++) og[k] = ((r[k / 8] >> (k % 8)) & 1) ? sc : -sc;
      }
    }
  }
}
