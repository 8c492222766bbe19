// The int4 decode step as one persistent kernel: every decoder layer of a GPTQ int4 model in one launch.
//
// Why. At batch 1 an int4 layer reads 4x fewer weight bytes than fp16, so the per-kernel costs that the fp16 step
// hides behind its bytes (launch, ramp-up, the split-K meeting, the tail; 3-9 us an op, measured on the H100 for the
// op-per-kernel int4 path, int4_mma.cuh) dominate: that path decodes Pythia-2.8B in ~1.6 ms against a 0.53 ms byte
// floor. Here the grid (one block per SM, launched cooperatively so that every block is resident) runs the layers'
// stages one after another, and stages meet at grid-wide barriers instead of kernel boundaries:
//   parallel residual (GPT-NeoX)  A: add + both LayerNorms, QKV and the MLP's first linear (one input sum)
//                                 B: attention (RoPE, K/V into the cache)
//                                 C: the attention output projection and the MLP's second linear
//   sequential (LLaMA, Qwen2)     A: add + norm, QKV   B: attention   C: output projection
//                                 D: add + norm, gate | up with SiLU * up   E: down projection
// The weights do not depend on the activations, so each block's producer warp streams its share of every stage's
// weights into a ring of shared-memory slots with the copy engine (one 2-D tensor copy per 32 rows x 32 columns of
// qweight, plus the group scales and zero points), running ahead across barriers as far as the ring allows: HBM
// keeps streaming while the blocks meet, normalize or attend.
//
// Work split of a linear stage. Output columns come in strips of 128 (4 column warps; gate | up: 64 gate columns
// and the same 64 up columns), K in units of 256 (32 qweight rows). The stage's units (every strip of its linears x
// every K unit, strip-major) are cut into equal runs, one per block, so every block carries the same bytes. A strip
// whose units lie in several blocks' runs is finished by the owner of its last unit, which waits for the others'
// flags and adds their partial sums (in the workspace) in block order, so the sums are deterministic; a block takes
// the strip at the end of its run first and the one at its start second, so that both blocks that share a strip
// meet early in the stage, not at its end.
//
// Arithmetic. Lane 4g + q of a column warp reads a 16-byte chunk (4 columns x 8 k of one qweight row) of the
// swizzled box and dequantizes it to the exact integers q - zero (small integers, exact in fp16 and bf16: no
// scale, 2 instructions per pair of weights), which mma.sync m16n8k16 multiplies with x in fp32; the group's scale
// multiplies the fp32 sums once per group and column, as the op-per-kernel tensor-core kernel does too (int4_mma.cuh;
// the CUDA-core and copy-engine kernels form round(scale * (q - zero)), int4_tile.cuh: dequantize_word). The result
// differs from the reference's (weights rounded to the dtype first) by that rounding only. Groups must be 64 k or more
// (a step of the mma spans 64 k, int4_tma.cuh: stage_row) or the whole of K.
//
// Attention as decode_attention.cu, per (row, kv head, query head pair, key share), with the RoPE of the current
// token's q and k done by the block itself from the raw projection (the share that comes first writes K and V into
// the cache; every share takes the current key from shared memory), so no other stage waits for the cache write.
#pragma once
#include <cuda.h>

#include "attention.cuh"  // the decode attention's online softmax
#include "int4_tma.cuh"   // the swizzled qweight boxes (stage_row), mma_16816, the mbarrier and copy wrappers

namespace patcher {
namespace {

constexpr int kStepConsumers = 8;                        // compute warps: 4 column warps x 2 halves of a unit
constexpr int kStepThreads = (kStepConsumers + 1) * 32;  // and the producer warp
constexpr int kStepMaxSlots = 16;                        // ring slots at most
constexpr int kStepBoxBytes = 32 * 128;                  // one column warp's 32 qweight rows x 32 columns
constexpr int kStepQBytes = 4 * kStepBoxBytes;           // a unit's qweight: 4 column warps
constexpr int kStepMaxHeadDim = 128;
constexpr unsigned long long kBarrierTimeoutNs = 10ull * 1000 * 1000 * 1000;  // a stuck grid barrier traps

// The attention's shared memory: the merges' (attention.cuh), and the current token's q, k, v.
struct AttnScratch {
  AttnShared merge;
  float raw[4][kStepMaxHeadDim];  // the projection's q (up to 2 heads), k, v of the current token
  float rot[4][kStepMaxHeadDim];  // the same after RoPE, rounded to the dtype
};
static_assert(kStepConsumers == kAttnWarps, "the attention runs on the compute warps");

// ---- the work split (step.cu plans with it; patcher/decode/step.py mirrors it: StageSplit) ----
// A stage's units: every strip of its first linear x its K units (strip-major), then the same for its second.
// Block b's run is [run_start(b), run_start(b + 1)): units / blocks each, one more for the first units % blocks, so
// the blocks that hold the units of a strip are consecutive (where units < blocks, the last blocks hold none).
struct StageSplit {
  int units, blocks;
  int ku0, ku1;  // K units of the two linears
  int begin1;    // the second linear's first unit
  int strips0;   // the first linear's strips

  __host__ __device__ __forceinline__ int run_start(int block) const {
    const int q = units / blocks, r = units % blocks;
    return block * q + (block < r ? block : r);
  }
  // The block whose run holds unit u.
  __host__ __device__ __forceinline__ int owner(int u) const {
    const int q = units / blocks, r = units % blocks;
    return u < r * (q + 1) ? u / (q + 1) : r + (u - r * (q + 1)) / q;
  }
  // Strips numbered over both linears.
  __host__ __device__ __forceinline__ int strip_of(int u) const {
    return u < begin1 ? u / ku0 : strips0 + (u - begin1) / ku1;
  }
  __host__ __device__ __forceinline__ int first_unit(int strip) const {
    return strip < strips0 ? strip * ku0 : begin1 + (strip - strips0) * ku1;
  }
  __host__ __device__ __forceinline__ int last_unit(int strip) const {
    return (strip < strips0 ? (strip + 1) * ku0 : begin1 + (strip + 1 - strips0) * ku1) - 1;
  }
  // A block's run [u0, u1) as pieces, each the run's units of one strip: the run's last strip first, then the rest
  // in order, so that the two blocks that share a strip both take it early in the stage.
  __host__ __device__ __forceinline__ int pieces(int u0, int u1) const {
    const int s0 = strip_of(u0), s1 = strip_of(u1 - 1);
    return s0 == s1 ? 1 : s1 - s0 + 1;
  }
  // Piece p: its strip, first unit and number of units.
  __host__ __device__ __forceinline__ int3 piece(int u0, int u1, int p) const {
    const int s0 = strip_of(u0), s1 = strip_of(u1 - 1);
    if (s0 == s1) return make_int3(s0, u0, u1 - u0);
    if (p == 0) return make_int3(s1, first_unit(s1), u1 - first_unit(s1));
    const int strip = s0 + p - 1, first = u0 > first_unit(strip) ? u0 : first_unit(strip);
    return make_int3(strip, first, last_unit(strip) + 1 - first);
  }
};

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900

// The compute warps meet at named barrier 1 (the producer warp never joins them).
__device__ __forceinline__ void consumers_sync() {
  asm volatile("bar.sync 1, %0;" ::"n"(kStepConsumers * 32) : "memory");
}

__device__ __forceinline__ float consumers_sum(float v, float* scratch) {
  v = warp_sum(v);
  consumers_sync();  // earlier readers of scratch are done
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
  consumers_sync();
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < kStepConsumers; ++w) total += scratch[w];
  return total;
}

// A value another block wrote in this launch: from L2 (the SM's L1 is not coherent with other SMs).
template <typename T>
__device__ __forceinline__ T load_cg(const T* p) {
  static_assert(sizeof(T) == 2, "16-bit element");
  const unsigned short bits = __ldcg(reinterpret_cast<const unsigned short*>(p));
  T v;
  memcpy(&v, &bits, 2);
  return v;
}

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

// A spin that has lasted kBarrierTimeoutNs traps: a stuck barrier or flag ends the launch with an error instead of
// hanging the GPU. Checked every 1024 spins.
__device__ __forceinline__ void trap_if_stuck(unsigned spins, unsigned long long start) {
  if (spins % 1024 == 0 && global_ns() - start > kBarrierTimeoutNs) __trap();
}

// Every block's compute warps arrive; the step's barriers count up from the epoch the previous launch left
// (barrier[1]), so the counter never needs resetting. One thread per block arrives (release: the block's writes
// before it, ordered by the named barrier, become visible) and polls (acquire).
__device__ void grid_barrier(unsigned long long* counter, unsigned long long target) {
  consumers_sync();
  if (threadIdx.x == 0) {
    asm volatile("red.release.gpu.global.add.u64 [%0], 1;" ::"l"(counter) : "memory");
    const unsigned long long start = global_ns();
    for (unsigned spins = 1;; ++spins) {
      unsigned long long seen;
      asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(seen) : "l"(counter) : "memory");
      if (seen >= target) break;
      trap_if_stuck(spins, start);
    }
  }
  consumers_sync();
}

__device__ __forceinline__ StageSplit stage_split(const StepStage& st, const StepLinearInfo* info) {
  StageSplit s;
  s.units = st.units;
  s.blocks = static_cast<int>(gridDim.x);
  s.ku0 = info[0].k_units;
  s.ku1 = st.num_linears > 1 ? info[1].k_units : 1;
  s.begin1 = st.num_linears > 1 ? info[1].unit_begin : st.units;
  s.strips0 = info[0].strips;
  return s;
}

// Where column warp w (0..3) of strip t reads: its segment and first column, col < 0 where the strip has none (a
// segment's last strip may be narrower). Gate | up: warps 0, 1 on gate, 2, 3 on up, for the same 64 outputs.
struct WarpCols {
  int seg, col;
};

__device__ __forceinline__ WarpCols warp_cols(const StepLinearInfo& L, int t, int w) {
  WarpCols c;
  if (L.silu) {
    c.seg = w >> 1;
    c.col = 64 * t + 32 * (w & 1);
  } else {
    c.seg = 0;
    while (c.seg + 1 < L.num_segments && t >= L.strips_before[c.seg + 1]) ++c.seg;
    c.col = (t - L.strips_before[c.seg]) * 128 + 32 * w;
  }
  if (c.col >= L.n[c.seg]) c.col = -1;
  return c;
}

__device__ __forceinline__ int segment_start(const StepLinearInfo& L, int seg) {
  int start = 0;
  for (int s = 0; s < seg; ++s) start += L.n[s];
  return start;
}

// The scalar fields of a stage's linears into shared memory (by the calling threads: one linear each).
__device__ __forceinline__ void load_infos(const StepPlan& P, const StepStage& st, StepLinearInfo* info, int tid) {
  if (tid < st.num_linears) info[tid] = P.linears[st.linear[tid]].info;
}

// ---- producer ----
// Unit (strip t, K unit ku) of linear L into a ring slot: the qweight box of each column warp the strip has, and per
// parameter box (one, or gate and up) the scales and zero points of the groups the unit meets.
__device__ void issue_unit(const StepLinear& maps, const StepLinearInfo& L, int t, int ku, unsigned char* dst,
                           uint64_t* full, bool skip) {
  const int boxes = L.silu ? 2 : 1;
  const int first_group = (ku * 256) >> L.group_shift;
  WarpCols c[4];
  unsigned bytes = static_cast<unsigned>(boxes * L.groups_per_unit * L.box_columns * 5 / 2);  // fp16 + 4 bits
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    c[w] = warp_cols(L, t, w);
    bytes += c[w].col >= 0 ? kStepBoxBytes : 0;
  }
  if (skip) {  // bounds: no copies, the slot is "full" at once
    bar_arrive(full);
    return;
  }
  bar_expect(full, bytes);
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    if (c[w].col >= 0) tensor_copy(dst + w * kStepBoxBytes, &maps.qweight[c[w].seg], c[w].col, ku * 32, full);
  }
#pragma unroll
  for (int b = 0; b < 2; ++b) {
    if (b >= boxes) break;
    const WarpCols& first = c[2 * b];  // the box's first column warp (gate | up: 0 and 2), always present
    unsigned char* p = dst + kStepQBytes + b * (L.scale_bytes + L.zero_bytes);
    tensor_copy(p, &maps.scales[first.seg], first.col, first_group, full);
    tensor_copy(p + L.scale_bytes, &maps.zeros[first.seg], first.col / 8, first_group, full);
  }
}

// The producer thread: every unit of every stage this block runs, in the consumers' order, as fast as ring slots
// come free; it never waits for a barrier.
__device__ void produce(const StepPlan& P, unsigned char* ring, uint64_t* full, uint64_t* empty, StepLinearInfo* info) {
  const int S = P.ring_slots;
  int slot = 0;
  bool wrapped = false;  // every slot has been filled once: a slot is free again once its consumers release it
  unsigned phase = 0;    // of the release a slot's next reuse waits for
  for (int si = 0; si < P.num_stages; ++si) {
    const StepStage& st = P.stages[si];
    if (st.num_linears == 0) continue;
    for (int j = 0; j < st.num_linears; ++j) load_infos(P, st, info, j);
    const StageSplit split = stage_split(st, info);
    const int u0 = split.run_start(blockIdx.x), u1 = split.run_start(blockIdx.x + 1);
    const int count = u1 > u0 ? split.pieces(u0, u1) : 0;
    for (int p = 0; p < count; ++p) {
      const int3 pc = split.piece(u0, u1, p);
      const int li = pc.x >= split.strips0 ? 1 : 0;
      const StepLinearInfo& L = info[li];
      const StepLinear& maps = P.linears[st.linear[li]];
      const int t = pc.x - li * split.strips0, ku = pc.y - split.first_unit(pc.x);
      for (int i = 0; i < pc.z; ++i) {
        if (wrapped) bar_wait(&empty[slot], phase);
        issue_unit(maps, L, t, ku + i, ring + slot * P.slot_bytes, &full[slot], P.bounds & 2);
        if (++slot == S) {
          slot = 0;
          if (wrapped) phase ^= 1u;
          wrapped = true;
        }
      }
    }
  }
}

// ---- the inputs of a linear stage, in shared memory in the mma pair order (int4_mma.cuh) ----
// 8 consecutive k as one 16-byte word of [x0 x4 x1 x5 x2 x6 x3 x7]: a lane's four B fragments in one load.
__device__ __forceinline__ uint4 pair_order(const uint4 v) {
  return make_uint4(__byte_perm(v.x, v.z, 0x5410), __byte_perm(v.x, v.z, 0x7632), __byte_perm(v.y, v.w, 0x5410),
                    __byte_perm(v.y, v.w, 0x7632));
}

template <typename T>
__device__ __forceinline__ uint4 pack_pair_order(const float (&h)[8]) {
  Vec<T, 8> v;
#pragma unroll
  for (int e = 0; e < 8; ++e) v.data[e] = from_float<T>(h[e]);
  uint4 bits;
  memcpy(&bits, &v, 16);
  return pair_order(bits);
}

// x [batch, L.k] (written by another block) into its place in the x area, zeros up to L's whole K units.
template <typename T>
__device__ __noinline__ void stage_plain(const T* x, const StepLinearInfo& L, int batch, T* area) {
  const int vectors = L.k_units * 32;
  for (int i = static_cast<int>(threadIdx.x); i < batch * vectors; i += kStepConsumers * 32) {
    const int b = i / vectors, v = i % vectors;
    uint4 word = make_uint4(0, 0, 0, 0);
    if (v * 8 < L.k)
      word = pair_order(__ldcg(reinterpret_cast<const uint4*>(x + static_cast<int64_t>(b) * L.k + v * 8)));
    *reinterpret_cast<uint4*>(area + L.x_offset + b * L.x_stride + v * 8) = word;
  }
}

// The norm stage's constant inputs copied into shared memory with cp.async while the stage before it runs (they
// were written at least a barrier earlier): the norm weights and biases [4][hidden] (those the norm has) and the
// residual stream [batch][hidden]. stage_norm waits for them.
template <typename T>
__device__ __noinline__ void prefetch_norm(const StepPlan& P, const StepStage& st, T* params) {
  const StepNorm& nd = st.nd;
  const T* sources[5] = {static_cast<const T*>(nd.weight), static_cast<const T*>(nd.bias),
                         static_cast<const T*>(nd.weight2), static_cast<const T*>(nd.bias2),
                         static_cast<const T*>(nd.resid)};
  const int vectors = P.hidden / 8;
  for (int r = 0; r < 4 + P.batch; ++r) {
    const T* src = sources[r < 4 ? r : 4];
    if (!src) continue;
    const int64_t row = r < 4 ? 0 : static_cast<int64_t>(r - 4) * P.hidden;
    for (int v = static_cast<int>(threadIdx.x); v < vectors; v += kStepConsumers * 32)
      cp_async16(params + r * P.hidden + v * 8, src + row + v * 8);
  }
  cp_async_commit();
}

// The stage's add + norm, as launch_norm computes it: s = resid + delta (+ delta2), rounded as HF's adds round;
// x0 = norm(s) (and x1 = GPT-NeoX's second LayerNorm of s); block 0 writes s as the next residual stream. Each thread
// holds its vectors of a row in registers, so the statistics cost one pass; the weights and the residual stream are
// in shared memory already (prefetch_norm, waited for at the barrier).
template <typename T>
__device__ __noinline__ void stage_norm(const StepPlan& P, const StepStage& st, const StepLinearInfo* info, T* area,
                                        const T* params, float* scratch) {
  constexpr int kPer = 4;  // vectors of 8 per thread: hidden <= 8192 (plan_step)
  const StepNorm& nd = st.nd;
  const int tid = static_cast<int>(threadIdx.x), k = P.hidden, vectors = k / 8;
  const bool writer = blockIdx.x == 0 && nd.resid_out;
  // The linears' inputs: x0 for the one reading the norm, x1 (GPT-NeoX) for the one reading the second LayerNorm.
  const StepLinearInfo& L0 = info[0];
  T* xs0 = area + L0.x_offset;
  T* xs1 = st.norm == 2 ? area + info[1].x_offset : nullptr;
  const int stride = L0.x_stride, k_vectors = L0.k_units * 32;
  const T* w = params;
  const T* bias = nd.bias ? params + k : nullptr;
  const T* w2 = params + 2 * k;
  const T* b2 = nd.bias2 ? params + 3 * k : nullptr;
  for (int b = 0; b < P.batch; ++b) {
    const int64_t row = static_cast<int64_t>(b) * k;
    const T* resid = params + (4 + b) * k;
    const T* d = nd.delta ? static_cast<const T*>(nd.delta) + row : nullptr;
    const T* d2 = nd.delta2 ? static_cast<const T*>(nd.delta2) + row : nullptr;
    uint4 dr[kPer], d2r[kPer];  // every load issued before the first use
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int v = tid + j * kStepConsumers * 32;
      const bool in = v < vectors;
      const uint4 zero = make_uint4(0, 0, 0, 0);
      dr[j] = in && d ? __ldcg(reinterpret_cast<const uint4*>(d + v * 8)) : zero;
      d2r[j] = in && d2 ? __ldcg(reinterpret_cast<const uint4*>(d2 + v * 8)) : zero;
    }
    float s[kPer][8];
    float acc = 0.f;
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int v = tid + j * kStepConsumers * 32;
      Vec<T, 8> xe, de, d2e;
      memcpy(&de, &dr[j], 16);
      memcpy(&d2e, &d2r[j], 16);
      xe = v < vectors ? *reinterpret_cast<const Vec<T, 8>*>(resid + v * 8) : Vec<T, 8>{};
#pragma unroll
      for (int e = 0; e < 8; ++e) s[j][e] = v < vectors ? to_float(xe.data[e]) : 0.f;
      if (d) add_residual<T, 8>(s[j], de, d2e, d2 != nullptr);
      if (v < vectors) {
#pragma unroll
        for (int e = 0; e < 8; ++e) acc += P.rms ? s[j][e] * s[j][e] : s[j][e];
      }
    }
    const float inv_n = 1.f / static_cast<float>(k);
    const float total = consumers_sum(acc, scratch);
    float mean = 0.f, rstd;
    if (P.rms) {
      rstd = rsqrtf(total * inv_n + P.eps);
    } else {
      mean = total * inv_n;
      float m2 = 0.f;
#pragma unroll
      for (int j = 0; j < kPer; ++j) {
        if (tid + j * kStepConsumers * 32 >= vectors) break;
#pragma unroll
        for (int e = 0; e < 8; ++e) m2 += (s[j][e] - mean) * (s[j][e] - mean);
      }
      rstd = rsqrtf(consumers_sum(m2, scratch) * inv_n + P.eps);
    }
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int v = tid + j * kStepConsumers * 32;
      if (v >= vectors) break;
      const Vec<T, 8> wv = *reinterpret_cast<const Vec<T, 8>*>(w + v * 8);
      const Vec<T, 8> bv = bias ? *reinterpret_cast<const Vec<T, 8>*>(bias + v * 8) : Vec<T, 8>{};
      float h[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) h[e] = norm_value<T>(s[j][e], mean, rstd, wv.data[e], bv.data[e], P.rms != 0);
      *reinterpret_cast<uint4*>(xs0 + b * stride + v * 8) = pack_pair_order<T>(h);
      if (xs1) {
        const Vec<T, 8> w2v = *reinterpret_cast<const Vec<T, 8>*>(w2 + v * 8);
        const Vec<T, 8> b2v = b2 ? *reinterpret_cast<const Vec<T, 8>*>(b2 + v * 8) : Vec<T, 8>{};
#pragma unroll
        for (int e = 0; e < 8; ++e) h[e] = norm_value<T>(s[j][e], mean, rstd, w2v.data[e], b2v.data[e], false);
        *reinterpret_cast<uint4*>(xs1 + b * stride + v * 8) = pack_pair_order<T>(h);
      }
      if (writer) store_vec<T, 8>(static_cast<T*>(nd.resid_out) + row + v * 8, s[j]);
    }
    for (int v = vectors + tid; v < k_vectors; v += kStepConsumers * 32) {  // past K: zeros
      *reinterpret_cast<uint4*>(xs0 + b * stride + v * 8) = make_uint4(0, 0, 0, 0);
      if (xs1) *reinterpret_cast<uint4*>(xs1 + b * stride + v * 8) = make_uint4(0, 0, 0, 0);
    }
  }
}

// ---- a unit's arithmetic ----
// (ZeroTerms, zero_terms, dequantize_zeros, mma_chunk_exact and GroupTerms: int4_mma.cuh, whose kernel dequantizes
// and sums the same way.)

// This warp's share of a unit: column warp w, half `half` (rows 16 half .. 16 half + 15, 128 k), 4 steps; the sums
// of each group, times its scales, into acc.
template <typename T>
__device__ __forceinline__ void unit_compute(const StepLinearInfo& L, const WarpCols& mine, int ku,
                                             const unsigned char* src, const T* xs, int batch, float (&acc)[2][4]) {
  const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) >> 5;
  const int g = lane / 4, q = lane % 4, w = warp & 3, half = warp >> 2;
  if (mine.col < 0) return;
  const unsigned char* box = src + w * kStepBoxBytes;
  const int pbox = L.silu ? w >> 1 : 0;
  const int col = (L.silu ? (w & 1) * 32 : w * 32) + 4 * g;  // the lane's first column in its parameter box
  const __half* scales = reinterpret_cast<const __half*>(src + kStepQBytes + pbox * (L.scale_bytes + L.zero_bytes));
  const uint32_t* zeros =
      reinterpret_cast<const uint32_t*>(reinterpret_cast<const unsigned char*>(scales) + L.scale_bytes);
  const int k0 = ku * 256, first_group = k0 >> L.group_shift;
  const T* x_lane = xs + g * L.x_stride + k0;
  float part[2][2][4] = {};
  GroupTerms<T> d(GroupParams{}, L.zero_offset);  // the current group's (int4_mma.cuh)
  int current = -1;
  const auto flush = [&] {  // the group's two sums (part[0]: each step's first k pairs, part[1]: its last) into acc
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        part[0][h][i] += part[1][h][i];
        part[1][h][i] = 0.f;
      }
    }
    d.fold(acc, part[0]);
  };
#pragma unroll
  for (int p = 0; p < 2; ++p) {
    // Steps 4 half + 2p and + 1 read rows 8 (2 half + p) .. + 7 (stage_row): 64 k of one group.
    const int group = ((k0 + 64 * (2 * half + p)) >> L.group_shift) - first_group;
    if (group != current) {
      if (current >= 0) flush();
      current = group;
      const GroupParams gp{*reinterpret_cast<const uint2*>(scales + group * L.box_columns + col),
                           zeros[group * (L.box_columns / 8) + col / 8] >> (4 * (col % 8))};
      d = GroupTerms<T>(gp, L.zero_offset);
    }
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      const int r = stage_row(4 * half + 2 * p + t, q);
      const uint4 chunk = *reinterpret_cast<const uint4*>(box + r * 128 + ((g ^ (r & 7)) << 4));
      const uint4 xv = g < batch ? *reinterpret_cast<const uint4*>(x_lane + r * 8) : make_uint4(0, 0, 0, 0);
      mma_chunk_exact<T>(part[0], part[1], chunk, xv, d.z);  // two chains of dependent mma, each half as long
    }
  }
  flush();
}

// A flag another block sets once its partial sums are stored (release), read with acquire.
__device__ __forceinline__ unsigned load_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void store_release(unsigned* p, unsigned v) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// The end of this block's piece of strip t: the two halves' sums added. Where the strip lies in several blocks'
// runs (nslots), each block but the last stores its sums as row slot_row of the strip's partial sums and sets its
// flag to the stage's tag, and goes on; the last one (the owner of the strip's last unit: the finisher) waits for
// the others' flags, adds their rows in block order and its own (so the sums do not depend on timing), and finishes:
// the values rounded as F.linear rounds its output, the bias added in the dtype (GPTQLinear), the epilogue stored.
template <typename T>
__device__ __noinline__ void finish_piece(const StepPlan& P, const StepLinearInfo& L, const WarpCols& mine, int t,
                                          int slot_row, int nslots, unsigned tag, float (&acc)[2][4], float* red) {
  const int tid = static_cast<int>(threadIdx.x), lane = tid & 31, warp = tid >> 5;
  const int g = lane / 4, q = lane % 4, w = warp & 3, half = warp >> 2;
  const int B = P.batch;
  float* fin = red + 2 * B * 128;  // [batch][128]
  if (mine.col >= 0) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int b = 2 * q + (i & 1);
        if (b < B) red[(half * B + b) * 128 + w * 32 + 4 * g + 2 * h + (i >> 1)] = acc[h][i];
      }
    }
  }
  consumers_sync();
  const int64_t width = static_cast<int64_t>(L.strips) * 128;
  const bool finisher = slot_row == nslots - 1;
  unsigned* flags = L.flags + t * L.slots;
  for (int e = tid; e < B * 128; e += kStepConsumers * 32) {
    const int b = e / 128, c = e % 128;
    const float v = red[b * 128 + c] + red[(B + b) * 128 + c];
    if (finisher) {
      fin[e] = v;
    } else {
      L.partials[(static_cast<int64_t>(slot_row) * B + b) * width + t * 128 + c] = v;
    }
  }
  if (!finisher) {
    // The block's stores are ordered before thread 0's release by the barrier (cumulativity), so the flag
    // publishes all of them; only warp 0 waits for it, the others go on with the next unit.
    consumers_sync();
    if (tid == 0) store_release(flags + slot_row, tag);
    return;
  }
  if (nslots > 1) {
    if (tid < nslots - 1) {  // one thread per other block: its flag
      const unsigned long long start = global_ns();
      for (unsigned spins = 1; load_acquire(flags + tid) != tag; ++spins) trap_if_stuck(spins, start);
    }
    consumers_sync();
    for (int e = tid; e < B * 128; e += kStepConsumers * 32) {
      const int b = e / 128, c = e % 128;
      const float* sums = L.partials + static_cast<int64_t>(b) * width + t * 128 + c;
      float rows[4];
      float v = 0.f;
      for (int r0 = 0; r0 < nslots - 1; r0 += 4) {  // in block order
#pragma unroll
        for (int j = 0; j < 4; ++j) rows[j] = r0 + j < nslots - 1 ? __ldcg(sums + (r0 + j) * B * width) : 0.f;
#pragma unroll
        for (int j = 0; j < 4; ++j) v += rows[j];
      }
      fin[e] = v + fin[e];
    }
  }
  for (int e = tid; e < B * 128; e += kStepConsumers * 32) {
    const int c = e % 128;
    const WarpCols wc = warp_cols(L, t, c / 32);
    if (wc.col < 0) continue;
    const int seg = wc.seg, col = wc.col + c % 32;
    float y = round_to<T>(fin[e]);
    if (L.bias[seg]) y = round_to<T>(y + round_to<T>(__half2float(static_cast<const __half*>(L.bias[seg])[col])));
    fin[e] = y;
  }
  consumers_sync();
  T* out = static_cast<T*>(L.out);
  if (L.silu) {
    for (int e = tid; e < B * 64; e += kStepConsumers * 32) {
      const int b = e / 64, c = e % 64;
      const WarpCols wc = warp_cols(L, t, c / 32);
      if (wc.col < 0) continue;
      const float gate = fin[b * 128 + c], up = fin[b * 128 + 64 + c];
      out[static_cast<int64_t>(b) * L.out_width + wc.col + c % 32] = from_float<T>(round_to<T>(silu(gate)) * up);
    }
  } else {
    for (int e = tid; e < B * 128; e += kStepConsumers * 32) {
      const int b = e / 128, c = e % 128;
      const WarpCols wc = warp_cols(L, t, c / 32);
      if (wc.col < 0) continue;
      float y = fin[e];
      if (L.act != kActNone) y = gelu(y, L.act == kActGeluTanh);
      out[static_cast<int64_t>(b) * L.out_width + segment_start(L, wc.seg) + wc.col + c % 32] = from_float<T>(y);
    }
  }
}

// ---- attention (decode_attention.cu, with the current token's RoPE and cache write) ----
__device__ __forceinline__ int qkv_column(const StepPlan& P, int part, int head, int d) {
  if (P.interleaved) return (head * 3 + part) * P.head_dim + d;
  const int slot = part == 0 ? head : (part == 1 ? P.num_q_heads + head : P.num_q_heads + P.num_kv_heads + head);
  return slot * P.head_dim + d;
}

template <typename T, int D, int GMAX>
__device__ void attention_item(const StepPlan& P, const StepAttention& A, int b, int kvh, int first, int split,
                               AttnScratch& S) {
  using Shape = AttnShape<D, GMAX>;
  constexpr int kActive = Shape::kActive, kLanes = Shape::kLanes, kGroups = Shape::kGroups;
  constexpr int kUnroll = Shape::kUnroll, kStep = Shape::kStep;
  const int hq = P.num_q_heads, hkv = P.num_kv_heads, group_size = hq / hkv;
  const int G = group_size - first < GMAX ? group_size - first : GMAX;
  const int head0 = kvh * group_size + first;
  const int64_t last_key = *P.slot;
  const AttnRange range = attention_range<D, GMAX>(P.pad[b], last_key, P.splits, split);
  if (split >= range.shares) return;  // no keys for this share at this context length
  const int shares = range.shares;
  const int64_t lo = range.lo, hi = range.hi;
  const int tid = static_cast<int>(threadIdx.x);
  consumers_sync();  // the previous item's readers of S are done

  // The current token's q (G heads), k and v from the projection, then RoPE as rope_qkv_cache computes it.
  const T* qkv = static_cast<const T*>(P.qkv) + static_cast<int64_t>(b) * P.qkv_width;
  for (int i = tid; i < (G + 2) * D; i += kStepConsumers * 32) {
    const int r = i / D, d = i % D;
    const int part = r < G ? 0 : r - G + 1, head = r < G ? head0 + r : kvh;
    S.raw[r][d] = to_float(load_cg(qkv + qkv_column(P, part, head, d)));
  }
  consumers_sync();
  int64_t pos = last_key - P.pad[b];
  pos = pos < 0 ? 0 : (pos >= P.table_len ? P.table_len - 1 : pos);
  const T* cos = static_cast<const T*>(P.cos) + pos * P.rotary_dim;
  const T* sin = static_cast<const T*>(P.sin) + pos * P.rotary_dim;
  const int R = P.rotary_dim;
  const bool writer = split == 0 && first == 0;
  const int64_t cache_row = ((static_cast<int64_t>(b) * hkv + kvh) * P.capacity + last_key) * D;
  for (int i = tid; i < (G + 2) * D; i += kStepConsumers * 32) {
    const int r = i / D, d = i % D;
    const int part = r < G ? 0 : r - G + 1;
    const float y = rotate<T>(S.raw[r], d, Slot{part, 0, d}, R, cos, sin);  // rope.cuh, as rope_qkv_cache
    S.rot[r][d] = y;
    if (writer && part != 0) static_cast<T*>(part == 1 ? A.k_cache : A.v_cache)[cache_row + d] = from_float<T>(y);
  }
  consumers_sync();

  const int lane = tid & 31;
  const int sub = lane % kLanes;
  const int group = (tid >> 5) * (32 / kLanes) + lane / kLanes;
  const bool active = sub < kActive;
  const int d0 = sub * 8;
  const int64_t head_offset = (static_cast<int64_t>(b) * hkv + kvh) * P.capacity * D;
  const T* k_base = static_cast<const T*>(A.k_cache) + head_offset + d0;
  const T* v_base = static_cast<const T*>(A.v_cache) + head_offset + d0;
  float q[GMAX][8];
#pragma unroll
  for (int g = 0; g < GMAX; ++g) {
#pragma unroll
    for (int j = 0; j < 8; ++j) q[g][j] = g < G && active ? S.rot[g][d0 + j] * P.scale * kLog2e : 0.f;
  }
  float m[GMAX], l[GMAX], acc[GMAX][8];
  attend_init(m, l, acc);
  for (int64_t base = lo; base < hi; base += kStep) {
    float kv[kUnroll][8], vv[kUnroll][8];
    bool valid[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t t = base + u * kGroups + group;
      valid[u] = t < hi;
      if (valid[u] && active && t != last_key) {
        load_vec<T, 8>(kv[u], k_base + t * D);  // written by earlier launches (or the prefill)
        load_vec<T, 8>(vv[u], v_base + t * D);
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          kv[u][j] = valid[u] && active ? S.rot[G][d0 + j] : 0.f;  // the current token's key and value
          vv[u][j] = valid[u] && active ? S.rot[G + 1][d0 + j] : 0.f;
        }
      }
    }
    attend_step<D, GMAX>(q, kv, vv, valid, G, m, l, acc);
  }
  T* out = static_cast<T*>(P.attn) + (static_cast<int64_t>(b) * hq + head0) * D;
  float* partials = P.attn_partials + ((static_cast<int64_t>(b) * hq + head0) * P.splits) * (D + 2);
  attend_finish<T, D, GMAX>(S.merge, m, l, acc, G, shares, split, P.splits, out, partials,
                            P.attn_counters + b * hq + head0, [] { consumers_sync(); });
}

template <typename T>
__device__ __noinline__ void run_attention(const StepPlan& P, const StepAttention& A, AttnScratch& S) {
  const int group_size = P.num_q_heads / P.num_kv_heads;
  const int gmax = group_size > 1 ? 2 : 1;
  const int head_groups = (group_size + gmax - 1) / gmax;
  const int items = P.batch * P.num_kv_heads * head_groups * P.splits;
  for (int item = static_cast<int>(blockIdx.x); item < items; item += static_cast<int>(gridDim.x)) {
    // Shares fastest: at short contexts only the first shares of a head have keys, spread over the grid.
    const int split = item % P.splits;
    int rest = item / P.splits;
    const int first = rest % head_groups * gmax;
    rest /= head_groups;
    const int kvh = rest % P.num_kv_heads, b = rest / P.num_kv_heads;
#define PATCHER_ATTENTION_ITEM(DIM)                           \
  if (gmax == 1) {                                            \
    attention_item<T, DIM, 1>(P, A, b, kvh, first, split, S); \
  } else {                                                    \
    attention_item<T, DIM, 2>(P, A, b, kvh, first, split, S); \
  }
    if (P.head_dim == 64) {
      PATCHER_ATTENTION_ITEM(64)
    } else if (P.head_dim == 80) {
      PATCHER_ATTENTION_ITEM(80)
    } else {
      PATCHER_ATTENTION_ITEM(128)
    }
#undef PATCHER_ATTENTION_ITEM
  }
}

// ---- the compute warps ----
template <typename T>
__device__ void consume(const StepPlan& P, unsigned char* base, uint64_t* full, uint64_t* empty, float* scratch,
                        StepLinearInfo* info) {
  const int blocks = static_cast<int>(gridDim.x), block = static_cast<int>(blockIdx.x);
  const int tid = static_cast<int>(threadIdx.x), lane = tid & 31;
  unsigned char* ring = base;
  T* area = reinterpret_cast<T*>(base + P.x_offset);
  T* norm_params = reinterpret_cast<T*>(base + P.norm_offset);
  float* red = reinterpret_cast<float*>(base + P.red_offset);
  AttnScratch& attn = *reinterpret_cast<AttnScratch*>(base + P.attn_offset);
  // The barrier's epoch (thread 0 arrives and polls) and the launch count, which every thread reads: each stage's
  // partial-sum flags carry the tag launch * 1024 + stage + 1 (set by thread 0, polled by the first threads), so a
  // flag left from an earlier stage or launch never reads as set.
  unsigned long long epoch, launch;
  asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(epoch) : "l"(P.barrier + 1));
  asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(launch) : "l"(P.barrier + 2));
  // The stage's marks on the timeline, when one is asked for (thread 0's readings of %globaltimer), and the time
  // thread 0 spent waiting for weights and in the strips' meetings.
  const bool timed = P.timeline && tid == 0;
  const auto record = [&](int si, int k, unsigned long long value) {
    if (timed) P.timeline[(static_cast<int64_t>(block) * P.num_stages + si) * kStepMarks + k] = value;
  };
  const auto mark = [&](int si, int k) { record(si, k, timed ? global_ns() : 0); };
  unsigned long long waited = 0, met = 0, since = 0;
  int slot = 0;
  unsigned phase = 0;  // of the slots' fill the consumers wait for next
  if (P.stages[0].norm) prefetch_norm<T>(P, P.stages[0], norm_params);
  for (int si = 0; si < P.num_stages; ++si) {
    if (si > 0) {
      cp_async_wait_all();  // the prefetched norm inputs (before the barrier's first sync: visible to all after it)
      grid_barrier(P.barrier, epoch + static_cast<unsigned long long>(si) * blocks);
    }
    const StepStage& st = P.stages[si];
    mark(si, 0);
    if (st.attention) {
      run_attention<T>(P, st.ad, attn);
      mark(si, 1);
      mark(si, 2);
    } else {
      mark(si, 1);
      load_infos(P, st, info, tid);
      if (si == 0) cp_async_wait_all();
      consumers_sync();
      if (st.norm) {
        stage_norm<T>(P, st, info, area, norm_params, scratch);
      } else {
        for (int j = 0; j < st.num_linears; ++j) stage_plain<T>(static_cast<const T*>(st.x[j]), info[j], P.batch, area);
      }
      consumers_sync();
      mark(si, 2);
    }
    // The next stage's norm inputs are constant by now: into shared memory while this stage runs.
    if (si + 1 < P.num_stages && P.stages[si + 1].norm) prefetch_norm<T>(P, P.stages[si + 1], norm_params);
    if (st.num_linears) {
      const StageSplit split = stage_split(st, info);
      const int u0 = split.run_start(block), u1 = split.run_start(block + 1);
      const int count = u1 > u0 ? split.pieces(u0, u1) : 0;
      const unsigned tag = static_cast<unsigned>(launch) * 1024u + static_cast<unsigned>(si) + 1u;
      for (int p = 0; p < count; ++p) {
        const int3 pc = split.piece(u0, u1, p);
        const int li = pc.x >= split.strips0 ? 1 : 0;
        const StepLinearInfo& L = info[li];
        const int t = pc.x - li * split.strips0, ku = pc.y - split.first_unit(pc.x);
        const WarpCols mine = warp_cols(L, t, (tid >> 5) & 3);
        const T* xs = area + L.x_offset;
        float acc[2][4] = {};
        for (int i = 0; i < pc.z; ++i) {
          if (timed) since = global_ns();
          bar_wait(&full[slot], phase);
          if (timed) waited += global_ns() - since;
          if (!(P.bounds & 1)) unit_compute<T>(L, mine, ku + i, ring + slot * P.slot_bytes, xs, P.batch, acc);
          __syncwarp();
          if (lane == 0) bar_arrive(&empty[slot]);  // the slot is free for the producer
          if (++slot == P.ring_slots) {
            slot = 0;
            phase ^= 1u;
          }
        }
        const int owner = split.owner(split.first_unit(pc.x));
        const int nslots = split.owner(split.last_unit(pc.x)) - owner + 1;
        if (timed) since = global_ns();
        finish_piece<T>(P, L, mine, t, block - owner, nslots, tag, acc, red);
        if (timed) met += global_ns() - since;
      }
    }
    mark(si, 3);
    record(si, 4, waited);
    record(si, 5, met);
    waited = met = 0;
  }
  // Every block has passed the last barrier once block 0 has: the next launch counts from here.
  if (block == 0 && tid == 0) {
    const unsigned long long next = epoch + static_cast<unsigned long long>(P.num_stages - 1) * blocks;
    asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(P.barrier + 1), "l"(next) : "memory");
    asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(P.barrier + 2), "l"(launch + 1) : "memory");
  }
}

#endif  // __CUDA_ARCH__ >= 900

template <typename T>
__global__ void __launch_bounds__(kStepThreads, 1) step_kernel(const __grid_constant__ StepPlan P) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) unsigned char dynamic[];
  // The ring, then x, the norm inputs, the sums and the attention's arrays (StepPlan offsets), from a 1024-byte
  // boundary: the 128-byte swizzle of the qweight boxes is a function of the address.
  unsigned char* base = dynamic + ((1024u - (smem_addr(dynamic) & 1023u)) & 1023u);
  __shared__ uint64_t full[kStepMaxSlots], empty[kStepMaxSlots];
  __shared__ float scratch[kStepConsumers];
  __shared__ StepLinearInfo consumer_info[kStepMaxLinears], producer_info[kStepMaxLinears];
  if (threadIdx.x == 0) {
    for (int s = 0; s < P.ring_slots; ++s) {
      bar_init(&full[s], 1);
      bar_init(&empty[s], kStepConsumers);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (threadIdx.x / 32 == kStepConsumers) {
    if (threadIdx.x % 32 == 0) produce(P, base, full, empty, producer_info);
    return;
  }
  consume<T>(P, base, full, empty, scratch, consumer_info);
#endif
}

template <typename T>
cudaError_t launch_step_typed(const StepPlan& P, cudaStream_t stream) {
  // The dynamic shared memory limit of the kernel, raised where a plan needs more than before.
  static std::atomic<int> raised{0};
  const int smem = P.smem_bytes + 1024;  // + the alignment of the ring
  if (smem > raised.load()) {
    const cudaError_t err = cudaFuncSetAttribute(step_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return err;
    raised.store(smem);
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(P.blocks));
  config.blockDim = dim3(kStepThreads);
  config.dynamicSmemBytes = static_cast<size_t>(smem);
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeCooperative;  // every block resident at once, or the launch fails
  attribute[0].val.cooperative = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, step_kernel<T>, P);
}

}  // namespace
}  // namespace patcher
