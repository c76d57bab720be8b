// fp32 GEMMs on AMX bf16 tiles that keep fp32 results ("bf16x2/x3"): x = hi + lo, two bf16 parts
// (16 significant bits); W is one bf16 part when its values are bf16 (the vision tower ships bf16)
// or hi + lo otherwise; y = xh.Wh + xl.Wh (+ xh.Wl) + b, every product exact in fp32 and summed
// in fp32 by TDPBF16PS. About 1e-6 relative error, against fp32 GEMM's 2e-7 (ops/gemm_amx.py holds
// the reference and the tests' bounds). Built only where the compiler targets AMX-BF16.
#include <stdint.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ROWS 32   // output rows per block: two 16-row A tiles
#define COLS 32   // output columns per block: two 16-column B tiles
#define KSTEP 32  // bf16 per tile row (64 bytes)
// bytes of A parts per row chunk: the chunk stays in L2 while every column panel passes (a sweep
// of 256K..4M on the 2-core Xeon with a scratch script, never committed: 512K-1M best on the
// tower's shapes; docs/journal/2026-11-30-issue-8-vision.md)
#define CHUNK_BYTES (512L << 10)

// Linux grants the tile-data state only on request, once per process; 1 if granted.
int ds_amx_init(void) {
  return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
}

typedef struct {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
} tile_config;

// tiles 0-3: C (2 x 2 of 16 x 16 fp32); 4, 5: A (16 rows x 32 bf16); 6, 7: B (16 k-pairs x 16
// columns x 2)
static void configure_tiles(void) {
  tile_config cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  for (int t = 0; t < 8; t++) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

// x fp32 [M, K] -> hi, lo bf16 [Mp, Kp] (zero pads): hi = bf16(x), lo = bf16(x - hi), both
// rounded to nearest even; lo = 0 where hi is infinite (inf - inf would be NaN).
static void split_rows(const float* x, uint16_t* hi, uint16_t* lo, long M, long K, long Kp,
                       long row0, long row1) {
  for (long m = row0; m < row1; m++) {
    uint16_t* h = hi + m * Kp;
    uint16_t* l = lo + m * Kp;
    if (m >= M) {
      memset(h, 0, Kp * 2);
      memset(l, 0, Kp * 2);
      continue;
    }
    const float* xm = x + m * K;
    for (long k = 0; k < Kp; k += 16) {
      const long left = K - k;
      const __mmask16 mask = left >= 16 ? 0xFFFF : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
      const __m512 v = _mm512_maskz_loadu_ps(mask, xm + k);
      const __m256bh vh = _mm512_cvtneps_pbh(v);
      const __m512 back = _mm512_castsi512_ps(
          _mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)vh), 16));
      const __mmask16 finite = _mm512_cmp_ps_mask(_mm512_abs_ps(back),
                                                   _mm512_set1_ps(__builtin_inff()), _CMP_LT_OQ);
      const __m256bh vl = _mm512_cvtneps_pbh(_mm512_maskz_sub_ps(finite, v, back));
      _mm256_storeu_si256((__m256i*)(h + k), (__m256i)vh);
      _mm256_storeu_si256((__m256i*)(l + k), (__m256i)vl);
    }
  }
}

// e^x, Cephes' expf: n = round(x log2 e), r = x - n ln 2 (two-part ln 2), a degree-6 polynomial
// for e^r, then scaled by 2^n. Within 2 ulp of expf; inputs clamped to +-88.7 (fp32's range).
static inline __m512 exp_ps(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-88.7f)), _mm512_set1_ps(88.7f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// GELU, tanh form: 0.5 v (1 + tanh(u)) = v / (1 + e^(-2u)), u = sqrt(2/pi) (v + 0.044715 v^3)
static inline __m512 gelu_tanh_ps(__m512 v) {
  const __m512 u = _mm512_mul_ps(
      _mm512_set1_ps(0.7978845608028654f),
      _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(0.044715f), v), _mm512_mul_ps(v, v), v));
  const __m512 e = exp_ps(_mm512_mul_ps(_mm512_set1_ps(-2.0f), u));
  return _mm512_div_ps(v, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}

// y[block] = residual + act(acc + bias), in the reference's order; only the block's valid rows
// and columns are written.
static void epilogue(const float* acc, const float* bias, const float* residual, float* y, long M,
                     long N, long m0, long n0, int act) {
  const long rows = M - m0 < ROWS ? M - m0 : ROWS, cols = N - n0 < COLS ? N - n0 : COLS;
  for (long c = 0; c < cols; c += 16) {
    const long left = cols - c;
    const __mmask16 mask = left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n0 + c) : _mm512_setzero_ps();
    for (long r = 0; r < rows; r++) {
      __m512 v = _mm512_add_ps(_mm512_loadu_ps(acc + r * COLS + c), b);
      if (act == 1) v = gelu_tanh_ps(v);
      float* out = y + (m0 + r) * N + n0 + c;
      if (residual) v = _mm512_add_ps(_mm512_maskz_loadu_ps(mask, residual + (out - y)), v);
      _mm512_mask_storeu_ps(out, mask, v);
    }
  }
}

// C tiles 0-3 += A tiles 4, 5 (rows) x B tiles 6, 7 (columns)
static inline void dot_2x2(void) {
  _tile_dpbf16ps(0, 4, 6);
  _tile_dpbf16ps(1, 4, 7);
  _tile_dpbf16ps(2, 5, 6);
  _tile_dpbf16ps(3, 5, 7);
}

// One 32 x 32 block of y over the whole K. wh, wl: packed [Np/16][Kp/32][16][32] (wl may be NULL).
static void block(const uint16_t* ah, const uint16_t* al, const uint16_t* wh, const uint16_t* wl,
                  const float* bias, const float* residual, float* y, long M, long N, long Kp,
                  long m0, long n0, int act) {
  const long num_k = Kp / KSTEP, stride = Kp * 2;
  const uint16_t* b0 = wh + (n0 / 16) * num_k * 512;
  const uint16_t* b1 = b0 + num_k * 512;
  const uint16_t *c0 = wl ? wl + (n0 / 16) * num_k * 512 : NULL, *c1 = c0 ? c0 + num_k * 512 : NULL;
  const uint16_t *h0 = ah + m0 * Kp, *h1 = h0 + 16 * Kp, *l0 = al + m0 * Kp, *l1 = l0 + 16 * Kp;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (long kb = 0; kb < num_k; kb++) {
    const long ka = kb * KSTEP, kw = kb * 512;
    _tile_loadd(4, h0 + ka, stride);
    _tile_loadd(5, h1 + ka, stride);
    if (c0) {  // xh . Wl first, while the hi A tiles are loaded
      _tile_loadd(6, c0 + kw, 64);
      _tile_loadd(7, c1 + kw, 64);
      dot_2x2();
    }
    _tile_loadd(6, b0 + kw, 64);
    _tile_loadd(7, b1 + kw, 64);
    dot_2x2();
    _tile_loadd(4, l0 + ka, stride);
    _tile_loadd(5, l1 + ka, stride);
    dot_2x2();
  }
  float out[ROWS][COLS];
  _tile_stored(0, &out[0][0], COLS * 4);
  _tile_stored(1, &out[0][16], COLS * 4);
  _tile_stored(2, &out[16][0], COLS * 4);
  _tile_stored(3, &out[16][16], COLS * 4);
  epilogue(&out[0][0], bias, residual, y, M, N, m0, n0, act);
}
// y fp32 [M, N] = residual + act(x fp32 [M, K] . W^T + bias), act 0 = none, 1 = tanh GELU; bias,
// residual [M, N] optional (NULL). scratch: bf16 [2, Mp, Kp] with Mp = M rounded up to
// 32, Kp = K rounded up to 32; wh/wl packed by ops/gemm_amx.pack_weight (Np = N rounded up to 32).
void ds_gemm_amx(const float* x, const uint16_t* wh, const uint16_t* wl, const float* bias,
                 const float* residual, float* y, uint16_t* scratch, long M, long N, long K, int act,
                 int num_threads) {
  const long Kp = (K + KSTEP - 1) / KSTEP * KSTEP, Mp = (M + ROWS - 1) / ROWS * ROWS;
  const long Np = (N + COLS - 1) / COLS * COLS;
  uint16_t *ah = scratch, *al = scratch + Mp * Kp;
  long MC = CHUNK_BYTES / (Kp * 4) / ROWS * ROWS;  // rows per chunk
  if (MC < ROWS) MC = ROWS;
  const long num_chunks = (Mp + MC - 1) / MC, num_panels = Np / COLS;
#pragma omp parallel num_threads(num_threads)
  {
#pragma omp for schedule(static)
    for (long m = 0; m < Mp; m += ROWS) split_rows(x, ah, al, M, K, Kp, m, m + ROWS);
    configure_tiles();
#pragma omp for collapse(2) schedule(static)
    for (long chunk = 0; chunk < num_chunks; chunk++)
      for (long panel = 0; panel < num_panels; panel++) {
        const long m_end = (chunk + 1) * MC < Mp ? (chunk + 1) * MC : Mp;
        for (long m0 = chunk * MC; m0 < m_end; m0 += ROWS)
          block(ah, al, wh, wl, bias, residual, y, M, N, Kp, m0, panel * COLS, act);
      }
    _tile_release();
  }
}
#endif
