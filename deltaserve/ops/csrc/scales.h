// Per-group scales (and 4-bit affine biases) of a quantized weight, in the dtype the model holds
// them: fp32, or fp16 / bf16 where that dtype holds every value exactly (quant/linear.py,
// narrow_scales_). A 16-bit scale is widened exactly here, so every kernel gives the same bits
// for each of the three; the fp16 form reads 2 bytes per group instead of 4 (-2.9% of an int8
// decode token's bytes). scale_kind is one value per call, so its branch is always predicted.
#ifndef DS_SCALES_H
#define DS_SCALES_H
#include <stdint.h>
#include <string.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif

enum { DS_SCALE_F32 = 0, DS_SCALE_F16 = 1, DS_SCALE_BF16 = 2 };

static inline float ds_half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1F, m = h & 0x3FF;
  uint32_t bits;
  if (e == 0x1F) {
    bits = sign | 0x7F800000u | (m << 13);  // inf, NaN (payload kept)
  } else if (e != 0) {
    bits = sign | ((e + 112) << 23) | (m << 13);
  } else if (m == 0) {
    bits = sign;  // signed zero
  } else {  // subnormal: m * 2^-24, exact in fp32
    const float f = (float)m * 0x1p-24f;
    return sign ? -f : f;
  }
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
#endif
}

// Element i of a scale (or bias) array of the given kind, as fp32.
static inline float ds_scale(const void* s, long i, int kind) {
  if (kind == DS_SCALE_F16) return ds_half_to_float(((const uint16_t*)s)[i]);
  if (kind == DS_SCALE_BF16) {
    const uint32_t bits = (uint32_t)((const uint16_t*)s)[i] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
  }
  return ((const float*)s)[i];
}

// The array from element i on (a row's scales).
static inline const void* ds_scale_at(const void* s, long i, int kind) {
  return (const char*)s + i * (kind == DS_SCALE_F32 ? 4 : 2);
}

#endif
