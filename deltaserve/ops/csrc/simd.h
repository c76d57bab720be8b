// 16 fp32 lanes for the CPU kernels: one AVX-512 register, or two AVX2 registers on CPUs without
// AVX-512 (most laptops), so each kernel is written once. DS_SIMD16 is 0 where neither exists
// (the kernels' scalar loops run). Within one build the lane order of every reduction is fixed,
// so a kernel gives the same bits whichever caller runs it; AVX2 and AVX-512 builds differ in
// the last bits (another summation order), as two machines do.
#ifndef DS_SIMD_H
#define DS_SIMD_H
#include <stdint.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#define DS_SIMD16 1
#define DS_SIMD_ISA 2  // which branch was built, for ds_simd_isa (gemv_quant.c)
typedef __m512 vf16;
static inline vf16 vf_zero(void) { return _mm512_setzero_ps(); }
static inline vf16 vf_load(const float* p) { return _mm512_loadu_ps(p); }
static inline vf16 vf_set1(float s) { return _mm512_set1_ps(s); }
static inline vf16 vf_fma(vf16 a, vf16 b, vf16 c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vf_sum(vf16 v) { return _mm512_reduce_add_ps(v); }
// 16 bf16 -> fp32 (a bf16 is the top half of its fp32)
static inline vf16 vf_load_bf16(const uint16_t* p) {
  __m256i h = _mm256_loadu_si256((const __m256i*)p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
// 16 int8 -> fp32
static inline vf16 vf_load_i8(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
// 16 bytes of nibbles -> their low nibbles (*lo) and high nibbles (*hi) as fp32
static inline void vf_load_u4(const uint8_t* p, vf16* lo, vf16* hi) {
  const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
  *lo = _mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(0xF)));
  *hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4));
}
// v + x in the lanes whose bit is set in `bits` (lane i: bit i), v elsewhere
static inline vf16 vf_mask_add(vf16 v, uint16_t bits, vf16 x) {
  return _mm512_mask_add_ps(v, (__mmask16)bits, v, x);
}
// 16 int32 lanes (the block decoders' codes): bytes widened, shifts, masks, a 16-entry table
typedef __m512i vi16;
static inline void vf_store(float* p, vf16 v) { _mm512_storeu_ps(p, v); }
static inline vf16 vf_mul(vf16 a, vf16 b) { return _mm512_mul_ps(a, b); }
static inline vi16 vi_load_u8(const uint8_t* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
}
static inline vi16 vi_bits(vi16 v, int shift, int mask) {  // (v >> shift) & mask
  return _mm512_and_si512(_mm512_srli_epi32(v, shift), _mm512_set1_epi32(mask));
}
static inline vi16 vi_or_shl(vi16 a, vi16 b, int shift) {  // a | (b << shift)
  return _mm512_or_si512(a, _mm512_slli_epi32(b, shift));
}
static inline vf16 vf_from_vi(vi16 v, int minus) {  // (float)(v - minus)
  return _mm512_cvtepi32_ps(_mm512_sub_epi32(v, _mm512_set1_epi32(minus)));
}
static inline vf16 vf_lut16(const float* table, vi16 index) {  // table[index], index in 0..15
  return _mm512_permutexvar_ps(index, _mm512_loadu_ps(table));
}

#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define DS_SIMD16 1
#define DS_SIMD_ISA 1
typedef struct {
  __m256 a, b;  // lanes 0-7, 8-15
} vf16;
static inline vf16 vf_zero(void) { return (vf16){_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline vf16 vf_load(const float* p) {
  return (vf16){_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)};
}
static inline vf16 vf_set1(float s) { return (vf16){_mm256_set1_ps(s), _mm256_set1_ps(s)}; }
static inline vf16 vf_fma(vf16 x, vf16 y, vf16 c) {
  return (vf16){_mm256_fmadd_ps(x.a, y.a, c.a), _mm256_fmadd_ps(x.b, y.b, c.b)};
}
static inline float vf_sum(vf16 v) {
  const __m256 s = _mm256_add_ps(v.a, v.b);
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_movehdup_ps(q));
  return _mm_cvtss_f32(q);
}
static inline __m256 bf16x8(__m128i h) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static inline vf16 vf_load_bf16(const uint16_t* p) {
  return (vf16){bf16x8(_mm_loadu_si128((const __m128i*)p)),
                bf16x8(_mm_loadu_si128((const __m128i*)(p + 8)))};
}
static inline vf16 vf_load_i8(const int8_t* p) {
  const __m128i b = _mm_loadu_si128((const __m128i*)p);
  return (vf16){_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)),
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)))};
}
static inline void vf_load_u4(const uint8_t* p, vf16* lo, vf16* hi) {
  const __m128i b = _mm_loadu_si128((const __m128i*)p);
  const __m256i qa = _mm256_cvtepu8_epi32(b), qb = _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8));
  const __m256i m = _mm256_set1_epi32(0xF);
  *lo = (vf16){_mm256_cvtepi32_ps(_mm256_and_si256(qa, m)),
               _mm256_cvtepi32_ps(_mm256_and_si256(qb, m))};
  *hi = (vf16){_mm256_cvtepi32_ps(_mm256_srli_epi32(qa, 4)),
               _mm256_cvtepi32_ps(_mm256_srli_epi32(qb, 4))};
}
static inline __m256 mask_add8(__m256 v, int bits, __m256 x) {
  const __m256i lanes = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i on = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(bits), lanes), lanes);
  return _mm256_blendv_ps(v, _mm256_add_ps(v, x), _mm256_castsi256_ps(on));
}
static inline vf16 vf_mask_add(vf16 v, uint16_t bits, vf16 x) {
  return (vf16){mask_add8(v.a, bits & 0xFF, x.a), mask_add8(v.b, bits >> 8, x.b)};
}
typedef struct {
  __m256i a, b;
} vi16;
static inline void vf_store(float* p, vf16 v) {
  _mm256_storeu_ps(p, v.a);
  _mm256_storeu_ps(p + 8, v.b);
}
static inline vf16 vf_mul(vf16 x, vf16 y) {
  return (vf16){_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)};
}
static inline vi16 vi_load_u8(const uint8_t* p) {
  const __m128i b = _mm_loadu_si128((const __m128i*)p);
  return (vi16){_mm256_cvtepu8_epi32(b), _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8))};
}
static inline vi16 vi_bits(vi16 v, int shift, int mask) {
  const __m256i m = _mm256_set1_epi32(mask);
  return (vi16){_mm256_and_si256(_mm256_srli_epi32(v.a, shift), m),
                _mm256_and_si256(_mm256_srli_epi32(v.b, shift), m)};
}
static inline vi16 vi_or_shl(vi16 x, vi16 y, int shift) {
  return (vi16){_mm256_or_si256(x.a, _mm256_slli_epi32(y.a, shift)),
                _mm256_or_si256(x.b, _mm256_slli_epi32(y.b, shift))};
}
static inline vf16 vf_from_vi(vi16 v, int minus) {
  const __m256i m = _mm256_set1_epi32(minus);
  return (vf16){_mm256_cvtepi32_ps(_mm256_sub_epi32(v.a, m)),
                _mm256_cvtepi32_ps(_mm256_sub_epi32(v.b, m))};
}
static inline __m256 lut8x2(__m256 lo, __m256 hi, __m256i index) {  // index 0..15
  const __m256 upper = _mm256_castsi256_ps(_mm256_cmpgt_epi32(index, _mm256_set1_epi32(7)));
  return _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, index),
                          _mm256_permutevar8x32_ps(hi, index), upper);
}
static inline vf16 vf_lut16(const float* table, vi16 index) {
  const __m256 lo = _mm256_loadu_ps(table), hi = _mm256_loadu_ps(table + 8);
  return (vf16){lut8x2(lo, hi, index.a), lut8x2(lo, hi, index.b)};
}

#elif defined(__ARM_NEON) && defined(__aarch64__) && !defined(DS_NO_NEON)
// ARM (Apple silicon, Graviton, Ampere, Snapdragon laptops): four 128-bit NEON registers.
// DS_NO_NEON (tests) builds the scalar loops on such a machine.
#include <arm_neon.h>
#define DS_SIMD16 1
#define DS_SIMD_ISA 8
typedef struct {
  float32x4_t v[4];
} vf16;
typedef struct {
  int32x4_t v[4];
} vi16;
#define DS_LANES4(expr) {{expr(0), expr(1), expr(2), expr(3)}}
static inline vf16 vf_zero(void) {
  const float32x4_t z = vdupq_n_f32(0.0f);
  return (vf16){{z, z, z, z}};
}
static inline vf16 vf_load(const float* p) {
#define L_(i) vld1q_f32(p + 4 * (i))
  return (vf16)DS_LANES4(L_);
#undef L_
}
static inline vf16 vf_set1(float s) {
  const float32x4_t v = vdupq_n_f32(s);
  return (vf16){{v, v, v, v}};
}
static inline vf16 vf_fma(vf16 x, vf16 y, vf16 c) {
#define L_(i) vfmaq_f32(c.v[i], x.v[i], y.v[i])
  return (vf16)DS_LANES4(L_);
#undef L_
}
static inline float vf_sum(vf16 v) {  // a fixed order: (0 + 1) + (2 + 3), then across lanes
  return vaddvq_f32(vaddq_f32(vaddq_f32(v.v[0], v.v[1]), vaddq_f32(v.v[2], v.v[3])));
}
static inline vf16 vf_load_bf16(const uint16_t* p) {  // a bf16 is the top half of its fp32
  const uint16x8_t a = vld1q_u16(p), b = vld1q_u16(p + 8);
  return (vf16){{vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(a), 16)),
                 vreinterpretq_f32_u32(vshll_n_u16(vget_high_u16(a), 16)),
                 vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(b), 16)),
                 vreinterpretq_f32_u32(vshll_n_u16(vget_high_u16(b), 16))}};
}
static inline vi16 vi_from_u8x16(uint8x16_t b) {
  const uint16x8_t lo = vmovl_u8(vget_low_u8(b)), hi = vmovl_u8(vget_high_u8(b));
  return (vi16){{vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(lo))),
                 vreinterpretq_s32_u32(vmovl_u16(vget_high_u16(lo))),
                 vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(hi))),
                 vreinterpretq_s32_u32(vmovl_u16(vget_high_u16(hi)))}};
}
static inline vf16 vf_load_i8(const int8_t* p) {
  const int8x16_t b = vld1q_s8(p);
  const int16x8_t lo = vmovl_s8(vget_low_s8(b)), hi = vmovl_s8(vget_high_s8(b));
  return (vf16){{vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo))),
                 vcvtq_f32_s32(vmovl_s16(vget_high_s16(lo))),
                 vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi))),
                 vcvtq_f32_s32(vmovl_s16(vget_high_s16(hi)))}};
}
static inline void vf_load_u4(const uint8_t* p, vf16* lo, vf16* hi) {
  const uint8x16_t b = vld1q_u8(p);
  const vi16 l = vi_from_u8x16(vandq_u8(b, vdupq_n_u8(0xF))), h = vi_from_u8x16(vshrq_n_u8(b, 4));
#define L_(i) vcvtq_f32_s32(l.v[i])
#define H_(i) vcvtq_f32_s32(h.v[i])
  *lo = (vf16)DS_LANES4(L_);
  *hi = (vf16)DS_LANES4(H_);
#undef L_
#undef H_
}
static inline float32x4_t mask_add4(float32x4_t v, int bits, float32x4_t x) {
  static const uint32_t lanes[4] = {1, 2, 4, 8};
  const uint32x4_t l = vld1q_u32(lanes);
  const uint32x4_t on = vceqq_u32(vandq_u32(vdupq_n_u32((uint32_t)bits), l), l);
  return vbslq_f32(on, vaddq_f32(v, x), v);
}
static inline vf16 vf_mask_add(vf16 v, uint16_t bits, vf16 x) {
#define L_(i) mask_add4(v.v[i], (bits >> (4 * (i))) & 0xF, x.v[i])
  return (vf16)DS_LANES4(L_);
#undef L_
}
static inline void vf_store(float* p, vf16 v) {
  for (int i = 0; i < 4; i++) vst1q_f32(p + 4 * i, v.v[i]);
}
static inline vf16 vf_mul(vf16 x, vf16 y) {
#define L_(i) vmulq_f32(x.v[i], y.v[i])
  return (vf16)DS_LANES4(L_);
#undef L_
}
static inline vi16 vi_load_u8(const uint8_t* p) { return vi_from_u8x16(vld1q_u8(p)); }
static inline vi16 vi_bits(vi16 v, int shift, int mask) {  // (v >> shift) & mask
  const int32x4_t m = vdupq_n_s32(mask), s = vdupq_n_s32(-shift);
#define L_(i) vandq_s32(vreinterpretq_s32_u32(vshlq_u32(vreinterpretq_u32_s32(v.v[i]), s)), m)
  return (vi16)DS_LANES4(L_);
#undef L_
}
static inline vi16 vi_or_shl(vi16 x, vi16 y, int shift) {  // x | (y << shift)
  const int32x4_t s = vdupq_n_s32(shift);
#define L_(i) vorrq_s32(x.v[i], vshlq_s32(y.v[i], s))
  return (vi16)DS_LANES4(L_);
#undef L_
}
static inline vf16 vf_from_vi(vi16 v, int minus) {  // (float)(v - minus)
  const int32x4_t m = vdupq_n_s32(minus);
#define L_(i) vcvtq_f32_s32(vsubq_s32(v.v[i], m))
  return (vf16)DS_LANES4(L_);
#undef L_
}
static inline vf16 vf_lut16(const float* table, vi16 index) {  // table[index], index in 0..15
  vf16 out;
  for (int i = 0; i < 4; i++) {
    int32_t idx[4];
    float val[4];
    vst1q_s32(idx, index.v[i]);
    for (int j = 0; j < 4; j++) val[j] = table[idx[j]];
    out.v[i] = vld1q_f32(val);
  }
  return out;
}

#else
#define DS_SIMD16 0
#define DS_SIMD_ISA 0
#endif

// A read prefetch into every cache level (prefetcht0 on x86), the same call on every ISA.
static inline void ds_prefetch(const void* p) { __builtin_prefetch(p, 0, 3); }

#endif
