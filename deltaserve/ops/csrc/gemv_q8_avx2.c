// int8, 4-bit affine and 1-bit codes on int8 activations (Q8_0 x Q8_0 semantics) for CPUs with AVX2 but
// without AVX512-VNNI (most laptops): gemv_vnni.c's int8 math (x rounded per group of G to int8 steps,
// d = absmax / 127, round to nearest even) with VPMADDUBSW on |w| and x carrying w's sign
// (|w| <= 128, |xq| <= 127: the 16-bit pair sums never saturate) and VPMADDWD into int32 lanes.
// Per group: the integer dot to fp32, one FMA by s * dx. The same symbols as the VNNI build
// (ops/qgemv.q8_is_vnni: "the int8-activation int8 GEMV"); the fp32 sums run over 8 lanes, so the
// two builds differ in the last bits. A row's bits never depend on M. Reference:
// ops/qgemv.qgemv_act_ref.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "scales.h"

#if !(defined(__AVX512VNNI__) && defined(__AVX512BW__)) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include "lanes_avx2.h"

void ds_gemv_q8(const int8_t* w, const void* s, const float* x, float* y, long N, long K, long G,
                int num_threads, int scale_kind);
void ds_gemm_q8(const int8_t* w, const void* s, const float* x, float* y, long M, long N, long K,
                long G, int num_threads, int scale_kind);
void ds_gemv_a4(const uint8_t* w, const void* s, const void* b, const float* x, float* y, long N,
                long K, long G, int num_threads, int scale_kind);
void ds_gemv_q1(const uint8_t* w, const void* s, const float* x, float* y, long N, long K, long G,
                int num_threads, int scale_kind);
void ds_gemm_a4(const uint8_t* w, const void* s, const void* b, const float* x, float* y,
                long M, long N, long K, long G, int num_threads, int scale_kind);

// mark this build's int8-activation GEMVs as the AVX2 ones (ops/native.isa_paths)
int ds_int8_act_avx2(void) { return 1; }
int ds_int4_act_avx2(void) { return 1; }
int ds_q1_act_avx2(void) { return 1; }

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

// group g's integer dot of its codes with xq, in 8 int32 lanes
static inline __m256i group_dot_q8(const int8_t* w, const int8_t* xq, long g, long G) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc = _mm256_setzero_si256();
  for (long k = g * G; k < (g + 1) * G; k += 32) {
    const __m256i wv = _mm256_loadu_si256((const __m256i*)(w + k));
    const __m256i xv = _mm256_loadu_si256((const __m256i*)(xq + k));
    const __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(wv), _mm256_sign_epi8(xv, wv));
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, ones));
  }
  return acc;
}

// eight scales (or biases) of kind sk from index at, as fp32
static inline __m256 scales8(const void* s, long at, int sk) {
#if defined(__F16C__)
  if (sk == DS_SCALE_F16)
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)((const uint16_t*)s + at)));
#endif
  if (sk == DS_SCALE_BF16)
    return _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)((const uint16_t*)s + at))), 16));
  if (sk == DS_SCALE_F32) return _mm256_loadu_ps((const float*)s + at);
  float v[8];
  for (int i = 0; i < 8; i++) v[i] = ds_scale(s, at + i, sk);
  return _mm256_loadu_ps(v);
}

// one weight row (scales from index s0 on) against one quantized activation row: per 8 groups
// their dots in one register (block_sums) times s * dx by one FMA; the rest one at a time
static float row_q8(const int8_t* w, const void* s, int sk, long s0, const int8_t* xq,
                    const float* dx, long K, long G) {
  const long ng = K / G;
  __m256 total = _mm256_setzero_ps();
  long g = 0;
  for (; g + 8 <= ng; g += 8) {
    __m256i dots[8];
    for (int j = 0; j < 8; j++) dots[j] = group_dot_q8(w, xq, g + j, G);
    total = _mm256_fmadd_ps(block_sums(dots),
                            _mm256_mul_ps(scales8(s, s0 + g, sk), _mm256_loadu_ps(dx + g)), total);
  }
  float tail = 0.f;
  for (; g < ng; g++)  // lanes exact in fp32 (|sum| <= 128 * 127 * G), so is their sum
    tail += hsum8(_mm256_cvtepi32_ps(group_dot_q8(w, xq, g, G))) * (ds_scale(s, s0 + g, sk) * dx[g]);
  return hsum8(total) + tail;
}

#include "q8_act_driver.h"  // ds_gemm_q8_vnni, ds_gemv_q8_vnni

// ---- 4-bit affine codes on int8 activations: gemv_vnni.c's a4 math ----
// w = s * q + b with q in 0..15: per group y += s * dx * dot(q, xq) + b * dx * sum(xq), the codes
// the unsigned side of VPMADDUBSW as they are (a pair sum <= 2 * 15 * 127). A 32-byte chunk of a
// row is 64 elements, low nibbles the even ones and high the odd: x is split per 64 into its even
// (xe) and odd (xo) halves once per call. Groups as the VNNI kernel takes them (G % 64 == 0).

static int a4_shape_ok(long K, long G) { return G % 64 == 0 && G <= MAX_G && K % G == 0; }

typedef struct {
  int8_t *xe, *xo;  // [K/2] each
  float *dx, *xs;  // [K/G]: the group's step; dx * sum(xq) over the group
} XqA4;

static void quantize_x_a4(const float* x, int8_t* xq, XqA4 q, long K, long G) {
  quantize_x(x, xq, q.dx, K, G);
  for (long i = 0; i < K / 2; i++) {  // chunk i / 32, its elements 2 * (i % 32) and + 1
    q.xe[i] = xq[2 * i];
    q.xo[i] = xq[2 * i + 1];
  }
  for (long g = 0; g < K / G; g++) {
    int32_t sum = 0;  // |sum| <= 127 * G: exact in fp32
    for (long k = g * G; k < (g + 1) * G; k++) sum += xq[k];
    q.xs[g] = q.dx[g] * (float)sum;
  }
}

// group g's integer dot of its codes with xq, in 8 int32 lanes
static inline __m256i group_dot_a4(const uint8_t* w, XqA4 q, long g, long G) {
  const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0x0F);
  __m256i acc = _mm256_setzero_si256();
  for (long i = g * G / 2; i < (g + 1) * G / 2; i += 32) {
    const __m256i v = _mm256_loadu_si256((const __m256i*)(w + i));
    const __m256i even = _mm256_maddubs_epi16(_mm256_and_si256(v, low),
                                              _mm256_loadu_si256((const __m256i*)(q.xe + i)));
    const __m256i odd = _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), low),
                                             _mm256_loadu_si256((const __m256i*)(q.xo + i)));
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_add_epi16(even, odd), ones));
  }
  return acc;
}

// per 8 groups: their dots in one register (block_sums), times s * dx by one FMA, the biases
// times xs by another; the groups past the last 8 one at a time
static float row_a4(const uint8_t* w, const void* s, const void* b, int sk, long s0, XqA4 q,
                    long K, long G) {
  const long ng = K / G;
  __m256 total = _mm256_setzero_ps(), bias = _mm256_setzero_ps();
  long g = 0;
  for (; g + 8 <= ng; g += 8) {
    __m256i dots[8];
    for (int j = 0; j < 8; j++) dots[j] = group_dot_a4(w, q, g + j, G);
    total = _mm256_fmadd_ps(block_sums(dots),
                            _mm256_mul_ps(scales8(s, s0 + g, sk), _mm256_loadu_ps(q.dx + g)),
                            total);
    bias = _mm256_fmadd_ps(scales8(b, s0 + g, sk), _mm256_loadu_ps(q.xs + g), bias);
  }
  float tail = 0.f;
  for (; g < ng; g++)  // lanes exact in fp32 (|sum| <= 15 * 127 * G), so is their sum
    tail += hsum8(_mm256_cvtepi32_ps(group_dot_a4(w, q, g, G))) * (ds_scale(s, s0 + g, sk) * q.dx[g])
            + ds_scale(b, s0 + g, sk) * q.xs[g];
  return hsum8(total) + hsum8(bias) + tail;
}

void ds_gemm_a4_vnni(const uint8_t* w, const void* s, const void* b, const float* x, float* y,
                     long M, long N, long K, long G, int num_threads, int scale_kind) {
  if (!a4_shape_ok(K, G)) {  // the bits of a ds_gemv_a4 per row
    ds_gemm_a4(w, s, b, x, y, M, N, K, G, num_threads, scale_kind);
    return;
  }
  int8_t* xq = malloc(K);
  int8_t* codes = malloc(M * K);
  float* f = malloc(sizeof(float) * M * 2 * (K / G));
  if (xq == NULL || codes == NULL || f == NULL) abort();  // out of memory: stop, not write NULL
  XqA4* rows = malloc(sizeof(XqA4) * M);
  if (rows == NULL) abort();
  for (long m = 0; m < M; m++) {
    rows[m] = (XqA4){codes + m * K, codes + m * K + K / 2, f + m * 2 * (K / G),
                     f + m * 2 * (K / G) + K / G};
    quantize_x_a4(x + m * K, xq, rows[m], K, G);
  }
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (long n = 0; n < N; n++)
    for (long m = 0; m < M; m++)
      y[m * N + n] = row_a4(w + n * (K / 2), s, b, scale_kind, n * (K / G), rows[m], K, G);
  free(xq), free(codes), free(f), free(rows);
}

void ds_gemv_a4_vnni(const uint8_t* w, const void* s, const void* b, const float* x, float* y,
                     long N, long K, long G, int num_threads, int scale_kind) {
  if (!a4_shape_ok(K, G)) {
    ds_gemv_a4(w, s, b, x, y, N, K, G, num_threads, scale_kind);
    return;
  }
  ds_gemm_a4_vnni(w, s, b, x, y, 1, N, K, G, num_threads, scale_kind);
}

// ---- 1-bit codes (q1, GGUF Q1_0) on int8 activations: gemv_vnni.c's q1 math ----
// w = s * (2b - 1), x rounded per 32: per 32 y += s * dx * (2 * sum(xq where b) - sum(xq)). Four
// code bytes become 32 bytes 2 / 0 (broadcast, a bit per lane, compare), VPMADDUBSW against xq;
// per 8 such 32s their sums in one register (chunk_sums16) plus -sum(xq), times dx, times s.

// 32 bits (LSB first) -> 32 bytes: 2 where the bit is set, 0 elsewhere
static inline __m256i bits_to_twos(uint32_t bits) {
  const __m256i pick = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                        2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
  const __m256i b = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), pick), bit);
  return _mm256_and_si256(_mm256_cmpeq_epi8(b, bit), _mm256_set1_epi8(2));
}

// 32 weights' products with xq summed in pairs: 16 int16 lanes (|a lane| <= 2 * 2 * 127, and a
// whole 32's sum <= 8,128: int16 sums of one 32 stay exact)
static inline __m256i pairs_q1_32(const uint8_t* w, const int8_t* xq, long k) {
  uint32_t bits;
  memcpy(&bits, w + k / 8, 4);
  return _mm256_maddubs_epi16(bits_to_twos(bits), _mm256_loadu_si256((const __m256i*)(xq + k)));
}

static inline __m256i dot_q1_32(const uint8_t* w, const int8_t* xq, long k) {
  return _mm256_madd_epi16(pairs_q1_32(w, xq, k), _mm256_set1_epi16(1));
}

// eight 32s' pair sums -> lane i the sum of 32 i's, as fp32: three rounds of 16-bit horizontal
// adds (each 128-bit half keeps one value per 32), then the halves added. Replaces a VPMADDWD
// per 32 and block_sums' 32-bit rounds; the same integers, so the same bits.
static inline __m256 chunk_sums16(const __m256i p[8]) {
  const __m256i a = _mm256_hadd_epi16(_mm256_hadd_epi16(p[0], p[1]), _mm256_hadd_epi16(p[2], p[3]));
  const __m256i b = _mm256_hadd_epi16(_mm256_hadd_epi16(p[4], p[5]), _mm256_hadd_epi16(p[6], p[7]));
  const __m256i h = _mm256_hadd_epi16(a, b);
  return _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(h)),
                                             _mm256_cvtepi16_epi32(_mm256_extracti128_si256(h, 1))));
}

// The scales of 8 chunks from group g0 on, cpg = G / 32 chunks per group (a power of two >= 2,
// the chunks group-aligned): 8 / cpg scales widened, each spread over its chunks' lanes by one
// permute (8 scalar widenings and inserts per 8 chunks took a quarter of the 27B's time)
static inline __m256 chunk_scales(const void* s, long g0, int sk, long cpg) {
  if (cpg >= 8) return _mm256_set1_ps(ds_scale(s, g0, sk));
  const int shift = __builtin_ctzl(cpg);  // (8 / cpg compiled to a 64-bit division)
  float v[8] = {0};
  for (long i = 0; i < 8 >> shift; i++) v[i] = ds_scale(s, g0 + i, sk);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_permutevar8x32_ps(_mm256_loadu_ps(v),
                                  _mm256_srlv_epi32(lane, _mm256_set1_epi32(shift)));
}

// xq [K], dx [K/32], nsum [K/32] = -sum(xq) per 32; group [K/32]: each 32's group in the row
// (a table: a 64-bit division per 32 weights cost more than all their arithmetic)
static float row_q1(const uint8_t* w, const void* s, int sk, long s0, const int8_t* xq,
                    const float* dx, const int32_t* nsum, const int32_t* group, long K, long G) {
  __m256 total = _mm256_setzero_ps();
  long c = 0;  // 32-weight chunk
  for (; c + 8 <= K / 32; c += 8) {
    __m256i pairs[8];
    for (int j = 0; j < 8; j++) pairs[j] = pairs_q1_32(w, xq, 32 * (c + j));
    const __m256 sc = chunk_scales(s, s0 + group[c], sk, G / 32);
    const __m256 per32 = _mm256_add_ps(  // exact: integers below 2^24
        chunk_sums16(pairs), _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i*)(nsum + c))));
    total = _mm256_fmadd_ps(_mm256_mul_ps(per32, _mm256_loadu_ps(dx + c)), sc, total);
  }
  float tail = 0.f;
  for (; c < K / 32; c++) {
    const float dot = hsum8(_mm256_cvtepi32_ps(dot_q1_32(w, xq, 32 * c))) + (float)nsum[c];
    tail += dot * dx[c] * ds_scale(s, s0 + group[c], sk);
  }
  return hsum8(total) + tail;
}

void ds_gemm_q1_avx2(const uint8_t* w, const void* s, const float* x, float* y, long M, long N,
                     long K, long G, int num_threads, int scale_kind) {
  int8_t* xq = malloc(M * K);
  float* dx = malloc(sizeof(float) * M * (K / 32));
  int32_t* nsum = malloc(sizeof(int32_t) * M * (K / 32));
  int32_t* group = malloc(sizeof(int32_t) * (K / 32));
  if (xq == NULL || dx == NULL || nsum == NULL || group == NULL) abort();  // out of memory
  for (long c = 0; c < K / 32; c++) group[c] = (int32_t)(32 * c / G);
  for (long m = 0; m < M; m++) {
    quantize_x(x + m * K, xq + m * K, dx + m * (K / 32), K, 32);
    for (long c = 0; c < K / 32; c++) {
      int32_t sum = 0;
      for (int i = 0; i < 32; i++) sum += xq[m * K + 32 * c + i];
      nsum[m * (K / 32) + c] = -sum;
    }
  }
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (long n = 0; n < N; n++)
    for (long m = 0; m < M; m++)
      y[m * N + n] = row_q1(w + n * (K / 8), s, scale_kind, n * (K / G), xq + m * K,
                            dx + m * (K / 32), nsum + m * (K / 32), group, K, G);
  free(xq), free(dx), free(nsum), free(group);
}

void ds_gemv_q1_vnni(const uint8_t* w, const void* s, const float* x, float* y, long N, long K,
                     long G, int num_threads, int scale_kind) {
  if (G % 64 || K % G) {  // gemv_vnni.c's rule
    ds_gemv_q1(w, s, x, y, N, K, G, num_threads, scale_kind);
    return;
  }
  ds_gemm_q1_avx2(w, s, x, y, 1, N, K, G, num_threads, scale_kind);
}
#endif
