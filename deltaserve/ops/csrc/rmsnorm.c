// Row-wise RMSNorm in fp32: y = x * rsqrt(mean(x^2) + eps) * (w + offset); offset 1 for the
// zero-centred (1+w) norms of Qwen3.5. Spec: rms_norm_ref in ops/norm.py; parity in tests/ops.
#include <math.h>

void ds_rmsnorm(const float* x, const float* w, float* y, long rows, long dim, float eps, float offset,
                int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (rows > 8)
  for (long r = 0; r < rows; r++) {
    const float* xr = x + r * dim;
    float* yr = y + r * dim;
    double ss = 0.0;  // double: a serial float sum drifts ~1e-6 from torch's pairwise sum
    for (long i = 0; i < dim; i++) ss += (double)xr[i] * xr[i];
    float inv = 1.f / sqrtf((float)(ss / (double)dim) + eps);
    for (long i = 0; i < dim; i++) yr[i] = xr[i] * inv * (w[i] + offset);
  }
}
