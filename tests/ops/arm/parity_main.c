// The CPU kernels' entry points driven from files, for tests/ops/test_arm_parity.py: built for
// aarch64 with the kernels (NEON, or scalar with -DDS_NO_NEON) and run under qemu-user, so the
// ARM vector paths are checked against the torch references on an x86 machine.
//   parity_main OP N K G TYPE DIR   reads DIR/{w,s,b,x}.bin (those OP uses), writes DIR/y.bin
// OP: bf16 | q8 | a4 | q1 | blocks (TYPE: the block kind's id, M = 1 row of x) | q8a (int8
// activations: ds_gemv_q8_vnni) | q8am (ds_gemm_q8_vnni on TYPE rows of x; y holds TYPE rows).
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void ds_gemv_bf16(const void* w, const float* x, float* y, long N, long K, int num_threads);
void ds_gemv_q8(const void* w, const void* s, const float* x, float* y, long N, long K, long G,
                int num_threads, int scale_kind);
void ds_gemv_a4(const void* w, const void* s, const void* b, const float* x, float* y, long N,
                long K, long G, int num_threads, int scale_kind);
void ds_gemv_q1(const void* w, const void* s, const float* x, float* y, long N, long K, long G,
                int num_threads, int scale_kind);
// only in builds with the dot-product extension (gemv_q8_sdot.c): weak, NULL elsewhere
__attribute__((weak)) void ds_gemv_q8_vnni(const void* w, const void* s, const float* x, float* y,
                                           long N, long K, long G, int num_threads, int scale_kind);
__attribute__((weak)) void ds_gemm_q8_vnni(const void* w, const void* s, const float* x, float* y,
                                           long M, long N, long K, long G, int num_threads,
                                           int scale_kind);
void ds_gemm_blocks(int type, const void* w, const float* x, float* y, long M, long N, long K,
                    int num_threads);
int ds_simd_isa(void);

static void* slurp(const char* dir, const char* name) {
  char path[4096];
  snprintf(path, sizeof path, "%s/%s", dir, name);
  FILE* f = fopen(path, "rb");
  if (!f) return NULL;
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  void* p = malloc(n ? n : 1);
  if (fread(p, 1, n, f) != (size_t)n) exit(3);
  fclose(f);
  return p;
}

int main(int argc, char** argv) {
  if (argc == 2 && !strcmp(argv[1], "isa")) {
    printf("%d\n", ds_simd_isa());
    return 0;
  }
  if (argc != 7) return 2;
  const char* op = argv[1];
  long N = atol(argv[2]), K = atol(argv[3]), G = atol(argv[4]);
  int type = atoi(argv[5]);
  const char* dir = argv[6];
  void *w = slurp(dir, "w.bin"), *s = slurp(dir, "s.bin"), *b = slurp(dir, "b.bin");
  float* x = slurp(dir, "x.bin");
  const long rows = !strcmp(op, "q8am") ? type : 1;
  if (!strncmp(op, "q8a", 3) && ds_gemm_q8_vnni == NULL) return 4;  // not in this build
  float* y = calloc(N * rows, sizeof(float));
  if (!strcmp(op, "bf16")) ds_gemv_bf16(w, x, y, N, K, 1);
  else if (!strcmp(op, "q8")) ds_gemv_q8(w, s, x, y, N, K, G, 1, 0);
  else if (!strcmp(op, "a4")) ds_gemv_a4(w, s, b, x, y, N, K, G, 1, 0);
  else if (!strcmp(op, "q1")) ds_gemv_q1(w, s, x, y, N, K, G, 1, 0);
  else if (!strcmp(op, "blocks")) ds_gemm_blocks(type, w, x, y, 1, N, K, 1);
  else if (!strcmp(op, "q8a")) ds_gemv_q8_vnni(w, s, x, y, N, K, G, 1, 0);
  else if (!strcmp(op, "q8am")) ds_gemm_q8_vnni(w, s, x, y, rows, N, K, G, 1, 0);
  else return 2;
  char path[4096];
  snprintf(path, sizeof path, "%s/y.bin", dir);
  FILE* f = fopen(path, "wb");
  fwrite(y, sizeof(float), N * rows, f);
  fclose(f);
  return 0;
}
