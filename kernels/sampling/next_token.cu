// The decode step's last op: each row's next token from its scores, and the decode loop's bookkeeping.
//
//   token[b]     = finished[b] ? pad_token : argmax(scores[b])   (the first index of the maximum; a NaN counts as
//                                                                 the maximum, as in torch.argmax; mapped through
//                                                                 ids[b] where given)
//   finished[b] |= token[b] is one of eos
//   tokens[b, slot + 1] = token[b];   x[b] = embed[token[b]] (the next step's input);   then slot += 1
//
// Why: torch's argmax of one long row is a multi-pass reduction (tens of us a token at a 128k vocabulary), and the
// bookkeeping around it would be four more small torch kernels (the token read for the embedding, the embedding, the
// token write, the slot add). Here blocks of 4096 scores reduce parts of the rows (from L2: the lm_head has just
// written them) and the last one to finish does the rest.
#include "common/common.cuh"
#include "sampling/params.h"

namespace patcher {
namespace {

constexpr int kNextTokenThreads = 256;
constexpr int kNextTokenUnroll = 2;  // 16-byte loads in flight per thread
// Each row is read by up to kNextTokenMaxParts blocks of about kNextTokenPartElems scores: one block a row leaves one
// SM reading a whole row (256 KB for a 128k vocabulary).
constexpr int kNextTokenPartElems = kNextTokenThreads * kNextTokenUnroll * 8;

// Whether (v, i) comes before (w, j) in torch.argmax's order: NaN before numbers, then the larger value, then the
// lower index.
__device__ __forceinline__ bool ahead(float v, int i, float w, int j) {
  const bool v_nan = v != v, w_nan = w != w;
  if (v_nan != w_nan) return v_nan;
  if (v_nan || v == w) return i < j;
  return v > w;
}

__device__ __forceinline__ void warp_argmax(float& v, int& i) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float w = __shfl_xor_sync(0xffffffffu, v, offset);
    const int j = __shfl_xor_sync(0xffffffffu, i, offset);
    if (ahead(w, j, v, i)) v = w, i = j;
  }
}

// Reduces every thread's (value, index) to thread 0's. `values` / `indices`: 32 entries of shared memory.
__device__ __forceinline__ void block_argmax(float& v, int& i, float* values, int* indices) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  warp_argmax(v, i);
  if (lane == 0) values[warp] = v, indices[warp] = i;
  __syncthreads();
  if (warp == 0) {
    const int warps = static_cast<int>(blockDim.x >> 5);
    v = lane < warps ? values[lane] : -INFINITY;
    i = lane < warps ? indices[lane] : INT32_MAX;
    warp_argmax(v, i);
  }
}

// Copies `bytes` from src to dst with all threads of the block, 16 bytes at a time where both allow it.
__device__ __forceinline__ void block_copy(char* dst, const char* src, int64_t bytes, int elem_bytes) {
  if (aligned16(dst) && aligned16(src) && bytes % 16 == 0) {
    for (int64_t at = threadIdx.x * 16; at < bytes; at += blockDim.x * 16)
      *reinterpret_cast<uint4*>(dst + at) = *reinterpret_cast<const uint4*>(src + at);
  } else if (elem_bytes == 4) {
    for (int64_t at = threadIdx.x * 4; at < bytes; at += blockDim.x * 4)
      *reinterpret_cast<uint32_t*>(dst + at) = *reinterpret_cast<const uint32_t*>(src + at);
  } else {
    for (int64_t at = threadIdx.x * 2; at < bytes; at += blockDim.x * 2)
      *reinterpret_cast<uint16_t*>(dst + at) = *reinterpret_cast<const uint16_t*>(src + at);
  }
}

// The last block's part: each row's token from its parts' partial results, the bookkeeping, the embeddings.
__device__ void finish_rows(const NextTokenParams& p, const float* part_values, const int* part_indices, int parts) {
  __shared__ int64_t chosen[kNextTokenMaxBatch];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = static_cast<int>(blockDim.x >> 5);
  const int64_t slot = *p.slot;
  for (int b = warp; b < p.batch; b += warps) {
    float v = -INFINITY;
    int i = INT32_MAX;
    for (int c = lane; c < parts; c += 32) {  // the other blocks' writes: read from L2 (__ldcg), not L1
      const float w = __ldcg(part_values + b * parts + c);
      const int j = __ldcg(part_indices + b * parts + c);
      if (ahead(w, j, v, i)) v = w, i = j;
    }
    warp_argmax(v, i);
    if (lane == 0) {
      const int64_t best = p.ids ? p.ids[b * p.ids_stride + i] : i;
      const int64_t token = p.finished[b] ? *p.pad_token : best;
      bool eos = false;
      for (int e = 0; e < p.num_eos; ++e) eos |= p.eos[e] == token;
      if (eos) p.finished[b] = 1;
      if (slot + 1 < p.columns) p.tokens[b * p.tokens_stride + slot + 1] = token;
      chosen[b] = token;
    }
  }
  __syncthreads();
  // The runner checks the pad id against the embedding (an argmax is below vocab <= embed_rows; an id of `ids` is
  // checked here).
  if (p.embed) {
    const int64_t row_bytes = p.hidden * p.embed_elem_bytes;
    for (int b = 0; b < p.batch; ++b) {
      if (chosen[b] >= 0 && chosen[b] < p.embed_rows)
        block_copy(static_cast<char*>(p.x) + b * row_bytes, static_cast<const char*>(p.embed) + chosen[b] * row_bytes,
                   row_bytes, p.embed_elem_bytes);
    }
  }
  if (threadIdx.x == 0) *p.slot = slot + 1;
}

// Grid: (parts, batch); block (c, b) reduces part c of row b to one (value, index) in the workspace, and the last
// block to finish (a ticket) does the rest. VEC scores per load (1 where the rows are not 16-byte aligned).
template <typename T, int VEC>
__global__ void __launch_bounds__(kNextTokenThreads) next_token_kernel(const NextTokenParams p) {
  __shared__ float values[32];
  __shared__ int indices[32];
  __shared__ bool last;
  griddep_wait();
  // After the wait, not at entry: it ends the step and writes the slot, the token and the next step's input. Under
  // the step's CUDA graph nothing follows it in the replay; where steps run back to back in one stream, the next
  // step's first kernels then start only once the logits are final. (The first decode attention of that step is
  // held back by the QKV projection before it in any case: common.cuh, feeds_attention.)
  griddep_launch_dependents();
  const int c = blockIdx.x, b = blockIdx.y, parts = static_cast<int>(gridDim.x);
  const Vec<T, VEC>* row = reinterpret_cast<const Vec<T, VEC>*>(static_cast<const T*>(p.scores) + b * p.scores_stride);
  const int vectors = static_cast<int>(p.vocab / VEC), per_part = (vectors + parts - 1) / parts;
  const int begin = min(vectors, c * per_part), end = min(vectors, begin + per_part);

  // Each thread's best over its vectors, in increasing index order (so a tie keeps the earlier index).
  float best = -INFINITY;
  int best_i = INT32_MAX;
  const int step = static_cast<int>(blockDim.x);
  for (int base = begin + static_cast<int>(threadIdx.x); base < end; base += step * kNextTokenUnroll) {
    Vec<T, VEC> v[kNextTokenUnroll];
#pragma unroll
    for (int u = 0; u < kNextTokenUnroll; ++u) {
      if (base + u * step < end) v[u] = row[base + u * step];
    }
#pragma unroll
    for (int u = 0; u < kNextTokenUnroll; ++u) {
      if (base + u * step < end) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          const float value = to_float(v[u].data[e]);
          const int i = (base + u * step) * VEC + e;
          if (ahead(value, i, best, best_i)) best = value, best_i = i;
        }
      }
    }
  }
  block_argmax(best, best_i, values, indices);

  // workspace: [0] the ticket, then the parts' values [batch][parts] (as float bits), then their indices.
  float* part_values = reinterpret_cast<float*>(p.workspace + 1);
  int* part_indices = p.workspace + 1 + p.batch * parts;
  if (threadIdx.x == 0) {
    part_values[b * parts + c] = best;
    part_indices[b * parts + c] = best_i;
    __threadfence();  // the partial result before the ticket; after the ticket (last block) the others' results
    const int blocks = parts * static_cast<int>(p.batch);
    last = atomicAdd(p.workspace, 1) == blocks - 1;
    if (last) {
      __threadfence();
      *p.workspace = 0;  // zero for the next launch
    }
  }
  __syncthreads();
  if (last) finish_rows(p, part_values, part_indices, parts);
}

int next_token_parts(int64_t vocab) {
  const int64_t parts = (vocab + kNextTokenPartElems - 1) / kNextTokenPartElems;
  return static_cast<int>(parts < 1 ? 1 : parts > kNextTokenMaxParts ? kNextTokenMaxParts : parts);
}

template <typename T>
cudaError_t launch_next_token_as(const NextTokenParams& p, cudaStream_t stream) {
  constexpr int vec = 16 / sizeof(T);
  const int parts = next_token_parts(p.vocab);
  const dim3 grid(static_cast<unsigned>(parts), static_cast<unsigned>(p.batch)), block(kNextTokenThreads);
  if (aligned16(p.scores) && p.vocab % vec == 0 && p.scores_stride % vec == 0)
    return launch_pdl(next_token_kernel<T, vec>, grid, block, 0, stream, p);
  return launch_pdl(next_token_kernel<T, 1>, grid, block, 0, stream, p);
}

}  // namespace

cudaError_t launch_next_token(const NextTokenParams& p, cudaStream_t stream) {
  if (p.batch == 0) return cudaSuccess;
  if (p.batch > kNextTokenMaxBatch) return cudaErrorInvalidValue;
  PATCHER_DISPATCH_DTYPE(p.dtype, T, { return launch_next_token_as<T>(p, stream); });
  return cudaSuccess;
}

}  // namespace patcher
