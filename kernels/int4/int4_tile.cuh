// Pieces shared by the two GPTQ int4 decode kernels (int4_gemv.cuh: CUDA cores, any dtype and act-order;
// int4_mma.cuh: tensor cores, fp16/bf16 activations): the column tiles, the group parameters, the x stage with the
// optional norm prologue, the K-split reduction and the epilogues.
//
// Weights stay in the checkpoint's layout: qweight int32 [K/8, N] holds 8 consecutive k of one column per word,
// so one 16-byte load is 4 adjacent columns x 8 k, and the threads of a warp read consecutive bytes of a row.
//
// Work split. The output columns are cut into tiles (128 columns; with RoPE whole heads, so that the two halves a
// rotation pairs sit in one tile) and K into `splits` slices; one block per (tile, slice). Each thread issues its
// first weight loads before griddepcontrol.wait, so with programmatic dependent launch they are in flight while
// the previous kernel finishes and while this block prepares x. Partial sums of the slices meet in a global fp32
// workspace; the last block to finish a tile (an atomic counter per tile, reset by that block) adds them up and
// runs the epilogue, so the whole op is one kernel. Or, where the next op's norm prologue reads the output
// (int4_gemv_acc, Int4Params::acc), every block adds its sums into a fixed-point accumulator and the slices never
// meet: rounding, bias and the residual add happen in that prologue.
#pragma once
#include "common/common.cuh"
#include "int4/int4_dequant.cuh"
#include "int4/params.h"
#include "rope/rope.cuh"

namespace patcher {
namespace {

constexpr int kThreads = 256;
constexpr int kNormElems = 32;     // norm prologue: row elements per thread held in registers (K <= 32 x threads)
constexpr int kPartialLoads = 16;  // rows of partial sums a finishing thread has in flight (finish_from_partials)

// N accumulator values as the dtype: each rounded as an op's epilogue rounds its output.
template <typename T, int N>
__device__ __forceinline__ Vec<T, N> fixed_vec(const int64_t* src) {
  static_assert(N % 2 == 0, "fixed_vec loads pairs");
  Vec<T, N> v;
#pragma unroll
  for (int e = 0; e < N; e += 2) {
    const longlong2 pair = *reinterpret_cast<const longlong2*>(src + e);
    v.data[e] = from_float<T>(from_fixed(pair.x));
    v.data[e + 1] = from_float<T>(from_fixed(pair.y));
  }
  return v;
}

// After griddepcontrol.wait: block `block` of `blocks` zeroes its share of p.clear (Int4Params::clear).
__device__ __forceinline__ void clear_share(const Int4Params& p, int block, int blocks) {
  if (!p.clear) return;
  const int64_t threads = static_cast<int64_t>(blocks) * blockDim.x * blockDim.y;
  for (int64_t i = static_cast<int64_t>(block) * blockDim.x * blockDim.y + threadIdx.y * blockDim.x + threadIdx.x;
       i < p.clear_count; i += threads)
    p.clear[i] = 0;
}

struct TileInfo {
  int seg;       // segment of this tile
  int64_t col0;  // first column, within the segment
  int width;     // columns (<= tile width)
  int group;     // counter index: the tile, or for SwiGLU the gate/up tile pair
  int members;   // tiles in the group (2 for SwiGLU)
};

__device__ __forceinline__ TileInfo tile_info(const Int4Params& p, int tile, int tile_width) {
  TileInfo t{};
  int local = tile;
  while (t.seg + 1 < p.num_segments) {
    const int tiles = static_cast<int>((p.seg[t.seg].n + tile_width - 1) / tile_width);
    if (local < tiles) break;
    local -= tiles;
    ++t.seg;
  }
  t.col0 = static_cast<int64_t>(local) * tile_width;
  const int64_t left = p.seg[t.seg].n - t.col0;
  t.width = static_cast<int>(left < tile_width ? left : tile_width);
  t.group = p.epilogue == kInt4SiluMul ? local : tile;
  t.members = p.epilogue == kInt4SiluMul ? 2 : 1;
  return t;
}

// The threads that finish a tile together: the whole block.
struct Team {
  int tid, size;
  __device__ void sync() const { __syncthreads(); }
};

__device__ __forceinline__ Team whole_block() {
  return {static_cast<int>(threadIdx.y * blockDim.x + threadIdx.x), static_cast<int>(blockDim.x * blockDim.y)};
}

// How the blocks that share a tile group meet: this block's row of partial sums in the workspace, the arrivals at
// the group's counter, the rows to add up per member tile, and whether this block holds the whole group alone.
struct TileSplit {
  int slot;
  int expected;
  int slots[2];
  bool direct;
};

// The split of the grid (tiles, K slices): every tile in `splits` slices, slice blockIdx.y.
__device__ __forceinline__ TileSplit k_slices(const Int4Params& p, const TileInfo& t) {
  return {static_cast<int>(blockIdx.y), p.splits * t.members, {p.splits, p.splits}, p.splits == 1 && t.members == 1};
}

// Whether a block of K slice [k0, ...) may skip griddepcontrol.wait: it reads only x2, which the caller promises was
// written before the previous kernel began (Int4Params::x2_early).
__device__ __forceinline__ bool skips_wait(const Int4Params& p, int64_t k0) {
  return p.x2 && p.x2_early && k0 >= p.x2_k;
}

// Whether tile t belongs to the op's second linear (Int4Params::second).
__device__ __forceinline__ bool in_second(const Int4Params& p, const TileInfo& t) {
  return p.second > 0 && t.seg >= p.second;
}

// A norm's weight and bias for one 16-byte vector of a row at k, and the second LayerNorm's where `second` (else
// the first's again): `second_norm` takes the second LayerNorm's as the first (a tile of Int4Params::second).
template <typename T, int V>
struct NormVecs {
  Vec<T, V> w, b, w2, b2;
};

template <typename T, int V>
__device__ __forceinline__ NormVecs<T, V> norm_vecs(const Int4Params& p, bool second_norm, bool second, int64_t k) {
  const T* w = static_cast<const T*>(second_norm ? p.norm.weight2 : p.norm.weight);
  const T* bias = static_cast<const T*>(second_norm ? p.norm.bias2 : p.norm.bias);
  NormVecs<T, V> v;
  v.w = *reinterpret_cast<const Vec<T, V>*>(w + k);
  v.b = vec_or_zero<T, V>(bias, k);
  v.w2 = v.w;
  v.b2 = v.b;
  if (second) {
    v.w2 = *reinterpret_cast<const Vec<T, V>*>(static_cast<const T*>(p.norm.weight2) + k);
    v.b2 = vec_or_zero<T, V>(static_cast<const T*>(p.norm.bias2), k);
  }
  return v;
}

// Stages x[b, k0 : k0 + len] in shared memory through store(b, i, value) (the kernels keep it in their own layout);
// with the norm prologue, the normalized residual sum (each block
// computes the row statistics over all of K, from L2, and keeps its own slice), through the second LayerNorm's
// weights for `second_norm` (a tile of Int4Params::second). Blocks of tile 0 write `sum` and `h2` (where asked
// for) for their slice, so every element is written once. Each thread holds its share of a row in registers
// (16-byte loads, all issued at once), so the statistics cost one pass of loads, not three dependent ones. (The
// norm weights and biases copied into shared memory before griddepcontrol.wait made no op faster.) `early`:
// the norm parameters of this thread's vectors (norm_vecs for vector tid + j x threads), which the add + norm kernel
// of its own loads into registers before its wait (int4_norm_prologue_kernel); the ops load them here.
template <typename T, bool NORM, int NORM_ELEMS = kNormElems, typename Store>
__device__ void stage_x(const Int4Params& p, int64_t k0, int64_t len, bool writer, bool second_norm, Store store,
                        const NormVecs<T, 16 / sizeof(T)>* early = nullptr) {
  const int tid = threadIdx.y * blockDim.x + threadIdx.x, nthreads = blockDim.x * blockDim.y;
  if constexpr (!NORM) {
    // 16-byte loads where x allows them (slices start and end on multiples of 8), each thread's issued together.
    // With a second input, k from x2_k on (a multiple of 8, so no vector straddles the two) reads x2; with a second
    // linear (Int4Params::second), its tiles (second_norm) read x2 whole and the first linear's tiles x.
    constexpr int V = 16 / sizeof(T);
    const bool vec = (reinterpret_cast<uintptr_t>(p.x) & 15u) == 0 && p.x_stride % V == 0 &&
                     (!p.x2 || ((reinterpret_cast<uintptr_t>(p.x2) & 15u) == 0 && p.x2_stride % V == 0));
    const int step = vec ? V : 1;
    const int64_t split = p.second > 0 ? (second_norm ? 0 : p.k) : (p.x2 ? p.x2_k : p.k);
    for (int b = 0; b < p.batch; ++b) {
      const T* row = static_cast<const T*>(p.x) + b * p.x_stride;
      const T* row2 = p.x2 ? static_cast<const T*>(p.x2) + b * p.x2_stride - split : row;  // indexed by k
      for (int64_t i = static_cast<int64_t>(tid) * step; i < len; i += static_cast<int64_t>(nthreads) * step) {
        const T* src = (k0 + i < split ? row : row2) + k0;
        if (vec) {
          float v[V];
          load_vec<T, V>(v, src + i);
#pragma unroll
          for (int e = 0; e < V; ++e) store(b, i + e, v[e]);
        } else {
          store(b, i, to_float(src[i]));
        }
      }
    }
  } else {
    constexpr int V = 16 / sizeof(T), PER = NORM_ELEMS / V;  // vector width, vectors per thread
    __shared__ float scratch[32];
    const auto block_total = [&](float v) {  // block_sum for a 2-D block (a whole number of warps)
      v = warp_sum(v);
      __syncthreads();
      if ((tid & 31) == 0) scratch[tid >> 5] = v;
      __syncthreads();
      v = (tid & 31) < nthreads / 32 ? scratch[tid & 31] : 0.f;
      return warp_sum(v);
    };
    const float inv_n = 1.f / static_cast<float>(p.k);
    const int64_t nvec = p.k / V;
    for (int b = 0; b < p.batch; ++b) {
      const T* x = static_cast<const T*>(p.x) + b * p.x_stride;
      const bool fixed = p.norm.delta && p.norm.delta_fixed;
      const T* d = p.norm.delta && !fixed ? static_cast<const T*>(p.norm.delta) + b * p.norm.delta_stride : nullptr;
      const int64_t* dq = fixed ? static_cast<const int64_t*>(p.norm.delta) + b * p.norm.delta_stride : nullptr;
      const T* d2 = p.norm.delta2 ? static_cast<const T*>(p.norm.delta2) + b * p.norm.delta2_stride : nullptr;
      float s[PER][V];
      float acc = 0.f;
#pragma unroll
      for (int j = 0; j < PER; ++j) {
        const int64_t v = tid + static_cast<int64_t>(j) * nthreads;
        if (v >= nvec) break;
        load_vec<T, V>(s[j], x + v * V);
        if (d) add_residual<T, V>(s[j], d + v * V, d2 ? d2 + v * V : nullptr);
        if (dq) add_residual<T, V>(s[j], fixed_vec<T, V>(dq + v * V), vec_or_zero<T, V>(d2, v * V), d2 != nullptr);
#pragma unroll
        for (int e = 0; e < V; ++e) acc += p.norm.rms ? s[j][e] * s[j][e] : s[j][e];
      }
      acc = block_total(acc);
      float mean = 0.f, rstd;
      if (p.norm.rms) {
        rstd = rsqrtf(acc * inv_n + p.norm.eps);
      } else {
        mean = acc * inv_n;
        float m2 = 0.f;
#pragma unroll
        for (int j = 0; j < PER; ++j) {
          if (tid + static_cast<int64_t>(j) * nthreads >= nvec) break;
#pragma unroll
          for (int e = 0; e < V; ++e) m2 += (s[j][e] - mean) * (s[j][e] - mean);
        }
        rstd = rsqrtf(block_total(m2) * inv_n + p.norm.eps);
      }
#pragma unroll
      for (int j = 0; j < PER; ++j) {
        const int64_t v = tid + static_cast<int64_t>(j) * nthreads;
        if (v >= nvec) break;
        const int64_t k = v * V;
        if (k < k0 || k >= k0 + len) continue;  // another block's slice (slices are whole vectors: multiples of 8)
        // The parameters as 16-byte vectors, all loaded before the first store: scalar loads behind the writer's
        // global stores (which may alias them, for all the compiler knows) waited one round trip each, and the
        // writing blocks staged x well after the others.
        const bool second = writer && p.norm.h2;
        const NormVecs<T, V> nv = early ? early[j] : norm_vecs<T, V>(p, second_norm, second, k);
#pragma unroll
        for (int e = 0; e < V; ++e)
          store(b, k - k0 + e, round_to<T>(norm_value<T>(s[j][e], mean, rstd, nv.w.data[e], nv.b.data[e], p.norm.rms)));
        if (writer && p.norm.delta) store_vec<T, V>(static_cast<T*>(p.norm.sum) + b * p.k + k, s[j]);
        if (second) {
          float h2[V];
#pragma unroll
          for (int e = 0; e < V; ++e) h2[e] = norm_value<T>(s[j][e], mean, rstd, nv.w2.data[e], nv.b2.data[e], false);
          store_vec<T, V>(static_cast<T*>(p.norm.h2) + b * p.k + k, h2);
        }
      }
    }
  }
}

// The finished tile values (rounded dot product + bias, as F.linear's output and the bias add round them) are in
// `fin` [members][batch][tile_width]; this writes the op's output.
template <typename T>
__device__ void epilogue(const Int4Params& p, const TileInfo& t, const float* fin, int tile_width, const Team& team) {
  const int tid = team.tid, nthreads = team.size;
  T* out = static_cast<T*>(p.out);
  if (in_second(p, t)) {  // the second linear's output: its segments side by side in out2
    const int64_t first = segment_offset(p, p.second), n2 = int4_total_width(p) - first;
    const int64_t base = segment_offset(p, t.seg) - first + t.col0;
    for (int i = tid; i < p.batch * tile_width; i += nthreads) {
      const int b = i / tile_width, c = i % tile_width;
      if (c >= t.width) continue;
      float y = fin[i];
      if (p.act2 != kActNone) y = gelu(y, p.act2 == kActGeluTanh);
      static_cast<T*>(p.out2)[b * n2 + base + c] = from_float<T>(y);
    }
  } else if (p.epilogue == kInt4Store) {
    const int64_t n_total = int4_total_width(p);
    const int64_t base = segment_offset(p, t.seg) + t.col0;
    for (int i = tid; i < p.batch * tile_width; i += nthreads) {
      const int b = i / tile_width, c = i % tile_width;
      if (c >= t.width) continue;
      float y = fin[i];
      if (p.act != kActNone) y = gelu(y, p.act == kActGeluTanh);
      out[b * n_total + base + c] = from_float<T>(y);
    }
  } else if (p.epilogue == kInt4SiluMul) {
    const int64_t n = p.seg[0].n;
    for (int i = tid; i < p.batch * tile_width; i += nthreads) {
      const int b = i / tile_width, c = i % tile_width;
      if (c >= t.width) continue;
      const float gate = fin[i], up = fin[p.batch * tile_width + i];
      out[b * n + t.col0 + c] = from_float<T>(round_to<T>(silu(gate)) * up);
    }
  } else {  // kInt4RopeCache: the tile is whole heads (q, k or v) of one token per row
    const RopeCacheParams& r = p.rope;
    const int D = static_cast<int>(r.head_dim), hq = static_cast<int>(r.num_q_heads);
    const int hkv = static_cast<int>(r.num_kv_heads), R = static_cast<int>(r.rotary_dim);
    const int64_t slot = *r.slot;
    const int64_t base = segment_offset(p, t.seg) + t.col0;
    for (int i = tid; i < p.batch * tile_width; i += nthreads) {
      const int b = i / tile_width, c = i % tile_width;
      if (c >= t.width) continue;
      const RopeRow<T> row = rope_row<T>(r, slot, b);
      const Slot s = locate(static_cast<int>(base + c), D, hq, hkv, r.interleaved);
      const float* head = fin + b * tile_width + c - s.d;  // the head's first value (tiles start at a head)
      store_qkv<T>(r, out, b, slot, s, from_float<T>(rotate(head, s.d, s, R, row.cos, row.sin)));
    }
  }
}

// Element (b, c) of a block's sums: the runs' sums red [runs][batch][tile_width] added up.
__device__ __forceinline__ float add_runs(const Int4Params& p, const float* red, int runs, int tile_width, int b,
                                          int c) {
  float v = 0.f;
  for (int y = 0; y < runs; ++y) v += red[(y * p.batch + b) * tile_width + c];
  return v;
}

// atomicAdd(counter, 1) with acquire-release semantics at GPU scope; returns the old value.
__device__ __forceinline__ int arrive_acq_rel(int* counter) {
  int old;
  asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;" : "=r"(old) : "l"(counter) : "memory");
  return old;
}

// The workspace's partial sums are one row [batch][n_total] (the segments side by side) per K slice or block of a
// tile group (`slot`): the element of batch row b, logical output column col.
__device__ __forceinline__ float* partial_at(const Int4Params& p, int64_t n_total, int slot, int b, int64_t col) {
  return p.partials + (static_cast<int64_t>(slot) * p.batch + b) * n_total + col;
}

// This block's sums of tile t (red, as add_runs takes them) as row `slot` of the workspace's partial sums.
__device__ void store_partials(const Int4Params& p, const TileInfo& t, const float* red, int runs, int tile_width,
                               int slot, const Team& team) {
  const int64_t n_total = int4_total_width(p), base = segment_offset(p, t.seg) + t.col0;
  for (int i = team.tid; i < p.batch * tile_width; i += team.size) {
    const int b = i / tile_width, c = i % tile_width;
    if (c < t.width) *partial_at(p, n_total, slot, b, base + c) = add_runs(p, red, runs, tile_width, b, c);
  }
}

// The finished dot products of the tile group are in fin [members][batch][tile_width]: round them as F.linear rounds
// its output, add the bias in the dtype (GPTQLinear: out + bias.to(x.dtype)) and run the epilogue.
template <typename T>
__device__ void finish_values(const Int4Params& p, const TileInfo& t, float* fin, int tile_width, const Team& team) {
  const int per_member = static_cast<int>(p.batch) * tile_width;
  for (int i = team.tid; i < t.members * per_member; i += team.size) {
    const int m = i / per_member, c = i % tile_width;
    const Int4Segment& s = p.seg[t.members == 2 ? m : t.seg];
    float v = round_to<T>(fin[i]);
    if (s.bias && c < t.width)
      v = round_to<T>(v + round_to<T>(__half2float(static_cast<const __half*>(s.bias)[t.col0 + c])));
    fin[i] = v;
  }
  team.sync();
  epilogue<T>(p, t, fin, tile_width, team);
}

// After the team's stores of its partial sums: whether this block is the last of tile group t to arrive (`expected`
// arrivals), which then resets the group's counter. The stores are ordered before thread 0's arrival by the barrier;
// the arrival releases them at GPU scope and acquires the other blocks' (whose arrivals came before it), and the
// barrier after it passes that on to the team: one acq_rel atomic, cheaper than a __threadfence in every thread
// before the arrival and again in the last block.
__device__ bool last_to_arrive(const Int4Params& p, const TileInfo& t, int expected, const Team& team) {
  __shared__ int s_last;
  team.sync();
  if (team.tid == 0) {
    s_last = arrive_acq_rel(p.counters + t.group) + 1 == expected;
    if (s_last) p.counters[t.group] = 0;  // every block of the group has counted: leave it zero
  }
  team.sync();
  return s_last;
}

// The last block of a tile group to arrive: every row of partial sums of its member tiles into fin, then
// finish_values.
template <typename T>
__device__ void finish_from_partials(const Int4Params& p, const TileInfo& t, float* fin, int tile_width,
                                     const TileSplit& split, const Team& team) {
  const int per_member = static_cast<int>(p.batch) * tile_width;
  const int64_t n_total = int4_total_width(p);
  for (int i = team.tid; i < t.members * per_member; i += team.size) {
    const int m = i / per_member, b = (i % per_member) / tile_width, c = i % tile_width;
    if (c >= t.width) continue;
    const float* sums = partial_at(p, n_total, 0, b, segment_offset(p, t.members == 2 ? m : t.seg) + t.col0 + c);
    const int64_t row_stride = p.batch * n_total;
    // The rows kPartialLoads at a time, each batch of loads issued before any is added (predicated, no exit test
    // between them): added as they came, each row waited one L2 round trip behind the previous row's exit test, and
    // that tail of every split op grew with its K slices.
    float v = 0.f;
    for (int row0 = 0; row0 < split.slots[m]; row0 += kPartialLoads) {
      float rows[kPartialLoads];
#pragma unroll
      for (int j = 0; j < kPartialLoads; ++j)
        rows[j] = row0 + j < split.slots[m] ? __ldcg(sums + (row0 + j) * row_stride) : 0.f;
#pragma unroll
      for (int j = 0; j < kPartialLoads; ++j) {
        if (row0 + j < split.slots[m]) v += rows[j];  // in row order, as before: the same sums
      }
    }
    fin[i] = v;
  }
  finish_values<T>(p, t, fin, tile_width, team);
}

// The block's partial sums are in red = smem [runs][batch][tile_width] (every column of the tile that exists,
// for every row of the batch). This adds up the runs; where other blocks share the tile group, the partial sums meet
// in the workspace and the last block of the group goes on; it rounds, adds the bias and runs the epilogue. With
// p.acc each block adds its sums into the accumulator instead (Int4Params::acc), whoever else shares the tile.
template <typename T>
__device__ void finish_tile(const Int4Params& p, const TileInfo& t, float* smem, int runs, int tile_width,
                            const TileSplit& split, const Team& team) {
  team.sync();
  const int per_member = static_cast<int>(p.batch) * tile_width;
  float* fin = smem + runs * per_member;  // [members][batch][tile_width]
  if (p.acc) {  // the meeting deferred to the consumer: this block's sums into the accumulator, and done
    const int64_t n_total = int4_total_width(p), base = segment_offset(p, t.seg) + t.col0;
    for (int i = team.tid; i < per_member; i += team.size) {
      const int b = i / tile_width, c = i % tile_width;
      if (c < t.width)
        atomicAdd(reinterpret_cast<unsigned long long*>(p.acc + b * n_total + base + c),
                  static_cast<unsigned long long>(to_fixed(add_runs(p, smem, runs, tile_width, b, c))));
    }
    return;
  }
  if (split.direct) {
    for (int i = team.tid; i < per_member; i += team.size)
      fin[i] = add_runs(p, smem, runs, tile_width, i / tile_width, i % tile_width);
    finish_values<T>(p, t, fin, tile_width, team);
    return;
  }
  store_partials(p, t, smem, runs, tile_width, split.slot, team);
  if (last_to_arrive(p, t, split.expected, team)) finish_from_partials<T>(p, t, fin, tile_width, split, team);
}

// Whether the norm prologue (when there is one) takes this x in a block of `threads`: 16-byte vectors in
// registers, at most norm_elems per thread.
template <typename T>
bool norm_fits(const Int4Params& p, int threads, int norm_elems = kNormElems) {
  if (!p.norm.weight) return true;
  constexpr int V = 16 / sizeof(T);
  const void* pointers[] = {p.x,          p.norm.delta, p.norm.delta2, p.norm.weight, p.norm.bias, p.norm.weight2,
                            p.norm.bias2, p.norm.sum,   p.norm.h2};
  for (const void* ptr : pointers) {
    if (ptr && !aligned16(ptr)) return false;
  }
  return !(p.k % V || p.x_stride % V || (p.norm.delta && p.norm.delta_stride % V) ||
           (p.norm.delta2 && p.norm.delta2_stride % V) || p.k > static_cast<int64_t>(norm_elems) * threads);
}

// Shared memory of a launch (into `smem`): the x stage, followed by the tensor-core kernel's group parameters
// (group_bytes; 0 for the CUDA-core kernel), or the runs' partial sums (which reuse them once the products are
// done), then the finished tile values. The group parameters come on top of the 48 KB the rest keeps to.
// cudaErrorInvalidConfiguration where that does not fit; cudaErrorNotSupported where the norm prologue cannot take
// this x (16-byte vectors in registers, at most norm_elems per thread: norm_fits), which the bindings report as such.
template <typename T>
cudaError_t launch_smem(const Int4Params& p, int64_t stage_bytes, int64_t group_bytes, int runs, int threads,
                        int tile_width, size_t& smem, int norm_elems = kNormElems) {
  const int64_t reduce = static_cast<int64_t>(runs) * p.batch * tile_width * 4;
  const int64_t members = p.epilogue == kInt4SiluMul ? 2 : 1;
  const int64_t staged = stage_bytes + group_bytes;
  const int64_t bytes = (staged > reduce ? staged : reduce) + members * p.batch * tile_width * 4;
  if (stage_bytes > kInt4StageBytes || group_bytes > kInt4GroupStageBytes || bytes - group_bytes > 48 * 1024)
    return cudaErrorInvalidConfiguration;
  if (!norm_fits<T>(p, threads, norm_elems)) return cudaErrorNotSupported;
  smem = static_cast<size_t>(bytes);
  return cudaSuccess;
}

}  // namespace
}  // namespace patcher
