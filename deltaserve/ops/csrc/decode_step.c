// A decode step (one token for each of a few sequences) through every decoder layer in one call:
// the CPU counterpart of a CUDA graph. The layered Python path (models/qwen3_5.forward_batch)
// spends ~15-20 ms per step of the 0.8B model in Python and ~700 small torch ops around ~40 ms of
// weight-streaming GEMVs; here the same kernels (ds_gemv_*, ds_gemm_*, ds_gdn_decode_slots,
// ds_attend_rows, ds_rmsnorm) run back to back with no Python between.
// Spec: the layered path; tests/ops/test_decode_step.py checks parity per weight format.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "simd.h"

// which int8-activation kernels this build has: x86 (VNNI or AVX2) all of them, ARM with SDOT the
// int8 one (gemv_q8_sdot.c); a plan never asks a build for a kind it lacks (ops/qgemv)
#if (defined(__AVX512VNNI__) && defined(__AVX512BW__)) || (defined(__AVX2__) && defined(__FMA__))
#define DS_X86_ACT 1
#else
#define DS_X86_ACT 0
#endif
#if DS_X86_ACT || (defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD) && !defined(DS_NO_NEON))
#define DS_Q8_ACT 1
#else
#define DS_Q8_ACT 0
#endif

enum { DS_BF16 = 0, DS_Q8 = 1, DS_Q8_VNNI = 2, DS_A4 = 3, DS_Q1 = 4, DS_A4_VNNI = 5,
       DS_Q1_VNNI = 6, DS_BLOCKS = 7, DS_BLOCKS_VNNI = 8, DS_PARTS = 9 };

typedef struct DsMat {  // y[n] = sum_k W[n,k] x[k]; W in one of the formats above
  int kind;
  const void* w;
  const void* s;  // per-group scales [n, k/g] (quantized kinds)
  const void* b;  // per-group biases (4-bit affine)
  long n, k, g;  // GGUF blocks (DS_BLOCKS*): g is gemv_blocks.c's type id
  int scale_kind;  // of s and b: DS_SCALE_F32 / F16 / BF16 (scales.h)
  // DS_PARTS (a packed Linear whose parts a GGUF quantized apart): its first part, each part
  // the next one (NULL after the last); their outputs are concatenated
  const struct DsMat* next;
} DsMat;

typedef struct {
  int is_full;  // gated softmax attention; else Gated DeltaNet
  const float* in_norm;  // (1+w) RMSNorms of the residual stream
  const float* post_norm;
  DsMat mix_in, mix_out, gate_up, down;
  // Gated DeltaNet: conv weight [C,W], A_log, dt_bias [HV], gated-norm weight [V], pools
  const float* conv_w;
  const float* a_log;
  const float* dt_bias;
  const float* gnorm_w;
  float* conv_pool;  // [S,C,W-1]
  float* state_pool;  // [S,HV,K,V]
  // attention: (1+w) q/k norms [D]; K/V pools [blocks, HKV, block_len, D]
  const float* q_norm;
  const float* k_norm;
  float* k_pool;
  float* v_pool;
} DsLayer;

typedef struct {
  long hidden, inter, num_layers;
  float eps;
  long hk, hv, dk, dv, conv_width;  // GDN heads and head dims
  long hq, hkv, head_dim, rot_dim, block_len;  // attention
  float attn_scale;  // as the layered path passes it: (float)(head_dim ** -0.5)
  const float* final_norm;
} DsModel;

void ds_gemv_bf16(const uint16_t* w, const float* x, float* y, long N, long K, int num_threads);
void ds_gemv_q8(const int8_t* w, const void* s, const float* x, float* y, long N, long K, long G,
                int num_threads, int scale_kind);
void ds_gemv_q8_vnni(const int8_t* w, const void* s, const float* x, float* y, long N, long K,
                     long G, int num_threads, int scale_kind);
void ds_gemv_a4(const uint8_t* w, const void* s, const void* b, const float* x, float* y, long N,
                long K, long G, int num_threads, int scale_kind);
void ds_gemv_q1(const uint8_t* w, const void* s, const float* x, float* y, long N, long K, long G,
                int num_threads, int scale_kind);
void ds_gemv_a4_vnni(const uint8_t* w, const void* s, const void* b, const float* x, float* y,
                     long N, long K, long G, int num_threads, int scale_kind);
void ds_gemv_q1_vnni(const uint8_t* w, const void* s, const float* x, float* y, long N, long K,
                     long G, int num_threads, int scale_kind);
void ds_gdn_decode_slots(const float* qkv, const float* z, const float* b, const float* a,
                         float* window, const float* conv_w, const float* a_log,
                         const float* dt_bias, float* state, const float* norm_w, float* out,
                         const long* slots, long B, long H, long HV, long K, long V, long W,
                         float eps, int num_threads);
void ds_rmsnorm(const float* x, const float* w, float* y, long rows, long dim, float eps,
                float offset, int num_threads);
void ds_gemm_blocks(int type, const uint8_t* w, const float* x, float* y, long M, long N, long K,
                    int num_threads);
int ds_gemm_blocks_vnni(int type, const uint8_t* w, const float* x, float* y, long M, long N,
                        long K, int num_threads);

// GGUF blocks: the layered path's ops/qgemv.gemm_blocks (the int8-activation kernel where it was chosen and
// takes these rows, else the exact one), the same for one row as for M
static void blocks(const DsMat* m, const float* x, float* y, long rows, int threads) {
#if (defined(__AVX512VNNI__) && defined(__AVX512BW__)) || (defined(__AVX2__) && defined(__FMA__))
  // gemv_blocks_vnni.c, or gemv_blocks_avx2.c on AVX2 builds
  if (m->kind == DS_BLOCKS_VNNI &&
      ds_gemm_blocks_vnni((int)m->g, m->w, x, y, rows, m->n, m->k, threads))
    return;
#endif
  ds_gemm_blocks((int)m->g, m->w, x, y, rows, m->n, m->k, threads);
}

static void matmat(const DsMat* m, const float* x, float* y, long rows, int threads);

// the parts side by side: each into its columns of y [rows, n] (the layered path's torch.cat)
static void parts(const DsMat* m, const float* x, float* y, long rows, int threads) {
  long off = 0;
  for (const DsMat* p = m->next; p != NULL; p = p->next) {
    float* tmp = rows == 1 ? y + off : malloc(sizeof(float) * rows * p->n);
    if (tmp == NULL) abort();  // out of memory: stop rather than write through NULL
    matmat(p, x, tmp, rows, threads);
    if (rows > 1) {
      for (long r = 0; r < rows; r++)
        memcpy(y + r * m->n + off, tmp + r * p->n, sizeof(float) * p->n);
      free(tmp);
    }
    off += p->n;
  }
}

static float dot_f32(const float* a, const float* b, long n) {
  long i = 0;
  float acc = 0.f;
#if DS_SIMD16
  vf16 v = vf_zero();
  for (; i + 16 <= n; i += 16) v = vf_fma(vf_load(a + i), vf_load(b + i), v);
  acc = vf_sum(v);
#endif
  for (; i < n; i++) acc += a[i] * b[i];
  return acc;
}

void ds_gemm_bf16(const uint16_t* w, const float* x, float* y, long M, long N, long K,
                  int num_threads);
void ds_gemm_a4(const uint8_t* w, const void* s, const void* b, const float* x, float* y,
                long M, long N, long K, long G, int num_threads, int scale_kind);
void ds_gemm_q8(const int8_t* w, const void* s, const float* x, float* y, long M, long N, long K,
                long G, int num_threads, int scale_kind);
void ds_gemm_q8_vnni(const int8_t* w, const void* s, const float* x, float* y, long M, long N,
                     long K, long G, int num_threads, int scale_kind);
#if (defined(__AVX512VNNI__) && defined(__AVX512BW__)) || (defined(__AVX2__) && defined(__FMA__))  // gemv_vnni.c or gemv_q8_avx2.c
void ds_gemm_a4_vnni(const uint8_t* w, const void* s, const void* b, const float* x, float* y,
                     long M, long N, long K, long G, int num_threads, int scale_kind);
#endif

static void matvec(const DsMat* m, const float* x, float* y, int threads) {
  const int sk = m->scale_kind;
  switch (m->kind) {
    case DS_BF16: ds_gemv_bf16(m->w, x, y, m->n, m->k, threads); break;
    case DS_Q8: ds_gemv_q8(m->w, m->s, x, y, m->n, m->k, m->g, threads, sk); break;
#if DS_Q8_ACT  // gemv_vnni.c, gemv_q8_avx2.c on AVX2 builds, gemv_q8_sdot.c on ARM with SDOT
    case DS_Q8_VNNI: ds_gemv_q8_vnni(m->w, m->s, x, y, m->n, m->k, m->g, threads, sk); break;
#endif
#if DS_X86_ACT
    case DS_A4_VNNI: ds_gemv_a4_vnni(m->w, m->s, m->b, x, y, m->n, m->k, m->g, threads, sk); break;
    case DS_Q1_VNNI: ds_gemv_q1_vnni(m->w, m->s, x, y, m->n, m->k, m->g, threads, sk); break;
#endif
    case DS_A4: ds_gemv_a4(m->w, m->s, m->b, x, y, m->n, m->k, m->g, threads, sk); break;
    case DS_Q1: ds_gemv_q1(m->w, m->s, x, y, m->n, m->k, m->g, threads, sk); break;
    case DS_BLOCKS:
    case DS_BLOCKS_VNNI: blocks(m, x, y, 1, threads); break;
    case DS_PARTS: parts(m, x, y, 1, threads); break;
    default: abort();  // a kind this build lacks (a VNNI plan on a build without it): never guess
  }
}

// x [rows, k] -> y [rows, n] with the kernel the layered path takes for a decode step of `rows`
// rows (layers/linear.linear, quant/linear.quant_linear): bf16, int8 and 4-bit affine stream the
// weight once for all rows, q1 runs one GEMV per row. The plan caps rows where those
// paths would switch to dequantize + GEMM (ops/decode_step._rows_limit).
static void matmat(const DsMat* m, const float* x, float* y, long rows, int threads) {
  if (rows == 1) {
    matvec(m, x, y, threads);
  } else if (m->kind == DS_BLOCKS || m->kind == DS_BLOCKS_VNNI) {
    blocks(m, x, y, rows, threads);
  } else if (m->kind == DS_PARTS) {
    parts(m, x, y, rows, threads);
  } else if (m->kind == DS_BF16) {
    ds_gemm_bf16(m->w, x, y, rows, m->n, m->k, threads);
  } else if (m->kind == DS_Q8) {
    ds_gemm_q8(m->w, m->s, x, y, rows, m->n, m->k, m->g, threads, m->scale_kind);
  } else if (m->kind == DS_A4) {
    ds_gemm_a4(m->w, m->s, m->b, x, y, rows, m->n, m->k, m->g, threads, m->scale_kind);
#if DS_Q8_ACT
  } else if (m->kind == DS_Q8_VNNI) {
    ds_gemm_q8_vnni(m->w, m->s, x, y, rows, m->n, m->k, m->g, threads, m->scale_kind);
#endif
#if DS_X86_ACT
  } else if (m->kind == DS_A4_VNNI) {
    ds_gemm_a4_vnni(m->w, m->s, m->b, x, y, rows, m->n, m->k, m->g, threads, m->scale_kind);
#endif
  } else {
    for (long r = 0; r < rows; r++) matvec(m, x + r * m->k, y + r * m->n, threads);
  }
}

// NeoX rotate-half on the first R dims; cos/sin [R] hold their halves repeated (layers/rotary.py).
// x*cos and r*sin rounded apart, then added, bit for bit as torch's three ops: the volatile
// products cannot be contracted into an FMA by any compiler (a handful of values per head).
static void rope(float* x, const float* cos, const float* sin, long R) {
  const long half = R / 2;
  for (long i = 0; i < half; i++) {
    const float lo = x[i], hi = x[i + half];
    volatile float a = lo * cos[i], b = (-hi) * sin[i];
    volatile float c = hi * cos[i + half], d = lo * sin[i + half];
    x[i] = a + b;
    x[i + half] = c + d;
  }
}

// One query head over positions [0, len) of its KV head's blocks: softmax(q.k * scale) . v
static void attend_head(const float* q, const float* k_pool, const float* v_pool, const long* table,
                        long len, long kvh, long HKV, long D, long BL, float scale, float* scores,
                        float* o) {
  float best = -INFINITY, total = 0.f;
  for (long p = 0; p < len; p++) {
    const long off = ((table[p / BL] * HKV + kvh) * BL + p % BL) * D;
    scores[p] = dot_f32(q, k_pool + off, D) * scale;
    if (scores[p] > best) best = scores[p];
  }
  for (long d = 0; d < D; d++) o[d] = 0.f;
  for (long p = 0; p < len; p++) {
    const float e = expf(scores[p] - best);
    const float* v = v_pool + ((table[p / BL] * HKV + kvh) * BL + p % BL) * D;
    total += e;
    for (long d = 0; d < D; d++) o[d] += e * v[d];
  }
  for (long d = 0; d < D; d++) o[d] /= total;
}

// Decode-style attention rows (the layered path's decode and draft-verify rows, and this file's
// step): row r's q [HQ,D] (row stride q_stride) attends to positions [0, lengths[r]) of the blocks
// in tables[r] (row stride table_stride); out[r] [HQ*D] = softmax(q.k*scale) . v * sigmoid(gate)
// with gate [HQ,D] at head stride gate_head_stride (per-head [query D | gate D] projections).
void ds_attend_rows(const float* q, long q_stride, const float* gate, long gate_stride,
                    long gate_head_stride, const float* k_pool, const float* v_pool,
                    const long* tables, long table_stride, const long* lengths, float* out,
                    long rows, long HQ, long HKV, long D, long BL, float scale, int threads) {
  long max_len = 1;
  for (long r = 0; r < rows; r++) max_len = lengths[r] > max_len ? lengths[r] : max_len;
  float* scores = malloc(sizeof(float) * max_len * rows * HQ);
  if (scores == NULL) abort();  // out of memory: stop rather than write through NULL
  const long group = HQ / HKV;
#pragma omp parallel for num_threads(threads) collapse(2) schedule(static) \
    if (max_len * rows * HQ > 4096)
  for (long r = 0; r < rows; r++) {
    for (long h = 0; h < HQ; h++) {
      float* o = out + r * HQ * D + h * D;
      attend_head(q + r * q_stride + h * D, k_pool, v_pool, tables + r * table_stride, lengths[r],
                  h / group, HKV, D, BL, scale, scores + (r * HQ + h) * max_len, o);
      const float* g = gate + r * gate_stride + h * gate_head_stride;
      for (long d = 0; d < D; d++) o[d] *= 1.f / (1.f + expf(-g[d]));
    }
  }
  free(scores);
}

// silu(gate) * up for rows of the packed gate|up output [rows, 2I] -> [rows, I]
void ds_silu_mul(const float* gu, float* out, long rows, long I) {
  for (long r = 0; r < rows; r++) {
    const float* g = gu + r * 2 * I;
    for (long j = 0; j < I; j++) out[r * I + j] = g[j] / (1.f + expf(-g[j])) * g[I + j];
  }
}

// Row r's proj (row stride P) = [per head (query D | gate D)] x HQ | k HKV*D | v HKV*D -> out[r]
// [HQ*D]; the K/V of positions[r] are stored through its table (row stride table_stride) first.
static void attention(const DsModel* m, const DsLayer* L, const float* proj, long P, float* qk,
                      float* out, long rows, const long* positions, const long* tables,
                      long table_stride, const float* cos, const float* sin, long* lengths,
                      int threads) {
  const long HQ = m->hq, HKV = m->hkv, D = m->head_dim, BL = m->block_len, R = m->rot_dim;
  const long QK = (HQ + HKV) * D;
  for (long r = 0; r < rows; r++) {
    const float* pr = proj + r * P;
    const float *c = cos + r * R, *sn = sin + r * R;
    float *q = qk + r * QK, *k = q + HQ * D;
    const float* v = pr + 2 * HQ * D + HKV * D;
    for (long h = 0; h < HQ; h++) {
      ds_rmsnorm(pr + h * 2 * D, L->q_norm, q + h * D, 1, D, m->eps, 1.f, 1);
      rope(q + h * D, c, sn, R);
    }
    ds_rmsnorm(pr + 2 * HQ * D, L->k_norm, k, HKV, D, m->eps, 1.f, 1);
    const long pos = positions[r], blk = tables[r * table_stride + pos / BL], row = pos % BL;
    lengths[r] = pos + 1;
    for (long h = 0; h < HKV; h++) {
      rope(k + h * D, c, sn, R);
      memcpy(L->k_pool + ((blk * HKV + h) * BL + row) * D, k + h * D, sizeof(float) * D);
      memcpy(L->v_pool + ((blk * HKV + h) * BL + row) * D, v + h * D, sizeof(float) * D);
    }
  }
  ds_attend_rows(qk, QK, proj + D, P, 2 * D, L->k_pool, L->v_pool, tables, table_stride, lengths,
                 out, rows, HQ, HKV, D, BL, m->attn_scale, threads);
}

// The GDN steps of a decode step (spec/rollback.py): steps [0, first_verify) are decode rows,
// the others draft verification, token j of every verify chunk in step first_verify + j. Per GDN
// layer li (NULL where not wanted): before[li] the conv windows then states of the first verify
// step's slots, copied before it ("recompute" rollback); inputs[li] every verify step's gathered
// in-projection rows (qkv|z|b|a blocks), step after step ("recompute"); kept[li] the windows then
// states after each verify step but the last, step after step ("keep").
typedef struct {
  long num_steps, first_verify;
  const long* start;  // [num_steps + 1]: step j's members are [start[j], start[j + 1])
  const long* rows;  // each member's flat row in the step
  const long* slots;  // its state-pool slot
  float** before;
  float** inputs;
  float** kept;
} DsSteps;

static void copy_slots(float* dst, const float* pool, const long* slots, long n, long size) {
  for (long r = 0; r < n; r++) memcpy(dst + r * size, pool + slots[r] * size, sizeof(float) * size);
}

// One step's member rows of proj [C | V | HV | HV] (row stride P) -> contiguous qkv, z, b, a
// blocks in buf (what the GDN decode kernel takes).
static void gather(const float* proj, long P, const long* rows, long n, long C, long VD, long HV,
                   float* buf) {
  float *qkv = buf, *z = qkv + n * C, *b = z + n * VD, *a = b + n * HV;
  for (long r = 0; r < n; r++) {
    const float* pr = proj + rows[r] * P;
    memcpy(qkv + r * C, pr, sizeof(float) * C);
    memcpy(z + r * VD, pr + C, sizeof(float) * VD);
    memcpy(b + r * HV, pr + C + VD, sizeof(float) * HV);
    memcpy(a + r * HV, pr + C + VD + HV, sizeof(float) * HV);
  }
}

// Every step of layer li in order: gather its rows, step their slots' states (in place), scatter
// the outputs to out [rows, HV*V]; the rollback's copies where asked.
static void gdn(const DsModel* m, const DsLayer* L, long li, const float* proj, long P,
                float* split, float* step_out, float* out, const DsSteps* st, int threads) {
  const long VD = m->hv * m->dv, C = 2 * m->hk * m->dk + VD, HV = m->hv, G = C + VD + 2 * HV;
  const long CW = C * (m->conv_width - 1), S = HV * m->dk * m->dv;
  const long v0 = st->start[st->first_verify];  // the first verify member
  float* before = st->before ? st->before[li] : NULL;
  float* inputs = st->inputs ? st->inputs[li] : NULL;
  float* kept = st->kept ? st->kept[li] : NULL;
  for (long j = 0; j < st->num_steps; j++) {
    const long s0 = st->start[j], n = st->start[j + 1] - s0, verify = j >= st->first_verify;
    const long *rows = st->rows + s0, *slots = st->slots + s0;
    float* buf = verify && inputs ? inputs + (s0 - v0) * G : split;
    gather(proj, P, rows, n, C, VD, HV, buf);
    if (verify && before && j == st->first_verify) {
      copy_slots(before, L->conv_pool, slots, n, CW);
      copy_slots(before + n * CW, L->state_pool, slots, n, S);
    }
    ds_gdn_decode_slots(buf, buf + n * C, buf + n * (C + VD), buf + n * (C + VD + HV),
                        L->conv_pool, L->conv_w, L->a_log, L->dt_bias, L->state_pool, L->gnorm_w,
                        step_out, slots, n, m->hk, HV, m->dk, m->dv, m->conv_width, m->eps,
                        threads);
    for (long r = 0; r < n; r++) memcpy(out + rows[r] * VD, step_out + r * VD, sizeof(float) * VD);
    if (verify && kept && j + 1 < st->num_steps) {
      float* dst = kept + (s0 - v0) * (CW + S);
      copy_slots(dst, L->conv_pool, slots, n, CW);
      copy_slots(dst + n * CW, L->state_pool, slots, n, S);
    }
  }
}

static void add_into(float* x, const float* t, long n) {
  for (long i = 0; i < n; i++) x[i] += t[i];
}

typedef struct {  // a decode step's scratch, `rows` rows of each
  float *h, *t, *proj, *o, *qk, *gu, *act, *split, *step_out;
  long* lengths;
} DsWork;

// The scratch layout for `rows` rows, carved from `base` (NULL: only counted); returns the floats
// it takes.
static long carve(const DsModel* m, long rows, float* base, DsWork* w) {
  const long N = m->hidden, D = m->head_dim, VD = m->hv * m->dv, AD = m->hq * D;
  const long gdn = 2 * m->hk * m->dk + 2 * VD + 2 * m->hv, att = 2 * AD + 2 * m->hkv * D;
  // lengths (longs) first, so that they stay 8-byte aligned
  const long sizes[10] = {2, N, N, gdn > att ? gdn : att, AD > VD ? AD : VD, AD + m->hkv * D,
                          2 * m->inter, m->inter, gdn, VD};
  float** slots[10] = {(float**)&w->lengths, &w->h, &w->t, &w->proj, &w->o, &w->qk, &w->gu,
                       &w->act, &w->split, &w->step_out};
  long used = 0;
  for (int i = 0; i < 10; i++) {
    if (base != NULL) *slots[i] = base + used;
    used += sizes[i] * rows;
  }
  return used;
}

// work: at least ds_decode_work_floats(m, rows) floats
long ds_decode_work_floats(const DsModel* m, long rows) {
  DsWork unused;
  return carve(m, rows, NULL, &unused);
}

// A step of `rows` decode rows: one token of each decode sequence, every token of each verify
// chunk. x [rows, hidden]: the input embeddings in, the final-normed hidden states out. The GDN
// layers step the pool slots as `steps` says; attention stores the K/V of positions[r] via row r's
// KV blocks tables[r * table_stride ...] and attends over [0, positions[r]]; cos/sin
// [rows, rot_dim] are the positions' rotary tables.
void ds_decode_rows(const DsModel* m, const DsLayer* layers, float* x, long rows,
                    const DsSteps* steps, const long* positions, const long* tables,
                    long table_stride, const float* cos, const float* sin, float* work,
                    int threads) {
  const long N = m->hidden, I = m->inter;
  DsWork w;
  carve(m, rows, work, &w);
  for (long i = 0; i < m->num_layers; i++) {
    const DsLayer* L = layers + i;
    const long P = L->mix_in.n;
    ds_rmsnorm(x, L->in_norm, w.h, rows, N, m->eps, 1.f, 1);
    matmat(&L->mix_in, w.h, w.proj, rows, threads);
    if (L->is_full) {
      attention(m, L, w.proj, P, w.qk, w.o, rows, positions, tables, table_stride, cos, sin,
                w.lengths, threads);
    } else {
      gdn(m, L, i, w.proj, P, w.split, w.step_out, w.o, steps, threads);
    }
    matmat(&L->mix_out, w.o, w.t, rows, threads);
    add_into(x, w.t, rows * N);
    ds_rmsnorm(x, L->post_norm, w.h, rows, N, m->eps, 1.f, 1);
    matmat(&L->gate_up, w.h, w.gu, rows, threads);
    ds_silu_mul(w.gu, w.act, rows, I);
    matmat(&L->down, w.act, w.t, rows, threads);
    add_into(x, w.t, rows * N);
  }
  ds_rmsnorm(x, m->final_norm, w.h, rows, N, m->eps, 1.f, 1);
  memcpy(x, w.h, sizeof(float) * rows * N);
}
