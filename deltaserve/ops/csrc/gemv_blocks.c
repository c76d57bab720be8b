// llama.cpp's block-quantized layouts (quant/ggml_blocks.py, the torch reference and the table of
// type ids) read as the file's bytes: a block is decoded into 256 (or 32) fp32 weights on the
// stack, exactly the reference's values (every product is exact in fp32, so fusing does not
// change them), and dotted with each activation row while it is in L1. Decode (M rows of x)
// streams the blocks once; prefill dequantizes whole rows into the GEMM scratch.
#include <stdint.h>
#include "scales.h"
#include "simd.h"

enum { T_Q2_K, T_Q3_K, T_Q4_K, T_Q5_K, T_Q6_K, T_IQ4_XS, T_IQ4_NL, T_Q5_0, T_Q5_1, T_COUNT };
static const int QK[T_COUNT] = {256, 256, 256, 256, 256, 256, 32, 32, 32};
static const int BYTES[T_COUNT] = {84, 110, 144, 176, 210, 136, 18, 22, 24};
static const float IQ4[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                              1,    13,   25,  38,  53,  69,  89,  113};

static inline float half_at(const uint8_t* p) { return ds_half_to_float(p[0] | (p[1] << 8)); }

// the 6-bit scale and min j (0..7) of a Q4_K / Q5_K block's 12 scale bytes
static inline void k_scale_min(const uint8_t* s, int j, float* sc, float* mn) {
  if (j < 4) {
    *sc = (float)(s[j] & 63);
    *mn = (float)(s[j + 4] & 63);
  } else {
    *sc = (float)((s[j + 4] & 15) | ((s[j - 4] >> 6) << 4));
    *mn = (float)((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
  }
}

static void dec_q2_k(const uint8_t* b, float* o) {
  const float d = half_at(b + 80), dmin = half_at(b + 82);
  for (int h = 0; h < 2; h++)      // two halves of 128: qs bytes h*32 .. h*32+31
    for (int s = 0; s < 4; s++)    // shift 2s
      for (int t = 0; t < 2; t++) {  // 16-weight group 8h + 2s + t
        const int g = 8 * h + 2 * s + t;
        const float dl = d * (float)(b[g] & 15), ml = dmin * (float)(b[g] >> 4);
        for (int i = 0; i < 16; i++)
          o[16 * g + i] = dl * (float)((b[16 + 32 * h + 16 * t + i] >> (2 * s)) & 3) - ml;
      }
}

static void dec_q3_k(const uint8_t* b, float* o) {
  const uint8_t *hm = b, *qs = b + 32, *s = b + 96;
  const float d = half_at(b + 108);
  for (int g = 0; g < 16; g++) {
    const int low = g < 8 ? s[g] & 15 : s[g - 8] >> 4;
    const int high = (s[8 + g % 4] >> (2 * (g / 4))) & 3;
    const float dl = d * (float)((low | (high << 4)) - 32);
    const int h = g / 8, sh = 2 * ((g / 2) % 4), t = g % 2;  // as in q2_k
    for (int i = 0; i < 16; i++) {
      const int k = 16 * t + i;
      const int q = ((qs[32 * h + k] >> sh) & 3) - (((hm[k] >> (g / 2)) & 1) ? 0 : 4);
      o[16 * g + i] = dl * (float)q;
    }
  }
}

static void dec_q4_k(const uint8_t* b, float* o) {
  const float d = half_at(b), dmin = half_at(b + 2);
  const uint8_t* qs = b + 16;
  for (int c = 0; c < 4; c++) {  // 32 bytes: 32 low nibbles (group 2c), 32 high (2c + 1)
    float s0, m0, s1, m1;
    k_scale_min(b + 4, 2 * c, &s0, &m0);
    k_scale_min(b + 4, 2 * c + 1, &s1, &m1);
    const float d0 = d * s0, n0 = dmin * m0, d1 = d * s1, n1 = dmin * m1;
    for (int i = 0; i < 32; i++) {
      o[64 * c + i] = d0 * (float)(qs[32 * c + i] & 15) - n0;
      o[64 * c + 32 + i] = d1 * (float)(qs[32 * c + i] >> 4) - n1;
    }
  }
}

static void dec_q5_k(const uint8_t* b, float* o) {
  const float d = half_at(b), dmin = half_at(b + 2);
  const uint8_t *qh = b + 16, *qs = b + 48;
  for (int c = 0; c < 4; c++) {
    float s0, m0, s1, m1;
    k_scale_min(b + 4, 2 * c, &s0, &m0);
    k_scale_min(b + 4, 2 * c + 1, &s1, &m1);
    const float d0 = d * s0, n0 = dmin * m0, d1 = d * s1, n1 = dmin * m1;
    for (int i = 0; i < 32; i++) {
      const int lo = (qs[32 * c + i] & 15) | (((qh[i] >> (2 * c)) & 1) << 4);
      const int hi = (qs[32 * c + i] >> 4) | (((qh[i] >> (2 * c + 1)) & 1) << 4);
      o[64 * c + i] = d0 * (float)lo - n0;
      o[64 * c + 32 + i] = d1 * (float)hi - n1;
    }
  }
}

static void dec_q6_k(const uint8_t* b, float* o) {
  const uint8_t *ql = b, *qh = b + 128;
  const int8_t* sc = (const int8_t*)(b + 192);
  const float d = half_at(b + 208);
  for (int h = 0; h < 2; h++)    // halves of 128 weights: ql 64 bytes, qh 32 bytes
    for (int j = 0; j < 4; j++)  // 32 weights: ql nibble j/2 of bytes (j%2)*32.., qh bits 2j
      for (int i = 0; i < 32; i++) {
        const int k = 128 * h + 32 * j + i;
        const int lo = (ql[64 * h + 32 * (j % 2) + i] >> (4 * (j / 2))) & 15;
        const int q = (lo | (((qh[32 * h + i] >> (2 * j)) & 3) << 4)) - 32;
        o[k] = (d * (float)sc[k / 16]) * (float)q;
      }
}

static void dec_iq4_xs(const uint8_t* b, float* o) {
  const float d = half_at(b);
  const int high = b[2] | (b[3] << 8);
  for (int g = 0; g < 8; g++) {
    const int sc = (((b[4 + g / 2] >> (4 * (g % 2))) & 15) | (((high >> (2 * g)) & 3) << 4)) - 32;
    const float dl = d * (float)sc;
    const uint8_t* qs = b + 8 + 16 * g;
    for (int i = 0; i < 16; i++) {
      o[32 * g + i] = dl * IQ4[qs[i] & 15];
      o[32 * g + 16 + i] = dl * IQ4[qs[i] >> 4];
    }
  }
}

static void dec_iq4_nl(const uint8_t* b, float* o) {
  const float d = half_at(b);
  for (int i = 0; i < 16; i++) {
    o[i] = d * IQ4[b[2 + i] & 15];
    o[16 + i] = d * IQ4[b[2 + i] >> 4];
  }
}

static void dec_q5(const uint8_t* b, float* o, int has_min) {
  const float d = half_at(b), m = has_min ? half_at(b + 2) : 0.f;
  const uint8_t* p = b + (has_min ? 4 : 2);
  const uint32_t qh = p[0] | (p[1] << 8) | (p[2] << 16) | ((uint32_t)p[3] << 24);
  for (int i = 0; i < 16; i++) {
    const int lo = (p[4 + i] & 15) | (((qh >> i) & 1) << 4);
    const int hi = (p[4 + i] >> 4) | (((qh >> (i + 16)) & 1) << 4);
    if (has_min) {
      o[i] = d * (float)lo + m;
      o[16 + i] = d * (float)hi + m;
    } else {
      o[i] = d * (float)(lo - 16);
      o[16 + i] = d * (float)(hi - 16);
    }
  }
}

#if DS_SIMD16
// The common types decoded 16 weights at a time: per weight the scalar decoders' operations in
// their order (a fused multiply-add only where the product is exact), so the same values.
static void dec_k4_v(const uint8_t* b, float* o, int five) {
  const float d = half_at(b), dmin = half_at(b + 2);
  const uint8_t *qh = b + 16, *qs = b + (five ? 48 : 16);
  for (int c = 0; c < 4; c++) {
    float s0, m0, s1, m1;
    k_scale_min(b + 4, 2 * c, &s0, &m0);
    k_scale_min(b + 4, 2 * c + 1, &s1, &m1);
    const vf16 d0 = vf_set1(d * s0), n0 = vf_set1(-(dmin * m0));
    const vf16 d1 = vf_set1(d * s1), n1 = vf_set1(-(dmin * m1));
    for (int h = 0; h < 2; h++) {
      const vi16 q = vi_load_u8(qs + 32 * c + 16 * h);
      vi16 lo = vi_bits(q, 0, 15), hi = vi_bits(q, 4, 15);
      if (five) {
        const vi16 bits = vi_load_u8(qh + 16 * h);
        lo = vi_or_shl(lo, vi_bits(bits, 2 * c, 1), 4);
        hi = vi_or_shl(hi, vi_bits(bits, 2 * c + 1, 1), 4);
      }
      vf_store(o + 64 * c + 16 * h, vf_fma(d0, vf_from_vi(lo, 0), n0));
      vf_store(o + 64 * c + 32 + 16 * h, vf_fma(d1, vf_from_vi(hi, 0), n1));
    }
  }
}

static void dec_q6_k_v(const uint8_t* b, float* o) {
  const uint8_t *ql = b, *qh = b + 128;
  const int8_t* sc = (const int8_t*)(b + 192);
  const float d = half_at(b + 208);
  for (int h = 0; h < 2; h++)
    for (int i0 = 0; i0 < 32; i0 += 16) {
      const vi16 high = vi_load_u8(qh + 32 * h + i0);
      const vi16 la = vi_load_u8(ql + 64 * h + i0), lb = vi_load_u8(ql + 64 * h + 32 + i0);
      for (int j = 0; j < 4; j++) {
        const vi16 q = vi_or_shl(vi_bits(j % 2 ? lb : la, 4 * (j / 2), 15),
                                 vi_bits(high, 2 * j, 3), 4);
        const int k = 128 * h + 32 * j + i0;
        vf_store(o + k, vf_mul(vf_set1(d * (float)sc[k / 16]), vf_from_vi(q, 32)));
      }
    }
}

static void dec_iq4_v(const uint8_t* qs, float dl, float* o) {  // 16 bytes: 32 codebook weights
  const vi16 q = vi_load_u8(qs);
  vf_store(o, vf_mul(vf_set1(dl), vf_lut16(IQ4, vi_bits(q, 0, 15))));
  vf_store(o + 16, vf_mul(vf_set1(dl), vf_lut16(IQ4, vi_bits(q, 4, 15))));
}

static void dec_iq4_xs_v(const uint8_t* b, float* o) {
  const float d = half_at(b);
  const int high = b[2] | (b[3] << 8);
  for (int g = 0; g < 8; g++) {
    const int sc = (((b[4 + g / 2] >> (4 * (g % 2))) & 15) | (((high >> (2 * g)) & 3) << 4)) - 32;
    dec_iq4_v(b + 8 + 16 * g, d * (float)sc, o + 32 * g);
  }
}
#endif

static inline void decode(int type, const uint8_t* b, float* o) {
  switch (type) {
    case T_Q2_K: dec_q2_k(b, o); break;
    case T_Q3_K: dec_q3_k(b, o); break;
#if DS_SIMD16
    case T_Q4_K: dec_k4_v(b, o, 0); break;
    case T_Q5_K: dec_k4_v(b, o, 1); break;
    case T_Q6_K: dec_q6_k_v(b, o); break;
    case T_IQ4_XS: dec_iq4_xs_v(b, o); break;
    case T_IQ4_NL: dec_iq4_v(b + 2, half_at(b), o); break;
#else
    case T_Q4_K: dec_q4_k(b, o); break;
    case T_Q5_K: dec_q5_k(b, o); break;
    case T_Q6_K: dec_q6_k(b, o); break;
    case T_IQ4_XS: dec_iq4_xs(b, o); break;
    case T_IQ4_NL: dec_iq4_nl(b, o); break;
#endif
    case T_Q5_0: dec_q5(b, o, 0); break;
    default: dec_q5(b, o, 1); break;
  }
}

int ds_blocks_valid(int type) { return type >= 0 && type < T_COUNT; }

// w [N, K / QK * BYTES] -> out [N, K] fp32, the reference's values
void ds_dequant_blocks(int type, const uint8_t* w, float* out, long N, long K, int num_threads) {
  const long nb = K / QK[type], row = nb * BYTES[type];
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (long n = 0; n < N; n++)
    for (long j = 0; j < nb; j++) decode(type, w + n * row + j * BYTES[type], out + n * K + j * QK[type]);
}

#define MAX_ROWS 32  // activation rows per call (ops/qgemv.QGEMM_MAX_ROWS)

// y [M, N] = x [M, K] W^T: per weight row, each block decoded once and dotted with the M rows;
// each row's sum runs in a fixed order, so a row gets the same bits whatever M is.
void ds_gemm_blocks(int type, const uint8_t* w, const float* x, float* y, long M, long N, long K,
                    int num_threads) {
  const int qk = QK[type], bytes = BYTES[type];
  const long nb = K / qk, row = nb * bytes;
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (long n = 0; n < N; n++) {
    float buf[256] __attribute__((aligned(64)));
    const uint8_t* wr = w + n * row;
#if DS_SIMD16
    // two accumulators per row (32-weight halves): one chain of fused adds would wait on its
    // own latency every 16 weights
    vf16 acc[MAX_ROWS][2];
    for (long m = 0; m < M; m++) acc[m][0] = acc[m][1] = vf_zero();
    for (long j = 0; j < nb; j++) {
      if (j + 1 < nb) ds_prefetch(wr + (j + 1) * bytes);
      decode(type, wr + j * bytes, buf);
      for (long m = 0; m < M; m++) {
        const float* xr = x + m * K + j * qk;
        vf16 a = acc[m][0], b = acc[m][1];
        for (int i = 0; i < qk; i += 32) {
          a = vf_fma(vf_load(buf + i), vf_load(xr + i), a);
          b = vf_fma(vf_load(buf + i + 16), vf_load(xr + i + 16), b);
        }
        acc[m][0] = a;
        acc[m][1] = b;
      }
    }
    for (long m = 0; m < M; m++) y[m * N + n] = vf_sum(acc[m][0]) + vf_sum(acc[m][1]);
#else
    float acc[MAX_ROWS] = {0};
    for (long j = 0; j < nb; j++) {
      decode(type, wr + j * bytes, buf);
      for (long m = 0; m < M; m++) {
        const float* xr = x + m * K + j * qk;
        float a = 0.f;
        for (int i = 0; i < qk; i++) a += buf[i] * xr[i];
        acc[m] += a;
      }
    }
    for (long m = 0; m < M; m++) y[m * N + n] = acc[m];
#endif
  }
}
