// Issue 4 experiment (scripts/gpu/ws_chain.py): a chain of int8 GEMVs (group 64, fp32 scales,
// y = W x with W [N, K] row-major codes) as ONE persistent kernel, warp-specialised.
//
// One CTA per SM. The last warp is the producer: one lane streams this CTA's weight chunks
// (R_p consecutive rows of GEMV p: codes and scales are each one contiguous range, so one bulk
// copy each, cp.async.bulk into a ring of STAGES shared-memory slots, mbarrier-tracked) for every
// GEMV of the chain in order, never waiting on the grid: weights are static. The consumer warps,
// per GEMV: wait at the grid barrier until every CTA finished GEMV p-1 (a counter; its output is
// this GEMV's x), copy x into shared memory, then per chunk of theirs wait for its slot, dot its
// rows with x, free the slot, store y; then arrive. So DRAM keeps streaming while the consumers
// wait at barriers, up to the ring's size (the Triton persistent kernel could only hold the next
// tile in registers, and spilled).
//
// A chunk is rows x K: each warp item is one row's 512-column segment; lane l reads the codes
// at columns 128 j + 4 l (j = 0..3, one 32-bit word each) and x there (one float4): both
// conflict-free in shared memory. Group 64 = 16 lanes x 4 codes, so a lane's word j belongs to
// group 8 seg + 2 j + l / 16.
// No headers: NVRTC has no standard library here (same-type typedefs may repeat one).
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
typedef signed char int8_t;

#ifndef NUM_STAGES
#define NUM_STAGES 10
#endif
#ifndef CW
#define CW 8
#endif
// MODE bits (time attribution; results of any bit set are wrong by design and not checked): 1
// consumers skip the dot (slots still waited for and freed); 2 no grid-barrier wait (V1) / the
// tags polled once, not waited for (V2); 4 no fence before the arrival (V1; V2 has no fence).
#ifndef MODE
#define MODE 0
#endif
// V2 1: the handoff as tagged words (each y value stored with its step's tag in one 8-byte word,
// as NCCL's LL protocol does; the next GEMV's consumers poll the x words they need: no fence, no
// counter) and the dot a row per warp (one shuffle reduction per row, two segments in flight,
// slots freed per warp). V2 2: as 1, with a CTA's chunks taken two at a time (pair_rows) and the
// polls reloading only the words still missing. 0: the counter barrier and per-segment items
// (the header above describes V1's consumers). ws_chain.py's "V2 3" is V2 2 in 16 KB slots.
#ifndef V2
#define V2 0
#endif
// POLL_NS: nanoseconds a tagged-word poll sleeps before polling again (0: none)
#ifndef POLL_NS
#define POLL_NS 0
#endif
#ifndef CODES_BYTES
#define CODES_BYTES 16384
#endif
#ifndef SCALES_BYTES
#define SCALES_BYTES 1024
#endif

struct Phase {
  const int8_t* w;  // this GEMV's codes [n, k]
  const float* s;   // scales [n, k / 64]
  const float* x;   // input [k]
  float* y;         // output [n]
  int n, k, r, pad; // rows, columns, rows per chunk
};

constexpr int CODES_MAX = CODES_BYTES;
constexpr int SCALES_MAX = SCALES_BYTES;
constexpr int STAGE_BYTES = CODES_MAX + SCALES_MAX;
constexpr int X_MAX = 4096;
constexpr int SEG = 512;
constexpr int G = 64;
constexpr int MAX_ITEMS = 64;
constexpr unsigned SPIN_LIMIT = 1u << 20;

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count));
}

__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)),
               "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}

// Bounded: a wait that never completes sets flag[0] and returns (a wrong result, flagged, not
// a hung device).
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity, unsigned* flag) {
  uint32_t done = 0;
  for (unsigned t = 0; t < SPIN_LIMIT; ++t) {
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; "
        "selp.u32 %0, 1, 0, p; }"
        : "=r"(done)
        : "r"(smem_u32(bar)), "r"(parity)
        : "memory");
    if (done) return;
  }
  atomicExch(flag, 1u);
}

__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes,
                                          uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::
          "r"(smem_u32(dst)),
      "l"(src), "r"(bytes), "r"(smem_u32(bar))
      : "memory");
}

__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void consumer_sync() {
  asm volatile("bar.sync 1, %0;" ::"n"(CW * 32) : "memory");
}

// 2**23 + 128 + q as fp32 from byte i of (word ^ 0x80808080), minus that offset: the code q.
__device__ __forceinline__ float code_at(uint32_t t, uint32_t sel) {
  uint32_t f;
  asm("prmt.b32 %0, %1, 0x4B000000, %2;" : "=r"(f) : "r"(t), "r"(sel));
  return __uint_as_float(f) - 8388736.0f;
}

__device__ __forceinline__ float dot4(uint32_t word, float4 x) {
  uint32_t t = word ^ 0x80808080u;
  float acc = code_at(t, 0x7540) * x.x;
  acc = fmaf(code_at(t, 0x7541), x.y, acc);
  acc = fmaf(code_at(t, 0x7542), x.z, acc);
  return fmaf(code_at(t, 0x7543), x.w, acc);
}

__device__ void produce(const Phase* phases, int num_phases, unsigned char* stages,
                        uint64_t* full, uint64_t* empty, unsigned* flag) {
  int it = 0;
  for (int p = 0; p < num_phases; ++p) {
    const Phase ph = phases[p];
    const int chunks = (ph.n + ph.r - 1) / ph.r, ng = ph.k / G;
    for (int c = blockIdx.x; c < chunks; c += gridDim.x, ++it) {
      const int slot = it % NUM_STAGES;
      if (it >= NUM_STAGES) mbar_wait(&empty[slot], ((it / NUM_STAGES) - 1) & 1, flag);
      const int r0 = c * ph.r, rows = min(ph.r, ph.n - r0);
      const uint32_t cb = rows * ph.k, sb = rows * ng * 4;
      unsigned char* dst = stages + slot * STAGE_BYTES;
      mbar_expect_tx(&full[slot], cb + sb);
      bulk_copy(dst, ph.w + static_cast<size_t>(r0) * ph.k, cb, &full[slot]);
      bulk_copy(dst + CODES_MAX, ph.s + static_cast<size_t>(r0) * ng, sb, &full[slot]);
    }
  }
}

// One chunk's rows dotted with xs; partial sums per (row, segment) into part; returns nothing:
// the caller syncs, frees the slot and reduces.
__device__ __forceinline__ void chunk_items(const unsigned char* codes, const float* sc,
                                            const float* xs, float* part, int rows, int k,
                                            int ng, int warp, int lane) {
  const int segs = k / SEG, items = rows * segs;
  for (int item = warp; item < items; item += CW) {
    const int row = item / segs, seg = item % segs;
    const unsigned char* rc = codes + row * k + seg * SEG + 4 * lane;
    const float* rx = xs + seg * SEG + 4 * lane;
    const float* rs = sc + row * ng + seg * (SEG / G) + (lane >> 4);
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t word = *reinterpret_cast<const uint32_t*>(rc + 128 * j);
      const float4 x = *reinterpret_cast<const float4*>(rx + 128 * j);
      acc = fmaf(dot4(word, x), rs[2 * j], acc);
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (lane == 0) part[item] = acc;
  }
}

__device__ void consume(const Phase* phases, int num_phases, unsigned char* stages, float* xs,
                        float* part, uint64_t* full, uint64_t* empty, unsigned* counter) {
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  int it = 0;
  for (int p = 0; p < num_phases; ++p) {
    const Phase ph = phases[p];
    const int chunks = (ph.n + ph.r - 1) / ph.r, ng = ph.k / G, segs = ph.k / SEG;
    if (p > 0 && !(MODE & 2)) {  // grid barrier: every CTA has stored its rows of GEMV p - 1
      if (tid == 0) {
        const unsigned target = gridDim.x * p;
        unsigned t = 0;
        while (ld_acquire(counter) < target) {
          if (++t > SPIN_LIMIT) {
            atomicExch(counter + 1, 1u);
            break;
          }
        }
      }
      consumer_sync();
    }
    for (int i = tid; i < ph.k / 4; i += CW * 32)
      reinterpret_cast<float4*>(xs)[i] = __ldcg(reinterpret_cast<const float4*>(ph.x) + i);
    consumer_sync();
    for (int c = blockIdx.x; c < chunks; c += gridDim.x, ++it) {
      const int slot = it % NUM_STAGES;
      mbar_wait(&full[slot], (it / NUM_STAGES) & 1, counter + 1);
      const unsigned char* codes = stages + slot * STAGE_BYTES;
      const int r0 = c * ph.r, rows = min(ph.r, ph.n - r0);
      float* pp = part + (it & 1) * MAX_ITEMS;
      if (!(MODE & 1))
        chunk_items(codes, reinterpret_cast<const float*>(codes + CODES_MAX), xs, pp, rows, ph.k,
                    ng, warp, lane);
      consumer_sync();
      if (tid == 0) mbar_arrive(&empty[slot]);
      if (tid < rows) {
        float y = 0.0f;
        for (int s = 0; s < segs; ++s) y += pp[tid * segs + s];
        ph.y[r0 + tid] = y;
      }
    }
    consumer_sync();  // this CTA's stores of GEMV p precede its arrival
    if (tid == 0) {
      if (!(MODE & 4)) __threadfence();
      atomicAdd(counter, 1u);
    }
  }
}


__device__ __forceinline__ unsigned long long ld_relaxed_b64(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.relaxed.gpu.global.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_relaxed_b64(unsigned long long* p, unsigned long long v) {
  asm volatile("st.relaxed.gpu.global.b64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// One row's dot with xs: lane l takes the words at 128 j + 4 l of every 512-column segment, two
// segments in flight; one shuffle reduction. Every lane returns the row's sum.
__device__ __forceinline__ float row_dot(const unsigned char* rc, const float* rs, const float* xs,
                                         int segs, int lane) {
  float acc0 = 0.0f, acc1 = 0.0f;
  int seg = 0;
  for (; seg + 1 < segs; seg += 2) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int c0 = seg * SEG + 128 * j + 4 * lane, g0 = seg * (SEG / G) + 2 * j + (lane >> 4);
      const uint32_t w0 = *reinterpret_cast<const uint32_t*>(rc + c0);
      const uint32_t w1 = *reinterpret_cast<const uint32_t*>(rc + c0 + SEG);
      const float4 x0 = *reinterpret_cast<const float4*>(xs + c0);
      const float4 x1 = *reinterpret_cast<const float4*>(xs + c0 + SEG);
      acc0 = fmaf(dot4(w0, x0), rs[g0], acc0);
      acc1 = fmaf(dot4(w1, x1), rs[g0 + SEG / G], acc1);
    }
  }
  if (seg < segs) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int c0 = seg * SEG + 128 * j + 4 * lane, g0 = seg * (SEG / G) + 2 * j + (lane >> 4);
      acc0 = fmaf(dot4(*reinterpret_cast<const uint32_t*>(rc + c0),
                       *reinterpret_cast<const float4*>(xs + c0)), rs[g0], acc0);
    }
  }
  float acc = acc0 + acc1;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  return acc;
}

// x of GEMV p > 0 from the tagged words GEMV p - 1 wrote: every thread loads all of its words at
// once, and polls again until each carries the tag (one L2 round trip per poll).
__device__ __forceinline__ void load_tagged_x(const unsigned long long* src, unsigned tag, int k,
                                              float* xs, unsigned* flag) {
  constexpr int PER = X_MAX / (CW * 32);
  unsigned long long v[PER];
  unsigned missing = 0;  // V2 2 polls again only the words still missing
#pragma unroll
  for (int j = 0; j < PER; ++j)
    if (threadIdx.x + j * CW * 32 < k) missing |= 1u << j;
  const unsigned active = missing;
  for (unsigned t = 0; missing; ++t) {
    const unsigned want = V2 >= 2 ? missing : active;  // V2 1 reloads every word per poll
#pragma unroll
    for (int j = 0; j < PER; ++j)  // predicated on `want`, fixed per poll: loads in parallel
      if (want & (1u << j)) v[j] = ld_relaxed_b64(src + threadIdx.x + j * CW * 32);
#pragma unroll
    for (int j = 0; j < PER; ++j)
      if ((want & (1u << j)) && static_cast<unsigned>(v[j] >> 32) == tag) missing &= ~(1u << j);
    if (MODE & 2) break;  // timing only: no wait for the tags (x may be stale)
    if (missing && POLL_NS) __nanosleep(POLL_NS);
    if (t > SPIN_LIMIT) {
      atomicExch(flag, 1u);
      break;
    }
  }
#pragma unroll
  for (int j = 0; j < PER; ++j) {
    const int i = threadIdx.x + j * CW * 32;
    if (i < k) xs[i] = __uint_as_float(static_cast<unsigned>(v[j]));
  }
}

// Two rows' dots (rows of one chunk or of two), interleaved: two independent chains per lane.
__device__ __forceinline__ float2 row_dot2(const unsigned char* ra, const float* sa,
                                           const unsigned char* rb, const float* sb,
                                           const float* xs, int segs, int lane) {
  float acc0 = 0.0f, acc1 = 0.0f;
  for (int seg = 0; seg < segs; ++seg) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int c0 = seg * SEG + 128 * j + 4 * lane, g0 = seg * (SEG / G) + 2 * j + (lane >> 4);
      const float4 x = *reinterpret_cast<const float4*>(xs + c0);
      acc0 = fmaf(dot4(*reinterpret_cast<const uint32_t*>(ra + c0), x), sa[g0], acc0);
      acc1 = fmaf(dot4(*reinterpret_cast<const uint32_t*>(rb + c0), x), sb[g0], acc1);
    }
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    acc0 += __shfl_xor_sync(0xffffffffu, acc0, off);
    acc1 += __shfl_xor_sync(0xffffffffu, acc1, off);
  }
  return make_float2(acc0, acc1);
}

// V2 2: this CTA's chunks of a GEMV two at a time; warp w takes rows w and w + CW of the pair's
// rows (the first chunk's, then the second's), so 16 warps have work even on 8-row chunks.
__device__ __forceinline__ void pair_rows(const Phase& ph, unsigned char* stages, const float* xs,
                                          uint64_t* full, uint64_t* empty, unsigned* flag,
                                          unsigned long long* out, unsigned long long tag,
                                          int it, int c, bool two, int warp, int lane) {
  const int ng = ph.k / G, segs = ph.k / SEG;
  const int slot_a = it % NUM_STAGES, slot_b = (it + 1) % NUM_STAGES;
  mbar_wait(&full[slot_a], (it / NUM_STAGES) & 1, flag);
  if (two) mbar_wait(&full[slot_b], ((it + 1) / NUM_STAGES) & 1, flag);
  const int r0a = c * ph.r, rows_a = min(ph.r, ph.n - r0a);
  const int r0b = r0a + gridDim.x * ph.r, rows_b = two ? min(ph.r, ph.n - r0b) : 0;
  const unsigned char* ca = stages + slot_a * STAGE_BYTES;
  const unsigned char* cb = stages + slot_b * STAGE_BYTES;
  for (int item = warp; item < rows_a + rows_b; item += 2 * CW) {
    const bool has2 = item + CW < rows_a + rows_b;
    const int other = has2 ? item + CW : item;  // a repeat of the row when there is no second
    const unsigned char* base[2];
    int row[2];
    const int items[2] = {item, other};
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const bool in_a = items[h] < rows_a;
      base[h] = in_a ? ca : cb;
      row[h] = in_a ? items[h] : items[h] - rows_a;
    }
    const float2 y = (MODE & 1) ? make_float2(0.0f, 0.0f)
        : row_dot2(base[0] + row[0] * ph.k,
                   reinterpret_cast<const float*>(base[0] + CODES_MAX) + row[0] * ng,
                   base[1] + row[1] * ph.k,
                   reinterpret_cast<const float*>(base[1] + CODES_MAX) + row[1] * ng, xs, segs,
                   lane);
    if (lane == 0) {
#pragma unroll
      for (int h = 0; h < (has2 ? 2 : 1); ++h) {
        const float v = h ? y.y : y.x;
        const int r = (items[h] < rows_a ? r0a : r0b) + row[h];
        ph.y[r] = v;
        st_relaxed_b64(out + r, tag | __float_as_uint(v));
      }
    }
  }
  __syncwarp();
  if (lane == 0) {
    mbar_arrive(&empty[slot_a]);
    if (two) mbar_arrive(&empty[slot_b]);
  }
}

__device__ void consume_v2(const Phase* phases, int num_phases, unsigned char* stages, float* xs,
                           uint64_t* full, uint64_t* empty, unsigned* counter,
                           unsigned long long* ll, int ll_stride, unsigned epoch) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  int it = 0;
  for (int p = 0; p < num_phases; ++p) {
    const Phase ph = phases[p];
    const int chunks = (ph.n + ph.r - 1) / ph.r, ng = ph.k / G, segs = ph.k / SEG;
    if (p == 0) {
      for (int i = threadIdx.x; i < ph.k / 4; i += CW * 32)
        reinterpret_cast<float4*>(xs)[i] = __ldcg(reinterpret_cast<const float4*>(ph.x) + i);
    } else {
      load_tagged_x(ll + static_cast<size_t>(p) * ll_stride, (epoch << 8) | p, ph.k, xs,
                    counter + 1);
    }
    consumer_sync();
    unsigned long long* out = ll + static_cast<size_t>(p + 1) * ll_stride;
    const unsigned long long tag = static_cast<unsigned long long>((epoch << 8) | (p + 1)) << 32;
    if (V2 >= 2) {
      const int mine = blockIdx.x < chunks ? (chunks - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
      for (int i = 0; i < mine; i += 2)
        pair_rows(ph, stages, xs, full, empty, counter + 1, out, tag, it + i,
                  blockIdx.x + i * gridDim.x, i + 1 < mine, warp, lane);
      it += mine;
    } else
    for (int c = blockIdx.x; c < chunks; c += gridDim.x, ++it) {
      const int slot = it % NUM_STAGES;
      mbar_wait(&full[slot], (it / NUM_STAGES) & 1, counter + 1);
      const unsigned char* codes = stages + slot * STAGE_BYTES;
      const float* sc = reinterpret_cast<const float*>(codes + CODES_MAX);
      const int r0 = c * ph.r, rows = min(ph.r, ph.n - r0);
      for (int row = warp; row < rows; row += CW) {
        const float y = (MODE & 1) ? 0.0f : row_dot(codes + row * ph.k, sc + row * ng, xs, segs,
                                                     lane);
        if (lane == 0) {
          ph.y[r0 + row] = y;  // the plain row, for the check
          st_relaxed_b64(out + r0 + row, tag | __float_as_uint(y));
        }
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(&empty[slot]);  // counted per warp (CW arrivals)
    }
    consumer_sync();  // xs is rewritten by the next GEMV
  }
}

// counter[0]: arrivals (zeroed before the launch); counter[1]: set when a bounded wait gave up.
extern "C" __global__ void __launch_bounds__((CW + 1) * 32, 1)
    ws_chain(const Phase* __restrict__ phases, int num_phases, unsigned* counter,
             unsigned long long* ll, int ll_stride, const unsigned* epoch_ptr) {
  extern __shared__ __align__(128) unsigned char smem[];
  unsigned char* stages = smem;
  float* xs = reinterpret_cast<float*>(smem + NUM_STAGES * STAGE_BYTES);
  float* part = xs + X_MAX;
  uint64_t* full = reinterpret_cast<uint64_t*>(part + 2 * MAX_ITEMS);
  uint64_t* empty = full + NUM_STAGES;
  if (threadIdx.x == 0) {
    for (int s = 0; s < NUM_STAGES; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], V2 ? CW : 1);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (threadIdx.x / 32 == CW) {
    if (threadIdx.x % 32 == 0) produce(phases, num_phases, stages, full, empty, counter + 1);
    return;
  }
#if V2
  consume_v2(phases, num_phases, stages, xs, full, empty, counter, ll, ll_stride, *epoch_ptr);
#else
  consume(phases, num_phases, stages, xs, part, full, empty, counter);
#endif
}
