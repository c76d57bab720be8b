// AVX2 lane reductions shared by the int8-activation kernels (gemv_q8_avx2.c,
// gemv_blocks_avx2.c); included inside their AVX2 sections.
#pragma once
#include <immintrin.h>

static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// four int32 vectors -> [d0 lanes 0-3, d1 0-3, d2 0-3, d3 0-3 | the same of lanes 4-7], each a
// sum of four lanes (exact: no product sum here comes near 2^31)
static inline __m256i quarter_sums(__m256i d0, __m256i d1, __m256i d2, __m256i d3) {
  return _mm256_hadd_epi32(_mm256_hadd_epi32(d0, d1), _mm256_hadd_epi32(d2, d3));
}

// eight int32 vectors -> lane i the sum of vector i's lanes, as fp32: eight groups' integer dot
// products in one register, scaled by one FMA (a broadcast and an FMA per group made the kernels
// compute-bound at half the memory's rate on a Zen 2)
static inline __m256 block_sums(const __m256i d[8]) {
  const __m256i a = quarter_sums(d[0], d[1], d[2], d[3]);
  const __m256i b = quarter_sums(d[4], d[5], d[6], d[7]);
  return _mm256_cvtepi32_ps(_mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20),
                                             _mm256_permute2x128_si256(a, b, 0x31)));
}
