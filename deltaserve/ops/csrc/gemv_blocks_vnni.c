// GGUF Q4_K, Q5_K, Q6_K and IQ4_XS blocks on int8 activations (AVX512-VNNI), llama.cpp's Q4_K x Q8_K and
// Q6_K x Q8_K semantics on our Q8_0 activation rule: x is rounded per group of 32 to int8 steps
// (quantize as gemv_vnni.c: d = absmax / 127, round to nearest even), and the codes, unsigned,
// meet the int8 x in VPDPBUSD. Per block of 256 weights:
//   Q4_K, Q5_K  sum_s d sc_s dx_s dot(q_s, xq_s) - dmin m_s dx_s sum(xq_s) (8 groups of 32)
//   Q6_K  sum_g d sc_g dx_g (dot(u_g, xq_g) - 32 sum(xq_g))               (16 groups of 16)
//   IQ4_XS sum_s d (ls_s - 32) dx_s dot(v_s, xq_s), v the codebook values  (8 groups of 32)
// A 64-byte VPDPBUSD covers 64 weights: its 16 int32 lanes are scaled per lane (each lane's group
// scale, permuted into place) and summed in fp32. Rows are independent: each row's bits are the
// same whatever M is. Reference: ops/qgemv.blocks_act_ref (tests/ops/test_blocks.py).
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "scales.h"
#include "simd.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define MAX_ROWS 32

static inline float half_at(const uint8_t* p) { return ds_half_to_float(p[0] | (p[1] << 8)); }

// x [K] -> the row's Act arrays (x rounded per 32 as gemv_vnni.c's quantize_x_q8)
static void quantize_x32(const float* x, int8_t* xq, float* dx, float* dx16, float* xs32,
                         float* xs16, long K) {
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  for (long g = 0; g < K / 32; g++) {
    const __m512 a = _mm512_loadu_ps(x + 32 * g), b = _mm512_loadu_ps(x + 32 * g + 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q) |
                          _mm512_cmp_ps_mask(b, b, _CMP_UNORD_Q);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    const float d = nan ? NAN : amax / 127.f;
    const __m512 dv = _mm512_set1_ps(d);
    int32_t sum[2];
    for (int h = 0; h < 2; h++) {
      __m512i q = _mm512_setzero_si512();
      if (d > 0.f) q = _mm512_cvtps_epi32(_mm512_div_ps(h ? b : a, dv));
      q = _mm512_min_epi32(_mm512_max_epi32(q, lo), hi);
      sum[h] = _mm512_reduce_add_epi32(q);
      _mm_storeu_si128((__m128i*)(xq + 32 * g + 16 * h), _mm512_cvtepi32_epi8(q));
      dx16[2 * g + h] = d;
      xs16[2 * g + h] = 32.f * (float)sum[h];  // |sum| <= 2032: exact
    }
    dx[g] = d;
    xs32[g] = d * (float)(sum[0] + sum[1]);
  }
}

// the 8 six-bit scales (bytes 0-7) and mins (bytes 8-15) of a Q4_K / Q5_K block (llama.cpp's
// utmp shuffle)
static inline void k4_scales(const uint8_t* s, uint8_t out[16]) {
  uint32_t u[4];
  memcpy(u, s, 12);
  const uint32_t m1 = 0x3f3f3f3f, m2 = 0x0f0f0f0f, m3 = 0x03030303;
  u[3] = ((u[2] >> 4) & m2) | (((u[1] >> 6) & m3) << 4);
  const uint32_t mins_lo = u[1] & m1;
  u[1] = (u[2] & m2) | (((u[0] >> 6) & m3) << 4);
  u[2] = mins_lo;
  u[0] &= m1;
  memcpy(out, u, 16);
}

// 32 bytes of nibbles -> 64 u8 codes: low nibbles (weights 0-31) then high (32-63)
static inline __m512i nibbles64(const uint8_t* p) {
  const __m256i q = _mm256_loadu_si256((const __m256i*)p), m = _mm256_set1_epi8(15);
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(q, m)),
                            _mm256_and_si256(_mm256_srli_epi16(q, 4), m), 1);
}

// per row: xq int8 [K], dx [K/32] (the step of each 32), dx16 [K/16] (the step of each 16),
// xs32 [K/32] = dx * sum(xq) per 32, xs16 [K/16] = 32 * sum(xq) per 16 (Q6_K's offset)
typedef struct {
  const int8_t* xq;
  const float *dx, *dx16, *xs32, *xs16;
} Act;

// Q5_K's fifth bits of the 64 weights of chunk c: bit 2c (weights 0-31), 2c + 1 (32-63) of qh
static inline __m512i fifth_bits(const uint8_t* qh, int c) {
  const __m256i h = _mm256_loadu_si256((const __m256i*)qh), one = _mm256_set1_epi8(1);
  const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(h, 2 * c), one);
  const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(h, 2 * c + 1), one);
  return _mm512_slli_epi16(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1), 4);
}

// Q4_K (five = 0: d, dmin, scales[12], qs[128]) and Q5_K (five = 1: qh[32] before qs)
static inline __attribute__((always_inline)) float row_k4(const uint8_t* w, long nb, Act a,
                                                          int five) {
  __m512 acc = _mm512_setzero_ps();
  __m256 mins = _mm256_setzero_ps();
  const long bytes = five ? 176 : 144;
  for (long j = 0; j < nb; j++) {
    const uint8_t* b = w + j * bytes;
    uint8_t sm[16];
    k4_scales(b + 4, sm);
    const __m128i bytes = _mm_loadu_si128((const __m128i*)sm);
    const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
    const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8)));
    // each sub-block's d * sc * dx, as the lanes of one register
    const __m512 step = _mm512_castps256_ps512(_mm256_mul_ps(
        _mm256_mul_ps(_mm256_set1_ps(half_at(b)), sc), _mm256_loadu_ps(a.dx + 8 * j)));
    mins = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(half_at(b + 2)), mn),
                           _mm256_loadu_ps(a.xs32 + 8 * j), mins);
    for (int c = 0; c < 4; c++) {
      __m512i codes = nibbles64(b + (five ? 48 : 16) + 32 * c);
      if (five) codes = _mm512_or_si512(codes, fifth_bits(b + 16, c));
      const __m512i dot = _mm512_dpbusd_epi32(
          _mm512_setzero_si512(), codes,
          _mm512_loadu_si512((const void*)(a.xq + 256 * j + 64 * c)));
      // lanes 0-7: sub-block 2c, 8-15: 2c + 1
      const __m512i pick = _mm512_add_epi32(_mm512_set1_epi32(2 * c), _mm512_setr_epi32(
          0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1));
      acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(pick, step), acc);
    }
  }
  const __m128 m4 = _mm_add_ps(_mm256_castps256_ps128(mins), _mm256_extractf128_ps(mins, 1));
  const __m128 m2 = _mm_add_ps(m4, _mm_movehl_ps(m4, m4));
  return _mm512_reduce_add_ps(acc) - _mm_cvtss_f32(_mm_add_ss(m2, _mm_movehdup_ps(m2)));
}

static float row_q4_k(const uint8_t* w, long nb, Act a) { return row_k4(w, nb, a, 0); }
static float row_q5_k(const uint8_t* w, long nb, Act a) { return row_k4(w, nb, a, 1); }

// Q6_K codes u = q + 32 (0..63) of weights 128h + 64t + 0..63 (t = 0, 1) of a block
static inline __m512i q6_codes(const uint8_t* b, int h, int t) {
  const __m256i l0 = _mm256_loadu_si256((const __m256i*)(b + 64 * h));
  const __m256i l1 = _mm256_loadu_si256((const __m256i*)(b + 64 * h + 32));
  const __m256i qh = _mm256_loadu_si256((const __m256i*)(b + 128 + 32 * h));
  const __m256i m4 = _mm256_set1_epi8(15), m2 = _mm256_set1_epi8(3);
  __m256i a, c;  // weights 64t + 0..31 and 64t + 32..63
  if (t == 0) {
    a = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(qh, m2), 4));
    c = _mm256_or_si256(_mm256_and_si256(l1, m4),
                        _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2), m2), 4));
  } else {
    a = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                        _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 4), m2), 4));
    c = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                        _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 6), m2), 4));
  }
  return _mm512_inserti64x4(_mm512_castsi256_si512(a), c, 1);
}

static float row_q6_k(const uint8_t* w, long nb, Act a) {
  // lane l of a 64-weight chunk covers weights 4l..4l+3: group l / 4 of the chunk's four
  const __m512i lane_group = _mm512_srli_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), 2);
  __m512 acc = _mm512_setzero_ps(), corr = _mm512_setzero_ps();
  for (long j = 0; j < nb; j++) {
    const uint8_t* b = w + j * 210;
    const __m512 sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_loadu_si128((const __m128i*)(b + 192))));
    // d * sc_g * dx of each 16-weight group, and the -32 offset's share
    const __m512 step = _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(half_at(b + 208)), sc),
                                      _mm512_loadu_ps(a.dx16 + 16 * j));
    corr = _mm512_fmadd_ps(step, _mm512_loadu_ps(a.xs16 + 16 * j), corr);
    for (int h = 0; h < 2; h++)
      for (int t = 0; t < 2; t++) {
        const int chunk = 2 * h + t;  // weights 64 chunk .. + 63: groups 4 chunk .. + 3
        const __m512i dot = _mm512_dpbusd_epi32(
            _mm512_setzero_si512(), q6_codes(b, h, t),
            _mm512_loadu_si512((const void*)(a.xq + 256 * j + 64 * chunk)));
        const __m512 scale = _mm512_permutexvar_ps(
            _mm512_add_epi32(lane_group, _mm512_set1_epi32(4 * chunk)), step);
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc);
      }
  }
  return _mm512_reduce_add_ps(acc) - _mm512_reduce_add_ps(corr);
}

static const int8_t IQ4_TABLE[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                     1,    13,   25,  38,  53,  69,  89,  113};

// IQ4_XS: codebook values (int8) looked up 64 at a time (VPSHUFB per 128-bit lane); DPBUSD
// wants an unsigned side, so |v| meets x with v's sign
static float row_iq4_xs(const uint8_t* w, long nb, Act a) {
  const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)IQ4_TABLE));
  const __m256i m4 = _mm256_set1_epi8(15);
  __m512 acc = _mm512_setzero_ps();
  for (long j = 0; j < nb; j++) {
    const uint8_t* b = w + j * 136;
    const int high = b[2] | (b[3] << 8);
    float ls[8];
    for (int s = 0; s < 8; s++)
      ls[s] = (float)((((b[4 + s / 2] >> (4 * (s % 2))) & 15) | (((high >> (2 * s)) & 3) << 4))
                      - 32);
    const __m512 step = _mm512_castps256_ps512(_mm256_mul_ps(
        _mm256_mul_ps(_mm256_set1_ps(half_at(b)), _mm256_loadu_ps(ls)),
        _mm256_loadu_ps(a.dx + 8 * j)));
    for (int c = 0; c < 4; c++) {  // sub-blocks 2c, 2c + 1: 16 bytes each, low nibbles first
      const __m256i q = _mm256_loadu_si256((const __m256i*)(b + 8 + 32 * c));
      const __m256i lo = _mm256_and_si256(q, m4);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
      const __m512i codes = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_permute2x128_si256(lo, hi, 0x20)),
          _mm256_permute2x128_si256(lo, hi, 0x31), 1);
      const __m512i v = _mm512_shuffle_epi8(table, codes);
      const __m512i x = _mm512_loadu_si512((const void*)(a.xq + 256 * j + 64 * c));
      const __m512i signed_x = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(v),
                                                    _mm512_setzero_si512(), x);
      const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_abs_epi8(v),
                                              signed_x);
      const __m512i pick = _mm512_add_epi32(_mm512_set1_epi32(2 * c), _mm512_setr_epi32(
          0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1));
      acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(pick, step), acc);
    }
  }
  return _mm512_reduce_add_ps(acc);
}

// type: gemv_blocks.c's ids (2: Q4_K, 3: Q5_K, 4: Q6_K, 5: IQ4_XS); 0 if the type has no kernel here
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
