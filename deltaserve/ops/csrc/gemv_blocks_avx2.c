// GGUF Q4_K, Q5_K, Q6_K and IQ4_XS blocks on int8 activations for CPUs with AVX2 but without
// AVX512-VNNI (most laptops): gemv_blocks_vnni.c's math (x rounded per group of 32 to int8 steps,
// the same codes) with VPMADDUBSW + VPMADDWD in place of VPDPBUSD. The unsigned side is always
// small (Q4_K / Q5_K codes <= 31, Q6_K's <= 63, |IQ4_XS values| <= 127 against |xq| <= 127), so the
// 16-bit pair sums never saturate and every integer dot product equals VPDPBUSD's. One 32-byte
// register holds a 32-weight sub-block (Q4_K, Q5_K, IQ4_XS) or two 16-weight groups (Q6_K): each
// int32 lane sums 4 weights of one group and is scaled by that group's d * scale * dx in fp32.
// The fp32 sums run over 8 lanes (16 in the VNNI kernels), so the two builds differ in the last
// bits; within this build a row's bits never depend on M. Reference: ops/qgemv.blocks_act_ref.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "scales.h"

#if !(defined(__AVX512VNNI__) && defined(__AVX512BW__)) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include "lanes_avx2.h"
#define MAX_ROWS 32

static inline float half_at(const uint8_t* p) { return ds_half_to_float(p[0] | (p[1] << 8)); }

// x [K] -> xq [K] int8, dx [K/32] (each 32's step), dx16 [K/16], xs32 [K/32] = dx * sum(xq) per 32,
// xs16 [K/16] = 32 * sum(xq) per 16: as gemv_blocks_vnni.c's quantize_x32 (d = absmax / 127, x / d
// rounded to nearest even, clamped to +-127; a NaN makes d NaN), element by element the same
static void quantize_x32(const float* x, int8_t* xq, float* dx, float* dx16, float* xs32,
                         float* xs16, long K) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (long g = 0; g < K / 32; g++) {
    __m256 v[4], amax = _mm256_setzero_ps();
    int nan = 0;
    for (int i = 0; i < 4; i++) {
      v[i] = _mm256_loadu_ps(x + 32 * g + 8 * i);
      nan |= _mm256_movemask_ps(_mm256_cmp_ps(v[i], v[i], _CMP_UNORD_Q));
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    const float d = nan ? NAN : _mm_cvtss_f32(m) / 127.f;
    const __m256 dv = _mm256_set1_ps(d);
    const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
    int32_t q32[32];
    for (int i = 0; i < 4; i++) {
      __m256i q = _mm256_setzero_si256();
      if (d > 0.f) q = _mm256_cvtps_epi32(_mm256_div_ps(v[i], dv));
      _mm256_storeu_si256((__m256i*)(q32 + 8 * i), _mm256_min_epi32(_mm256_max_epi32(q, lo), hi));
    }
    int32_t sum[2] = {0, 0};
    for (int i = 0; i < 32; i++) {
      xq[32 * g + i] = (int8_t)q32[i];
      sum[i / 16] += q32[i];
    }
    for (int h = 0; h < 2; h++) {
      dx16[2 * g + h] = d;
      xs16[2 * g + h] = 32.f * (float)sum[h];  // |sum| <= 2032: exact
    }
    dx[g] = d;
    xs32[g] = d * (float)(sum[0] + sum[1]);
  }
}

// the 8 six-bit scales (bytes 0-7) and mins (bytes 8-15) of a Q4_K / Q5_K block (llama.cpp's
// utmp shuffle), built in registers (a 16-byte load of four 4-byte stores stalls on forwarding)
static inline __m128i k4_scales(const uint8_t* s) {
  uint32_t u0, u1, u2;
  memcpy(&u0, s, 4), memcpy(&u1, s + 4, 4), memcpy(&u2, s + 8, 4);
  const uint32_t m1 = 0x3f3f3f3f, m2 = 0x0f0f0f0f, m3 = 0x03030303;
  return _mm_set_epi32((int)(((u2 >> 4) & m2) | (((u1 >> 6) & m3) << 4)), (int)(u1 & m1),
                       (int)((u2 & m2) | (((u0 >> 6) & m3) << 4)), (int)(u0 & m1));
}

typedef struct {
  const int8_t* xq;
  const float *dx, *dx16, *xs32, *xs16;
} Act;

// 8 int32 lanes, each the dot product of 4 consecutive unsigned codes with 4 int8 x
static inline __m256i dot32(__m256i codes, const int8_t* x) {
  const __m256i p = _mm256_maddubs_epi16(codes, _mm256_loadu_si256((const __m256i*)x));
  return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}

// Q4_K (five = 0: d, dmin, scales[12], qs[128]) and Q5_K (five = 1: qh[32] before qs)
static inline __attribute__((always_inline)) float row_k4(const uint8_t* w, long nb, Act a,
                                                          int five) {
  __m256 acc = _mm256_setzero_ps(), mins = _mm256_setzero_ps();  // lane i: sub-block i
  const long size = five ? 176 : 144;
  const __m256i m4 = _mm256_set1_epi8(15), one = _mm256_set1_epi8(1);
  for (long j = 0; j < nb; j++) {
    const uint8_t* b = w + j * size;
    const __m128i bytes = k4_scales(b + 4);
    const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
    const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8)));
    const __m256 step = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(half_at(b)), sc),
                                      _mm256_loadu_ps(a.dx + 8 * j));  // d * sc * dx
    mins = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(half_at(b + 2)), mn),
                           _mm256_loadu_ps(a.xs32 + 8 * j), mins);
    const __m256i qh = five ? _mm256_loadu_si256((const __m256i*)(b + 16)) : _mm256_setzero_si256();
    __m256i dots[8];
    for (int c = 0; c < 4; c++) {  // sub-blocks 2c (low nibbles) and 2c + 1 (high nibbles)
      const __m256i q = _mm256_loadu_si256((const __m256i*)(b + (five ? 48 : 16) + 32 * c));
      __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
      if (five) {
        lo = _mm256_or_si256(lo, _mm256_slli_epi16(
                                     _mm256_and_si256(_mm256_srli_epi16(qh, 2 * c), one), 4));
        hi = _mm256_or_si256(hi, _mm256_slli_epi16(
                                     _mm256_and_si256(_mm256_srli_epi16(qh, 2 * c + 1), one), 4));
      }
      const int8_t* x = a.xq + 256 * j + 64 * c;
      dots[2 * c] = dot32(lo, x);
      dots[2 * c + 1] = dot32(hi, x + 32);
    }
    acc = _mm256_fmadd_ps(block_sums(dots), step, acc);
  }
  return hsum8(acc) - hsum8(mins);
}

static float row_q4_k(const uint8_t* w, long nb, Act a) { return row_k4(w, nb, a, 0); }
static float row_q5_k(const uint8_t* w, long nb, Act a) { return row_k4(w, nb, a, 1); }

// Q6_K: codes u = q + 32 (0..63) of weights 128h + 64t + 0..31 (*a) and + 32..63 (*c)
static inline void q6_codes(const uint8_t* b, int h, int t, __m256i* a, __m256i* c) {
  const __m256i l0 = _mm256_loadu_si256((const __m256i*)(b + 64 * h));
  const __m256i l1 = _mm256_loadu_si256((const __m256i*)(b + 64 * h + 32));
  const __m256i qh = _mm256_loadu_si256((const __m256i*)(b + 128 + 32 * h));
  const __m256i m4 = _mm256_set1_epi8(15), m2 = _mm256_set1_epi8(3);
  const int s = 4 * t;  // low nibbles and qh bits 0-3 for t = 0, high nibbles and 4-7 for t = 1
  *a = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, s), m4),
                       _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, s), m2), 4));
  *c = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, s), m4),
                       _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, s + 2), m2), 4));
}

static float row_q6_k(const uint8_t* w, long nb, Act a) {
  // per half of a block (chunks 0-1, 2-3: groups 0-7, 8-15) lane order G0 G2 G4 G6 G1 G3 G5 G7
  // (quarter_sums of the four 32-weight dots, lanes 0-3 of each one group, 4-7 the next)
  const __m256i order = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
  __m256 acc = _mm256_setzero_ps(), corr = _mm256_setzero_ps();
  for (long j = 0; j < nb; j++) {
    const uint8_t* b = w + j * 210;
    const __m128i sc8 = _mm_loadu_si128((const __m128i*)(b + 192));
    const __m256 d = _mm256_set1_ps(half_at(b + 208));
    // d * sc_g * dx of each 16-weight group (groups 0-7, 8-15), and the -32 offset's share
    const __m256 step0 = _mm256_mul_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc8))),
                                       _mm256_loadu_ps(a.dx16 + 16 * j));
    const __m256 step1 = _mm256_mul_ps(
        _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc8, 8)))),
        _mm256_loadu_ps(a.dx16 + 16 * j + 8));
    corr = _mm256_fmadd_ps(step0, _mm256_loadu_ps(a.xs16 + 16 * j), corr);
    corr = _mm256_fmadd_ps(step1, _mm256_loadu_ps(a.xs16 + 16 * j + 8), corr);
    __m256i dots[8];
    for (int h = 0; h < 2; h++)
      for (int t = 0; t < 2; t++) {
        const int chunk = 2 * h + t;  // weights 64 chunk .. + 63: groups 4 chunk .. + 3
        __m256i ua, uc;
        q6_codes(b, h, t, &ua, &uc);
        const int8_t* x = a.xq + 256 * j + 64 * chunk;
        dots[2 * chunk] = dot32(ua, x);
        dots[2 * chunk + 1] = dot32(uc, x + 32);
      }
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(quarter_sums(dots[0], dots[1], dots[2], dots[3])),
                          _mm256_permutevar8x32_ps(step0, order), acc);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(quarter_sums(dots[4], dots[5], dots[6], dots[7])),
                          _mm256_permutevar8x32_ps(step1, order), acc);
  }
  return hsum8(acc) - hsum8(corr);
}

static const int8_t IQ4_TABLE[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                     1,    13,   25,  38,  53,  69,  89,  113};

// IQ4_XS: codebook values looked up 32 at a time (VPSHUFB); |v| meets x with v's sign
static float row_iq4_xs(const uint8_t* w, long nb, Act a) {
  const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)IQ4_TABLE));
  const __m256i m4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  // sub-block s's 6-bit scale: bits 4s..4s+3 of bytes 4-7, bits 2s, 2s + 1 of bytes 2-3
  const __m256i low_at = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
  const __m256i high_at = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
  __m256 acc = _mm256_setzero_ps();  // lane i: sub-block i
  for (long j = 0; j < nb; j++) {
    const uint8_t* b = w + j * 136;
    uint32_t low;
    memcpy(&low, b + 4, 4);
    const __m256i ls = _mm256_or_si256(
        _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)low), low_at),
                         _mm256_set1_epi32(15)),
        _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(b[2] | (b[3] << 8)),
                                                             high_at),
                                           _mm256_set1_epi32(3)), 4));
    const __m256 step = _mm256_mul_ps(
        _mm256_mul_ps(_mm256_set1_ps(half_at(b)),
                      _mm256_cvtepi32_ps(_mm256_sub_epi32(ls, _mm256_set1_epi32(32)))),
        _mm256_loadu_ps(a.dx + 8 * j));
    __m256i dots[8];
    for (int c = 0; c < 4; c++) {  // sub-blocks 2c, 2c + 1: 16 bytes each, low nibbles first
      const __m256i q = _mm256_loadu_si256((const __m256i*)(b + 8 + 32 * c));
      const __m256i lo = _mm256_and_si256(q, m4);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
      for (int s = 0; s < 2; s++) {
        const __m256i codes = _mm256_permute2x128_si256(lo, hi, s ? 0x31 : 0x20);
        const __m256i v = _mm256_shuffle_epi8(table, codes);
        const __m256i x = _mm256_loadu_si256((const __m256i*)(a.xq + 256 * j + 64 * c + 32 * s));
        const __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(v), _mm256_sign_epi8(x, v));
        dots[2 * c + s] = _mm256_madd_epi16(p, ones);
      }
    }
    acc = _mm256_fmadd_ps(block_sums(dots), step, acc);
  }
  return hsum8(acc);
}

// the symbol the VNNI build exports (ops/qgemv.blocks_vnni: "int8-activation block kernels");
// type: gemv_blocks.c's ids (2: Q4_K, 3: Q5_K, 4: Q6_K, 5: IQ4_XS); 0 if the type has no kernel
int ds_gemm_blocks_vnni(int type, const uint8_t* w, const float* x, float* y, long M, long N,
                        long K, int num_threads) {
  if (type < 2 || type > 5 || K % 256 || M > MAX_ROWS) return 0;
  static const long BYTES[6] = {0, 0, 144, 176, 210, 136};
  const long nb = K / 256, row = nb * BYTES[type];
  const long g32 = K / 32, g16 = K / 16;
  int8_t* xq = malloc(M * K);
  float* f = malloc(M * (2 * g32 + 2 * g16) * sizeof(float));
  if (!xq || !f) {
    free(xq), free(f);
    return 0;
  }
  Act act[MAX_ROWS];
  for (long m = 0; m < M; m++) {
    float* fm = f + m * (2 * g32 + 2 * g16);
    act[m] = (Act){xq + m * K, fm, fm + g32, fm + g32 + g16, fm + 2 * g32 + g16};
    quantize_x32(x + m * K, xq + m * K, fm, fm + g32, fm + g32 + g16, fm + 2 * g32 + g16, K);
  }
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (long n = 0; n < N; n++)
    for (long m = 0; m < M; m++)
      y[m * N + n] = type == 2   ? row_q4_k(w + n * row, nb, act[m])
                     : type == 3 ? row_q5_k(w + n * row, nb, act[m])
                     : type == 4 ? row_q6_k(w + n * row, nb, act[m])
                                 : row_iq4_xs(w + n * row, nb, act[m]);
  free(xq), free(f);
  return 1;
}
#endif
