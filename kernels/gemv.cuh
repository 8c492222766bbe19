// Matrix-vector products for decode: 1 to 8 rows of x against a row-major weight [N, K] (nn.Linear layout),
// with the bias and the MLP activation fused into the epilogue.
//
// Bytes: the weight is read once and dominates (x is a few KB and stays in L1/L2), so the kernel is built to keep
// enough 16-byte weight loads in flight to saturate HBM: every warp owns ROWS output rows (2 rows, or 2 gate/up
// row pairs for SwiGLU), each lane streams 16-byte chunks of all of them with UNROLL chunks issued before the
// first is used, and the x chunk it loads serves every row of the warp. Matrices with few rows split K over the
// warps of a block so that every SM has enough warps streaming. Weights are loaded with the streaming cache hint
// (read once, evicted first) so they do not push x out of L1. The kernel is launched with programmatic dependent
// launch, and its first weight loads are issued before it waits for the previous kernel, so they overlap that
// kernel's tail. Accumulation is fp32; a warp reduction
// finishes each dot product, and lane 0 applies the epilogue with HF's rounding points:
//   plain:   out = round(act(round(x.w + b)))     (the act is skipped for kActNone: out = round(x.w + b))
//   SwiGLU:  out = round(round(silu(round(x.w_gate + b_gate))) * round(x.w_up + b_up))
//   RoPE:    the fused QKV projection of a decode step; a warp's two rows are a rotation pair (rope_pair_rows),
//            so lane 0 rounds both (round(x.w + b)), rotates them and writes q or the K/V cache slot, which makes
//            the separate rope_qkv_cache kernel unnecessary
#include "common.cuh"
#include "rope.cuh"

namespace patcher {
namespace {

constexpr int kWarps = 4;

// One chunk of V weights, loaded raw (converted where it is used, so a chunk in flight costs 16 bytes of registers).
template <typename T, int V>
__device__ __forceinline__ Vec<T, V> load_weights(const T* src) {
  Vec<T, V> v;
  if constexpr (V * sizeof(T) == 16) {
    *reinterpret_cast<uint4*>(&v) = __ldcs(reinterpret_cast<const uint4*>(src));
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) v.data[i] = src[i];
  }
  return v;
}

template <typename T, int V>
__device__ __forceinline__ void load_x(float (&dst)[V], const T* src) {
  if constexpr (V * sizeof(T) == 16) {
    load_vec<T, V>(dst, src);
  } else {
#pragma unroll
    for (int i = 0; i < V; ++i) dst[i] = to_float(src[i]);
  }
}

// The weights of one loop iteration: UNROLL chunks of every row, this lane's first one at k0 (chunks step 32 * V
// apart). Chunks at or past k_end are not read (and not used).
template <typename T, int V, int NW, int UNROLL>
__device__ __forceinline__ void fetch_weights(Vec<T, V> (&w)[UNROLL][NW], const T* (&rows)[NW], int64_t k0,
                                              int64_t k_end) {
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    const int64_t k = k0 + u * 32 * V;
    if (k < k_end) {
#pragma unroll
      for (int r = 0; r < NW; ++r) w[u][r] = load_weights<T, V>(rows[r] + k);
    }
  }
}

// What a warp's rows are and what its epilogue does.
enum RowMode : int {
  kPlainRows = 0,   // rows first, first + 1; act none / gelu / gelu_tanh
  kPairedRows = 1,  // SwiGLU: gate rows first, first + 1 and their up rows n later
  kRopeRows = 2,    // fused QKV: the pair of rope_pair_rows, rotated and stored into q and the KV cache
};

// Each block has kWarps warps; KSPLIT of them share one group of ROWS output rows, each taking 1/KSPLIT of K
// (more warps in flight for matrices with few rows), and their partial sums meet in shared memory.
template <typename T, int V, int BMAX, int ROWS, int MODE, int UNROLL, int KSPLIT>
__global__ void __launch_bounds__(kWarps * 32) gemv_kernel(const GemvParams p) {
  static_assert(MODE != kRopeRows || ROWS == 2, "a RoPE warp computes one rotation pair");
  constexpr bool PAIRED = MODE == kPairedRows;
  constexpr int NW = PAIRED ? 2 * ROWS : ROWS;  // weight rows this warp streams
  constexpr int GROUPS = kWarps / KSPLIT;       // row groups per block
  __shared__ float s_partial[kWarps][NW][BMAX];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int part = warp % KSPLIT;
  const int64_t first = (static_cast<int64_t>(blockIdx.x) * GROUPS + warp / KSPLIT) * ROWS;
  const bool live = first < p.n;
  if (KSPLIT == 1 && !live) return;  // whole warps leave together (no block barrier without a K split)
  const T* x = static_cast<const T*>(p.x);
  int64_t row_of[ROWS];  // the output rows of this warp
#pragma unroll
  for (int r = 0; r < ROWS; ++r) row_of[r] = first + r < p.n ? first + r : p.n - 1;  // past the end: not stored
  if constexpr (MODE == kRopeRows) {
    if (live) rope_pair_rows(first / 2, static_cast<int>(p.rope.head_dim), static_cast<int>(p.rope.rotary_dim), row_of);
  }
  const T* rows[NW];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    rows[r] = static_cast<const T*>(p.w) + row_of[r] * p.w_stride;
    if (PAIRED) rows[ROWS + r] = static_cast<const T*>(p.w) + (row_of[r] + p.n) * p.w_stride;
  }
  // This warp's slice of K, a multiple of V long (the last slice takes the rest).
  const int64_t slice = (p.k / KSPLIT + V - 1) / V * V;
  const int64_t k_begin = part * slice < p.k ? part * slice : p.k;
  const int64_t k_end = part == KSPLIT - 1 ? p.k : (k_begin + slice < p.k ? k_begin + slice : p.k);

  float acc[NW][BMAX];
#pragma unroll
  for (int r = 0; r < NW; ++r)
#pragma unroll
    for (int b = 0; b < BMAX; ++b) acc[r][b] = 0.f;

  // The first iteration's weights are loaded before griddepcontrol.wait: weights are never written by an earlier
  // kernel, so under programmatic dependent launch these loads overlap the previous kernel's tail, which is most
  // of a small matrix's bytes. (An L2 prefetch of more weights here made large matrices slower on the H100,
  // 79 -> 105 us for Llama's gate/up, as each warp's prefetch raced its own loads through L2; registers are read
  // once.) Each iteration then uses its chunks and loads the next iteration's.
  const int64_t step = 32 * V;  // elements one warp-wide load covers
  int64_t k0 = k_begin + lane * V;
  Vec<T, V> w[UNROLL][NW];
  if (live) fetch_weights<T, V, NW, UNROLL>(w, rows, k0, k_end);
  griddep_wait();
  griddep_launch_dependents();

  if (live) {
    for (; k0 < k_end; k0 += step * UNROLL) {
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        const int64_t k = k0 + u * step;
        if (k >= k_end) break;
#pragma unroll
        for (int b = 0; b < BMAX; ++b) {
          if (b < p.batch) {
            float xv[V];
            load_x<T, V>(xv, x + b * p.x_stride + k);
#pragma unroll
            for (int r = 0; r < NW; ++r)
#pragma unroll
              for (int j = 0; j < V; ++j) acc[r][b] += to_float(w[u][r].data[j]) * xv[j];
          }
        }
      }
      fetch_weights<T, V, NW, UNROLL>(w, rows, k0 + step * UNROLL, k_end);
    }
  }
#pragma unroll
  for (int r = 0; r < NW; ++r)
#pragma unroll
    for (int b = 0; b < BMAX; ++b) acc[r][b] = warp_sum(acc[r][b]);
  if (KSPLIT > 1) {  // add up the K slices of this row group
    if (lane == 0) {
#pragma unroll
      for (int r = 0; r < NW; ++r)
#pragma unroll
        for (int b = 0; b < BMAX; ++b) s_partial[warp][r][b] = acc[r][b];
    }
    __syncthreads();
    if (part != 0 || !live) return;
#pragma unroll
    for (int r = 0; r < NW; ++r)
#pragma unroll
      for (int b = 0; b < BMAX; ++b) {
        float total = 0.f;
#pragma unroll
        for (int q = 0; q < KSPLIT; ++q) total += s_partial[warp + q][r][b];
        acc[r][b] = total;
      }
  }
  if (lane != 0) return;

  const T* bias = static_cast<const T*>(p.bias);
  T* out = static_cast<T*>(p.out);
  if constexpr (MODE == kRopeRows) {  // round as F.linear rounds its output, then rotate and store the pair
#pragma unroll
    for (int b = 0; b < BMAX; ++b) {
      if (b >= p.batch) break;
      float y[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) y[r] = round_to<T>(acc[r][b] + (bias ? to_float(bias[row_of[r]]) : 0.f));
      rope_store_pair<T>(p.rope, b, row_of, y, out);
    }
  } else {
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const int64_t o = first + r;
      if (o >= p.n) break;
#pragma unroll
      for (int b = 0; b < BMAX; ++b) {
        if (b >= p.batch) break;
        float y;
        if (PAIRED) {
          const float gate = round_to<T>(acc[r][b] + (bias ? to_float(bias[o]) : 0.f));
          const float up = round_to<T>(acc[ROWS + r][b] + (bias ? to_float(bias[o + p.n]) : 0.f));
          y = round_to<T>(silu(gate)) * up;
        } else {
          y = acc[r][b] + (bias ? to_float(bias[o]) : 0.f);
          if (p.act != kActNone) y = gelu(round_to<T>(y), p.act == kActGeluTanh);
        }
        out[b * p.n + o] = from_float<T>(y);
      }
    }
  }
}

int multiprocessors() {
  static const int count = [] {
    int device = 0, sms = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    return sms;
  }();
  return count;
}

template <typename T, int V, int BMAX, int MODE, int UNROLL>
cudaError_t launch_rows(const GemvParams& p, cudaStream_t stream) {
  constexpr int ROWS = 2;
  const int64_t groups = (p.n + ROWS - 1) / ROWS;
  // Few rows: split K over the 4 warps of a block, so that enough warps stream weights to fill every SM
  // (without it a 1536-row matrix runs 768 warps, under 6 per SM, and the wave tail dominates).
  if (groups < 16 * multiprocessors() && p.k >= 1024) {
    return launch_pdl(gemv_kernel<T, V, BMAX, ROWS, MODE, UNROLL, kWarps>, dim3(static_cast<unsigned>(groups)),
                      dim3(kWarps * 32), 0, stream, p);
  }
  const unsigned blocks = static_cast<unsigned>((groups + kWarps - 1) / kWarps);
  return launch_pdl(gemv_kernel<T, V, BMAX, ROWS, MODE, UNROLL, 1>, dim3(blocks), dim3(kWarps * 32), 0, stream, p);
}

template <typename T, int V, int BMAX>
cudaError_t launch_act(const GemvParams& p, cudaStream_t stream) {
  // Fewer chunks in flight when a warp already holds many accumulators (register pressure).
  if (p.act == kActSiluMul) return launch_rows<T, V, BMAX, kPairedRows, (BMAX >= 4 ? 2 : 4)>(p, stream);
  if (p.act == kActRopeCache) return launch_rows<T, V, BMAX, kRopeRows, (BMAX >= 8 ? 2 : 4)>(p, stream);
  return launch_rows<T, V, BMAX, kPlainRows, (BMAX >= 8 ? 2 : 4)>(p, stream);
}

template <typename T, int V>
cudaError_t launch_batch(const GemvParams& p, cudaStream_t stream) {
  if (p.batch <= 1) return launch_act<T, V, 1>(p, stream);
  if (p.batch <= 2) return launch_act<T, V, 2>(p, stream);
  if (p.batch <= 4) return launch_act<T, V, 4>(p, stream);
  return launch_act<T, V, 8>(p, stream);
}

template <typename T>
bool can_vectorize(const GemvParams& p) {
  constexpr int vec = 16 / sizeof(T);
  return p.k % vec == 0 && p.w_stride % vec == 0 && p.x_stride % vec == 0 && aligned16(p.w) && aligned16(p.x);
}

}  // namespace

cudaError_t launch_gemv(const GemvParams& p, cudaStream_t stream) {
  if (p.batch == 0 || p.n == 0) return cudaSuccess;
  if (p.batch > 8) return cudaErrorInvalidValue;
  if (p.act == kActRopeCache && (p.n % 2 || p.rope.head_dim % 2 || p.rope.rotary_dim % 2)) return cudaErrorInvalidValue;
  PATCHER_DISPATCH_DTYPE(p.dtype, T, {
    if (can_vectorize<T>(p)) return launch_batch<T, 16 / sizeof(T)>(p, stream);
    // Element-wise loads (a misaligned or odd-sized input, rare in models): one kernel for 1-8 rows, a shorter build.
    return launch_act<T, 1, 8>(p, stream);
  });
  return cudaSuccess;
}

}  // namespace patcher
