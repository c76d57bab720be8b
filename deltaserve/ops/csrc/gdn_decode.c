// One fused Gated DeltaNet decode step per sequence: conv window update + SiLU, q/k L2 norm,
// decay and beta, the delta-rule state update, and the gated RMSNorm, all in fp32.
// Spec: gdn_decode_ref in ops/gdn_decode.py (tests/ops/test_gdn_decode.py checks parity).
#include <math.h>
#include <stdlib.h>
#include <string.h>
#if defined(__SSE__)
#include <xmmintrin.h>
// Flush-to-zero + denormals-are-zero for this thread: decayed states underflow into denormals,
// whose arithmetic is ~100x slower; values below 1e-38 do not matter at fp32 precision.
#define DS_FTZ() _mm_setcsr(_mm_getcsr() | 0x8040)
#else
#define DS_FTZ()
#endif

static inline float silu(float x) { return x / (1.f + expf(-x)); }
static inline float softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); }  // torch threshold

static void conv_step(const float* qkv, float* window, const float* conv_w, float* conv_out, long C, long W) {
  for (long c = 0; c < C; c++) {
    float* win = window + c * (W - 1);
    const float* w = conv_w + c * W;
    float acc = qkv[c] * w[W - 1];
    for (long t = 0; t < W - 1; t++) acc += win[t] * w[t];
    for (long t = 0; t + 1 < W - 1; t++) win[t] = win[t + 1];
    if (W > 1) win[W - 2] = qkv[c];
    conv_out[c] = silu(acc);
  }
}

static void head_step(const float* q, const float* k, const float* v, float b, float a, float a_log,
                      float dt_bias, float* S, const float* z, const float* norm_w, float* out, long K, long V,
                      float eps) {
  float qs = 0.f, ks = 0.f;
  for (long i = 0; i < K; i++) { qs += q[i] * q[i]; ks += k[i] * k[i]; }
  float qn = 1.f / sqrtf(qs + 1e-6f) / sqrtf((float)K), kn = 1.f / sqrtf(ks + 1e-6f);
  float decay = expf(-expf(a_log) * softplus(a + dt_bias));
  float beta = 1.f / (1.f + expf(-b));
  float kv[V], o[V];
  for (long j = 0; j < V; j++) kv[j] = 0.f;
  for (long i = 0; i < K; i++) {
    const float ki = k[i] * kn;
    const float* row = S + i * V;
    for (long j = 0; j < V; j++) kv[j] += row[j] * ki;
  }
  for (long j = 0; j < V; j++) { kv[j] = (v[j] - kv[j] * decay) * beta; o[j] = 0.f; }  // kv := delta
  for (long i = 0; i < K; i++) {
    const float ki = k[i] * kn, qi = q[i] * qn;
    float* row = S + i * V;
    for (long j = 0; j < V; j++) { row[j] = row[j] * decay + ki * kv[j]; o[j] += row[j] * qi; }
  }
  float ms = 0.f;
  for (long j = 0; j < V; j++) ms += o[j] * o[j];
  float r = 1.f / sqrtf(ms / (float)V + eps);
  for (long j = 0; j < V; j++) out[j] = o[j] * r * norm_w[j] * silu(z[j]);
}

// slots: row s of the batch uses window/state row slots[s] of a pool (NULL: row s); a decode batch
// then updates its sequences' pool slots in place, without a gather and a scatter of the states.
static void gdn_decode(const float* qkv, const float* z, const float* b, const float* a,
                       float* window, const float* conv_w, const float* a_log,
                       const float* dt_bias, float* state, const float* norm_w, float* out,
                       const long* slots, long B, long H, long HV, long K, long V, long W, float eps,
                       int num_threads) {
  long C = 2 * H * K + HV * V, group = HV / H;
  DS_FTZ();
  float* conv_out = (float*)malloc(sizeof(float) * C * B);
  for (long s = 0; s < B; s++) {
    long row = slots ? slots[s] : s;
    conv_step(qkv + s * C, window + row * C * (W - 1), conv_w, conv_out + s * C, C, W);
  }
#pragma omp parallel num_threads(num_threads)
  {
  DS_FTZ();
#pragma omp for schedule(static) collapse(2)
  for (long s = 0; s < B; s++) {
    for (long h = 0; h < HV; h++) {
      const float* co = conv_out + s * C;
      long kh = h / group, row = slots ? slots[s] : s;
      head_step(co + kh * K, co + H * K + kh * K, co + 2 * H * K + h * V, b[s * HV + h],
                a[s * HV + h], a_log[h], dt_bias[h], state + (row * HV + h) * K * V,
                z + s * HV * V + h * V, norm_w, out + s * HV * V + h * V, K, V, eps);
    }
  }
  }
  free(conv_out);
}

void ds_gdn_decode_slots(const float* qkv, const float* z, const float* b, const float* a,
                         float* window, const float* conv_w, const float* a_log,
                         const float* dt_bias, float* state, const float* norm_w, float* out,
                         const long* slots, long B, long H, long HV, long K, long V, long W,
                         float eps, int num_threads) {
  gdn_decode(qkv, z, b, a, window, conv_w, a_log, dt_bias, state, norm_w, out, slots, B, H, HV, K,
             V, W, eps, num_threads);
}
