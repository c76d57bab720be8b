// The int8-activation int8 GEMV / GEMM entry points (the VNNI build's symbols) for the kernels
// that compute one weight row against one activation row at a time: gemv_q8_avx2.c (AVX2) and
// gemv_q8_sdot.c (ARM SDOT). The includer defines, before including this:
//   static int shape_ok(long K, long G);            the shapes its row kernel takes
//   static void quantize_x(const float* x, int8_t* xq, float* dx, long K, long G);
//   static float row_q8(const int8_t* w, const void* s, int sk, long s0, const int8_t* xq,
//                       const float* dx, long K, long G);
// and declares ds_gemv_q8 / ds_gemm_q8 (the exact kernels other shapes take). Every row of M
// gets the bits of its GEMV: the same row_q8 on the same quantized row.
#ifndef DS_Q8_ACT_DRIVER_H
#define DS_Q8_ACT_DRIVER_H
#include <stdint.h>
#include <stdlib.h>

void ds_gemm_q8_vnni(const int8_t* w, const void* s, const float* x, float* y, long M, long N,
                     long K, long G, int num_threads, int scale_kind) {
  if (!shape_ok(K, G)) {  // the bits of a ds_gemv_q8 per row
    ds_gemm_q8(w, s, x, y, M, N, K, G, num_threads, scale_kind);
    return;
  }
  int8_t* xq = malloc(M * K);
  float* dx = malloc(sizeof(float) * M * (K / G));
  if (xq == NULL || dx == NULL) abort();  // out of memory: stop rather than write through NULL
  for (long m = 0; m < M; m++) quantize_x(x + m * K, xq + m * K, dx + m * (K / G), K, G);
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (long n = 0; n < N; n++)
    for (long m = 0; m < M; m++)
      y[m * N + n] = row_q8(w + n * K, s, scale_kind, n * (K / G), xq + m * K, dx + m * (K / G),
                            K, G);
  free(xq), free(dx);
}

void ds_gemv_q8_vnni(const int8_t* w, const void* s, const float* x, float* y, long N, long K,
                     long G, int num_threads, int scale_kind) {
  if (!shape_ok(K, G)) {
    ds_gemv_q8(w, s, x, y, N, K, G, num_threads, scale_kind);
    return;
  }
  ds_gemm_q8_vnni(w, s, x, y, 1, N, K, G, num_threads, scale_kind);
}
#endif
