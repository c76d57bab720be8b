// Decode GEMVs on int8 activations (AVX512-VNNI), split from gemv_quant.c (the fp32-activation
// kernels): int8 codes (Q8_0 x Q8_0 semantics), 1-bit codes (Q1_0 x Q8_0) and 4-bit affine codes
// (Q4_1 x Q8_1). All compute W x^ for x^, x rounded per group to int8 steps. ops/qgemv.py holds
// the reference (qgemv_act_ref) and picks between these and the fp32 kernels per shape.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "scales.h"
#include "simd.h"

#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

void ds_gemv_q8(const int8_t* w, const void* s, const float* x, float* y, long N, long K, long G,
                int num_threads, int scale_kind);
void ds_gemm_q8(const int8_t* w, const void* s, const float* x, float* y, long M, long N, long K,
                long G, int num_threads, int scale_kind);
void ds_gemv_q1(const uint8_t* w, const void* s, const float* x, float* y, long N, long K, long G,
                int num_threads, int scale_kind);
void ds_gemv_a4(const uint8_t* w, const void* s, const void* b, const float* x, float* y, long N,
                long K, long G, int num_threads, int scale_kind);
void ds_gemm_a4(const uint8_t* w, const void* s, const void* b, const float* x, float* y,
                long M, long N, long K, long G, int num_threads, int scale_kind);

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// int8 x int8 (llama.cpp Q8_0 x Q8_0): x is quantized per group of G (symmetric, d = absmax/127,
// round to nearest even), then each 64-byte chunk is one VPDPBUSD. DPBUSD wants u8 x s8: the
// weights go in as w ^ 0x80 = w + 128, and -128 * sum(xq over the group) in lane 0 of the group's
// int32 accumulator takes the 128 back out. ops/qgemv.py (qgemv_act_ref) holds the reference.
#define VNNI_ROWS 4
// Weight rows per block of the int8 and 4-bit GEMVs: VNNI_ROWS share each xq load, or 1, each row
// streamed alone with the next row's codes prefetched (q1 always takes VNNI_ROWS). Which streams
// faster depends on the machine (a 2-core AMD EPYC: the Q8_0 vocabulary head 18 GB/s with 4,
// 38 GB/s with 1); ops/gemv_rows.py measures both once.
// A row's arithmetic is the same either way: the choice never changes a bit of y.
static int vnni_rows = VNNI_ROWS;
void ds_set_vnni_rows(int rows) { vnni_rows = rows == 1 ? 1 : VNNI_ROWS; }
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

// num (<= 16) scales or biases from element i on, as fp32 lanes (the rest zero).
static inline __m512 load_scales16(const void* s, long i, int num, int kind) {
  const __mmask16 m = (__mmask16)((1u << num) - 1);
  if (kind == DS_SCALE_F32) return _mm512_maskz_loadu_ps(m, (const float*)s + i);
  const __m256i h = _mm256_maskz_loadu_epi16(m, (const uint16_t*)s + i);
  if (kind == DS_SCALE_F16) return _mm512_cvtph_ps(h);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// ---- activations rounded per 32 (llama.cpp's Q8_0 blocks): for Q8_0 and Q1_0 weights ----
// A 64-element chunk is one VPDPBUSD whose lanes 0-7 hold its first 32 elements and 8-15 the
// next 32. Per chunk: `init`, the int32 lanes the dot starts from: mult * -sum(xq) of each 32 in
// lanes 0 and 8 (the kernel's correction: Q1_0 takes 1, Q8_0's flipped codes 128); `fx`, each
// lane's dx; dx, per 32.
typedef struct {
  int8_t* xq;  // [K]
  __m512i* init;  // [K / 64]
  __m512* fx;  // [K / 64]
  float* dx;  // [K / 32]
} Xq32;

static Xq32 quantize_x_32(const float* x, long K, int mult) {
  Xq32 q;
  q.xq = aligned_alloc(64, K + K / 64 * 128 + K / 32 * 8);
  if (q.xq == NULL) abort();  // out of memory: stop rather than write through NULL
  q.init = (__m512i*)(q.xq + K);
  q.fx = (__m512*)(q.init + K / 64);
  q.dx = (float*)(q.fx + K / 64);
  int32_t* corr = (int32_t*)(q.dx + K / 32);  // -128 * sum(xq) per 32
  quantize_x_q8(x, q.xq, q.dx, corr, K, 32);
  for (long c = 0; c < K / 64; c++) {
    const int32_t a = corr[2 * c] / 128 * mult, b = corr[2 * c + 1] / 128 * mult;
    q.init[c] = _mm512_mask_set1_epi32(_mm512_maskz_set1_epi32(0x0001, a), 0x0100, b);
    q.fx[c] = _mm512_mask_mov_ps(_mm512_set1_ps(q.dx[2 * c]), 0xFF00,
                                 _mm512_set1_ps(q.dx[2 * c + 1]));
  }
  return q;
}

// int8 codes in groups of 32 (GGUF Q8_0 x Q8_0): a chunk holds two groups. Per 16 groups f = s *
// dx as a vector; per chunk one VPDPBUSD of the flipped codes (w ^ 0x80) from init (-128 * sum),
// to fp32 (|lane| <= 4 * 255 * 127 + 128 * 32 * 127: exact), one FMA with f's two groups spread
// over the halves.
static inline __attribute__((always_inline)) void block_vnni32(
    const int8_t* w, const void* s, int sk, const Xq32* q, float* y, long n0, long K,
    const int R) {
  const __m512i flip = _mm512_set1_epi8((char)0x80);
  const long num_groups = K / 32;
  const int8_t* rows = w + n0 * K;
  __m512 total[VNNI_ROWS];
  for (int r = 0; r < R; r++) total[r] = _mm512_setzero_ps();
  for (long g0 = 0; g0 < num_groups; g0 += 16) {
    const int ng = num_groups - g0 < 16 ? (int)(num_groups - g0) : 16;  // even: K % 64 == 0
    const __m512 dx = load_scales16(q->dx, g0, ng, DS_SCALE_F32);
    __m512 f[VNNI_ROWS];
    for (int r = 0; r < R; r++)
      f[r] = _mm512_mul_ps(load_scales16(s, (n0 + r) * num_groups + g0, ng, sk), dx);
    for (int c = 0; c < ng / 2; c++) {
      const long k = (g0 + 2 * c) * 32;
      const __m512i xv = _mm512_loadu_si512(q->xq + k), init = q->init[k / 64];
      const __m512i lanes = _mm512_mask_set1_epi32(_mm512_set1_epi32(2 * c), 0xFF00, 2 * c + 1);
      for (int r = 0; r < R; r++) {
        const int8_t* p = rows + r * K + k;
        ds_prefetch(p + R * K);
        const __m512i u = _mm512_xor_si512(_mm512_loadu_si512(p), flip);
        total[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(init, u, xv)),
                                   _mm512_permutexvar_ps(lanes, f[r]), total[r]);
      }
    }
  }
  for (int r = 0; r < R; r++) y[n0 + r] = _mm512_reduce_add_ps(total[r]);
}

// R rows share each xq load; the next block's codes are prefetched (as block_q8). Per group: the
// int32 dot goes to fp32 (exact: |lane| < 2^24) and is FMAed with s[n,g] * dx[g].
static inline __attribute__((always_inline)) void block_vnni(
    const int8_t* w, const void* s, int sk, const int8_t* xq, const float* dx, const int32_t* corr,
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
        ds_prefetch(p + R * K);
        __m512i u = _mm512_xor_si512(_mm512_loadu_si512(p), flip);
        acc[r] = _mm512_dpbusd_epi32(acc[r], u, xv);
      }
    }
    for (int r = 0; r < R; r++) {
      const float f = ds_scale(s, (n0 + r) * num_groups + g, sk) * dx[g];
      total[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r]), _mm512_set1_ps(f), total[r]);
    }
  }
  for (int r = 0; r < R; r++) y[n0 + r] = _mm512_reduce_add_ps(total[r]);
}

static int q8_vnni_shape_ok(long K, long G) {  // groups of 32 (Q8_0) take block_vnni32
  return (G == 32 && K % 64 == 0) || (G % 64 == 0 && G <= VNNI_MAX_G && K % G == 0);
}

// One activation row quantized for the int8 kernels: per 32 (Xq32, groups of 32) or per group
// (xq [K], then dx and corr [K/G]: 8 bytes per group, after whole lines since K % 64 == 0).
typedef struct {
  Xq32 q32;
  int8_t* xq;
  const float* dx;
  const int32_t* corr;
} XqQ8;

static XqQ8 quantize_q8(const float* x, long K, long G) {
  XqQ8 q = {0};
  if (G == 32) {
    q.q32 = quantize_x_32(x, K, 128);
    q.xq = q.q32.xq;
    return q;
  }
  q.xq = aligned_alloc(64, K + (K / G * 8 + 63) / 64 * 64);
  if (q.xq == NULL) abort();  // out of memory: stop rather than write through NULL
  float* dx = (float*)(q.xq + K);
  int32_t* corr = (int32_t*)(dx + K / G);
  quantize_x_q8(x, q.xq, dx, corr, K, G);
  q.dx = dx, q.corr = corr;
  return q;
}

// weight rows [n0, n0 + rows) against one activation row: a block of VNNI_ROWS, or row by row
static inline void q8_rows(const int8_t* w, const void* s, int sk, const XqQ8* q, float* y,
                           long n0, long rows, long K, long G) {
  if (rows == VNNI_ROWS) {
    if (G == 32) block_vnni32(w, s, sk, &q->q32, y, n0, K, VNNI_ROWS);
    else block_vnni(w, s, sk, q->xq, q->dx, q->corr, y, n0, K, G, VNNI_ROWS);
    return;
  }
  for (long r = 0; r < rows; r++) {
    if (G == 32) block_vnni32(w, s, sk, &q->q32, y, n0 + r, K, 1);
    else block_vnni(w, s, sk, q->xq, q->dx, q->corr, y, n0 + r, K, G, 1);
  }
}

void ds_gemm_q8_vnni(const int8_t* w, const void* s, const float* x, float* y, long M, long N,
                     long K, long G, int num_threads, int scale_kind);

void ds_gemv_q8_vnni(const int8_t* w, const void* s, const float* x, float* y, long N, long K,
                     long G, int num_threads, int scale_kind) {
  if (!q8_vnni_shape_ok(K, G)) {
    ds_gemv_q8(w, s, x, y, N, K, G, num_threads, scale_kind);
    return;
  }
  ds_gemm_q8_vnni(w, s, x, y, 1, N, K, G, num_threads, scale_kind);
}

// M activation rows (a decode batch, draft rows): each block of weight rows meets every row's
// quantized x while it sits in L1, so the codes stream from memory once, not M times. Per (row,
// output) the arithmetic is block_vnni's (block_vnni32's) in its order: one GEMV is M = 1.
void ds_gemm_q8_vnni(const int8_t* w, const void* s, const float* x, float* y, long M, long N,
                     long K, long G, int num_threads, int scale_kind) {
  if (!q8_vnni_shape_ok(K, G)) {
    // the bits of a ds_gemv_q8 per row
    ds_gemm_q8(w, s, x, y, M, N, K, G, num_threads, scale_kind);
    return;
  }
  XqQ8* q = malloc(sizeof(XqQ8) * M);
  if (q == NULL) abort();
  for (long m = 0; m < M; m++) q[m] = quantize_q8(x + m * K, K, G);
  const int R = vnni_rows;
  const long num_blocks = N / R;
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (long b = 0; b <= num_blocks; b++) {  // the last block: the (at most 3) rows left
    const long n0 = b * R, rows = b < num_blocks ? R : N - n0;
    for (long m = 0; m < M; m++) q8_rows(w, s, scale_kind, &q[m], y + m * N, n0, rows, K, G);
  }
  for (long m = 0; m < M; m++) free(q[m].xq);
  free(q);
}

// ---- 1-bit codes (q1, GGUF Q1_0) on int8 activations ----
// w = s * (2b - 1); x is rounded per 32 (Xq32), so per 32 y += s * dx * (2 * sum(xq where b) -
// sum(xq)). 64 bits of a row are one mask: the bytes 2 where a bit is set, 0 elsewhere (one masked
// move), times xq in one VPDPBUSD; init (-sum(xq) in lanes 0 and 8) and fx finish it. |lane| <=
// 2 * 4 * 127 + 32 * 127: exact in int32 and fp32.
static inline __attribute__((always_inline)) void block_q1_vnni(
    const uint8_t* w, const void* s, int sk, const Xq32* q, float* y, long n0, long K, long G,
    const int R) {
  const __m512i two = _mm512_set1_epi8(2);
  const long num_groups = K / G, bytes = K / 8;
  const uint8_t* rows = w + n0 * bytes;
  __m512 total[VNNI_ROWS];
  for (int r = 0; r < R; r++) total[r] = _mm512_setzero_ps();
  for (long g = 0; g < num_groups; g++) {
    __m512 part[VNNI_ROWS];
    for (int r = 0; r < R; r++) part[r] = _mm512_setzero_ps();
    for (long k = g * G; k < (g + 1) * G; k += 64) {
      const __m512i xv = _mm512_loadu_si512(q->xq + k), c = q->init[k / 64];
      const __m512 fx = q->fx[k / 64];
      for (int r = 0; r < R; r++) {
        const uint8_t* p = rows + r * bytes + k / 8;
        ds_prefetch(p + R * bytes);
        uint64_t bits;
        memcpy(&bits, p, 8);
        const __m512i u = _mm512_maskz_mov_epi8(_cvtu64_mask64(bits), two);
        part[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(c, u, xv)), fx, part[r]);
      }
    }
    for (int r = 0; r < R; r++) {
      const float sc = ds_scale(s, (n0 + r) * num_groups + g, sk);
      total[r] = _mm512_fmadd_ps(part[r], _mm512_set1_ps(sc), total[r]);
    }
  }
  for (int r = 0; r < R; r++) y[n0 + r] = _mm512_reduce_add_ps(total[r]);
}

void ds_gemv_q1_vnni(const uint8_t* w, const void* s, const float* x, float* y, long N, long K,
                     long G, int num_threads, int scale_kind) {
  if (G % 64 || K % G) {
    ds_gemv_q1(w, s, x, y, N, K, G, num_threads, scale_kind);
    return;
  }
  Xq32 q = quantize_x_32(x, K, 1);
  // always VNNI_ROWS (not vnni_rows): 8 code bytes per 64 weights, so sharing x wins (4 rows
  // 12.4 GB/s, 1 row 8.8 on the AMD EPYC where int8 prefers 1)
  const long num_blocks = N / VNNI_ROWS;
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (long b = 0; b < num_blocks; b++)
    block_q1_vnni(w, s, scale_kind, &q, y, b * VNNI_ROWS, K, G, VNNI_ROWS);
  for (long n = num_blocks * VNNI_ROWS; n < N; n++)
    block_q1_vnni(w, s, scale_kind, &q, y, n, K, G, 1);
  free(q.xq);
}

// ---- 4-bit affine codes on int8 activations ----
// w = s * q + b with q in 0..15, so per group y += s * dx * dot(q, xq) + b * dx * sum(xq). The
// codes go into VPDPBUSD as its unsigned operand as they are (no flip, no correction). The bias
// term takes the rounded x too: then the error is w . (x - x^), and w is centred where s * q is
// not (exact sums of x for the bias measured 2.3% rel-L2 against the spec, not 0.6%). A 64-byte
// chunk of a row is 128 elements: its low nibbles are the even elements, its high ones the odd, so
// x is quantized, then split per chunk into even (xqe) and odd (xqo) halves, and one chunk is two
// VPDPBUSDs whose lanes 0-7 hold the chunk's first 64 elements and lanes 8-15 the next 64. A row
// of K = 64 (mod 128) ends in a half chunk: 32 bytes, loaded masked (lanes 8-15 zero), so every
// shape the int8 kernel takes (G a multiple of 64 dividing K) takes this one too: a tensor-parallel
// shard of a row gets the same per-group integers as the whole row.
#define A4_BLOCK_GROUPS 16  // groups whose scale * dx sit in one vector

typedef struct {
  int8_t *xqe, *xqo;  // [K/2] each: per 128-element chunk, its even / odd elements
  float *dx, *xs;  // [K/G]: the group's quantization step; dx * sum(xq) over the group
  void* mem;
} XqA4;

static void quantize_x_a4(const float* x, XqA4* q, long K, long G) {
  int8_t* xq = aligned_alloc(64, K + (K / G * 8 + 63) / 64 * 64);
  if (xq == NULL) abort();  // out of memory: stop rather than write through NULL
  float* dx = (float*)(xq + K);
  int32_t* corr = (int32_t*)(dx + K / G);  // -128 * sum(xq) per group
  quantize_x_q8(x, xq, dx, corr, K, G);
  for (long i = 0; i < K / 2; i++) {  // chunk i / 64, its element 2 * (i % 64) (+1)
    const long e = i / 64 * 128 + 2 * (i % 64);
    q->xqe[i] = xq[e];
    q->xqo[i] = xq[e + 1];
  }
  for (long g = 0; g < K / G; g++) {
    q->dx[g] = dx[g];
    q->xs[g] = dx[g] * (float)(corr[g] / -128);  // |sum| <= 127 * G: exact in fp32
  }
  free(xq);
}

static XqA4 xq_a4_alloc(long M, long K, long G) {
  XqA4 q;
  const long per_row = K + 8 * (K / G);
  q.mem = aligned_alloc(64, (M * per_row + 63) / 64 * 64);
  if (q.mem == NULL) abort();  // out of memory: stop rather than write through NULL
  q.xqe = q.mem;
  q.xqo = q.xqe + M * (K / 2);
  q.dx = (float*)(q.xqo + M * (K / 2));
  q.xs = q.dx + M * (K / G);
  return q;
}

static XqA4 xq_a4_row(const XqA4* q, long m, long K, long G) {
  return (XqA4){q->xqe + m * (K / 2), q->xqo + m * (K / 2), q->dx + m * (K / G),
                q->xs + m * (K / G), NULL};
}


// R rows share each chunk's xq loads. Per block of 16 groups: f = s * dx and b * xs as vectors;
// per chunk: two VPDPBUSDs, the int32 lanes (|lane| <= 2 * 4 * 15 * 127) to fp32 exactly, one FMA
// with f's two groups spread over the halves (lane_group[c]: which of f's lanes each lane takes).
static inline __attribute__((always_inline)) void block_a4_vnni(
    const uint8_t* w, const void* s, const void* b, int sk, const XqA4* q,
    const __m512i* lane_group, float* y, long n0, long K, long G, const int R) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  const long bytes = K / 2, num_groups = K / G;
  const uint8_t* rows = w + n0 * bytes;
  __m512 total[VNNI_ROWS], bias[VNNI_ROWS];
  for (int r = 0; r < R; r++) total[r] = bias[r] = _mm512_setzero_ps();
  for (long g0 = 0; g0 < num_groups; g0 += A4_BLOCK_GROUPS) {
    const int ng = num_groups - g0 < A4_BLOCK_GROUPS ? (int)(num_groups - g0) : A4_BLOCK_GROUPS;
    const __m512 dx = load_scales16(q->dx, g0, ng, DS_SCALE_F32);
    const __m512 xs = load_scales16(q->xs, g0, ng, DS_SCALE_F32);
    __m512 f[VNNI_ROWS];
    for (int r = 0; r < R; r++) {
      const long at = (n0 + r) * num_groups + g0;
      f[r] = _mm512_mul_ps(load_scales16(s, at, ng, sk), dx);
      bias[r] = _mm512_fmadd_ps(load_scales16(b, at, ng, sk), xs, bias[r]);
    }
    const long first = g0 * G / 2, num_chunks = (ng * G + 127) / 128;
    for (long c = 0; c < num_chunks; c++) {
      const long i = first + c * 64;
      // the row's last chunk may be half (32 bytes): bytes past it load as zero codes and x
      const __mmask64 m = i + 64 <= bytes ? ~(__mmask64)0 : (__mmask64)0xFFFFFFFFu;
      const __m512i xe = _mm512_maskz_loadu_epi8(m, q->xqe + i);
      const __m512i xo = _mm512_maskz_loadu_epi8(m, q->xqo + i);
      for (int r = 0; r < R; r++) {
        const uint8_t* p = rows + r * bytes + i;
        ds_prefetch(p + R * bytes);
        const __m512i v = _mm512_maskz_loadu_epi8(m, p);
        __m512i acc = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_and_si512(v, low), xe);
        acc = _mm512_dpbusd_epi32(acc, _mm512_and_si512(_mm512_srli_epi16(v, 4), low), xo);
        total[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc),
                                   _mm512_permutexvar_ps(lane_group[c], f[r]), total[r]);
      }
    }
  }
  for (int r = 0; r < R; r++)
    y[n0 + r] = _mm512_reduce_add_ps(total[r]) + _mm512_reduce_add_ps(bias[r]);
}

// lane_group[c] for chunk c of a block: lanes 0-7 its first 64 elements' group, 8-15 the next's
// (in a half chunk lanes 8-15 are zero, and the lane of f they name is finite: s * dx of a group,
// or a zero lane past the block's last group).
static __m512i* a4_lane_groups(long G) {
  const long num = (A4_BLOCK_GROUPS * G + 127) / 128;
  __m512i* out = aligned_alloc(64, sizeof(__m512i) * num);
  if (out == NULL) abort();
  for (long c = 0; c < num; c++)
    out[c] = _mm512_mask_set1_epi32(_mm512_set1_epi32((int)(c * 128 / G)), 0xFF00,
                                    (int)((c * 128 + 64) / G));
  return out;
}

static int a4_vnni_shape_ok(long K, long G) {  // the int8 kernel's rule
  return G % 64 == 0 && G <= VNNI_MAX_G && K % G == 0;
}

void ds_gemm_a4_vnni(const uint8_t* w, const void* s, const void* b, const float* x, float* y,
                     long M, long N, long K, long G, int num_threads, int scale_kind);

void ds_gemv_a4_vnni(const uint8_t* w, const void* s, const void* b, const float* x, float* y,
                     long N, long K, long G, int num_threads, int scale_kind) {
  if (!a4_vnni_shape_ok(K, G)) {
    ds_gemv_a4(w, s, b, x, y, N, K, G, num_threads, scale_kind);
    return;
  }
  ds_gemm_a4_vnni(w, s, b, x, y, 1, N, K, G, num_threads, scale_kind);
}

// M activation rows: each block of weight rows meets every row's quantized x while it sits in L1;
// per (row, output) block_a4_vnni's arithmetic in its order: one GEMV is M = 1.
void ds_gemm_a4_vnni(const uint8_t* w, const void* s, const void* b, const float* x, float* y,
                     long M, long N, long K, long G, int num_threads, int scale_kind) {
  if (!a4_vnni_shape_ok(K, G)) {
    ds_gemm_a4(w, s, b, x, y, M, N, K, G, num_threads, scale_kind);
    return;
  }
  XqA4 all = xq_a4_alloc(M, K, G);
  for (long m = 0; m < M; m++) {
    XqA4 row = xq_a4_row(&all, m, K, G);
    quantize_x_a4(x + m * K, &row, K, G);
  }
  __m512i* lanes = a4_lane_groups(G);
  const int R = vnni_rows;
  const long num_blocks = N / R;
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (long blk = 0; blk <= num_blocks; blk++) {
    const long n0 = blk * R, rows = blk < num_blocks ? R : N - n0;
    for (long m = 0; m < M; m++) {
      const XqA4 row = xq_a4_row(&all, m, K, G);
      if (rows == VNNI_ROWS) {
        block_a4_vnni(w, s, b, scale_kind, &row, lanes, y + m * N, n0, K, G, VNNI_ROWS);
      } else {  // the last (at most 3) weight rows, one at a time
        for (long r = 0; r < rows; r++)
          block_a4_vnni(w, s, b, scale_kind, &row, lanes, y + m * N, n0 + r, K, G, 1);
      }
    }
  }
  free(lanes);
  free(all.mem);
}
#endif
