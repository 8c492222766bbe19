// The GGUF decode GEMV's launchers: the input kernel, then per block type the general kernel (gguf_gemv.cuh) or,
// for W4A8 over aligned blocks, the aligned one (gguf_gemv_aligned.cuh). Included by one .cu file per
// dtype (gguf_half.cu, gguf_bf16.cu, gguf_float.cu).
#pragma once
#include "gguf/gguf_gemv_aligned.cuh"

namespace patcher {
namespace {

template <typename T, int KIND, bool A8, int BMAX, bool ALIGNED>
cudaError_t launch_gguf(const GgufGemvParams& p, cudaStream_t stream) {
  int64_t rows = 0;
  for (int i = 0; i < p.segments; ++i) rows += p.seg[i].n;
  const dim3 grid(static_cast<unsigned>((rows + kGgufWarps - 1) / kGgufWarps));
  if constexpr (ALIGNED) {
    if constexpr (kAlignedMultiRowKind<KIND> && BMAX == 1) {
      const int per_warp = gguf_aligned_rows<KIND>(p, rows);
      const dim3 wide(static_cast<unsigned>((rows + per_warp * kGgufWarps - 1) / (per_warp * kGgufWarps)));
      if constexpr (kAlignedWideKind<KIND>) {
        if (per_warp == 4) {
          return launch_pdl(gguf_gemv_aligned_kernel<T, KIND, BMAX, 4, false>, wide, dim3(kGgufWarps * 32), 0, stream,
                            p);
        }
      }
      if (per_warp == 2) {
        return launch_pdl(gguf_gemv_aligned_kernel<T, KIND, BMAX, 2, true>, wide, dim3(kGgufWarps * 32), 0, stream, p);
      }
      if (p.k >= kAlignedLongK) {
        return launch_pdl(gguf_gemv_aligned_kernel<T, KIND, BMAX, 1, true>, grid, dim3(kGgufWarps * 32), 0, stream, p);
      }
    }
    return launch_pdl(gguf_gemv_aligned_kernel<T, KIND, BMAX, 1>, grid, dim3(kGgufWarps * 32), 0, stream, p);
  } else {
    return launch_pdl(gguf_gemv_kernel<T, KIND, A8, BMAX>, grid, dim3(kGgufWarps * 32), 0, stream, p);
  }
}

template <typename T, int KIND, bool A8, bool ALIGNED>
cudaError_t launch_gguf_batch(const GgufGemvParams& p, cudaStream_t stream) {
  if (p.batch <= 1) return launch_gguf<T, KIND, A8, 1, ALIGNED>(p, stream);
  if (p.batch <= 2) return launch_gguf<T, KIND, A8, 2, ALIGNED>(p, stream);
  if (p.batch <= 4) return launch_gguf<T, KIND, A8, 4, ALIGNED>(p, stream);
  return launch_gguf<T, KIND, A8, 8, ALIGNED>(p, stream);
}

// W4A8 takes the aligned kernel where the layout allows (gguf_gemv_aligned.cuh).
template <typename T, int KIND>
cudaError_t launch_gguf_mode(const GgufGemvParams& p, cudaStream_t stream) {
  if (p.quantize_activations && gguf_rows_aligned<KIND>(p)) return launch_gguf_batch<T, KIND, true, true>(p, stream);
  return p.quantize_activations ? launch_gguf_batch<T, KIND, true, false>(p, stream)
                                : launch_gguf_batch<T, KIND, false, false>(p, stream);
}

// The dtype's launcher over every kind, which gguf_<dtype>.cu instantiates.
template <typename T, bool A8, bool SILU>
cudaError_t launch_gguf_input(const GgufGemvParams& p, cudaStream_t stream) {
  const int64_t threads = p.batch * (p.k / 8);
  const dim3 grid(static_cast<unsigned>((threads + kInputThreads - 1) / kInputThreads));
  // (the up half starts k values, a multiple of 32, after the gate half: aligned with it)
  if (rows_aligned16<T>(p.x, p.x_stride)) {
    return launch_pdl(gguf_input_kernel<T, A8, true, SILU>, grid, dim3(kInputThreads), 0, stream, p);
  }
  return launch_pdl(gguf_input_kernel<T, A8, false, SILU>, grid, dim3(kInputThreads), 0, stream, p);
}

template <typename T, bool A8>
cudaError_t launch_gguf_input(const GgufGemvParams& p, cudaStream_t stream) {
  return p.silu_mul_input ? launch_gguf_input<T, A8, true>(p, stream) : launch_gguf_input<T, A8, false>(p, stream);
}

// The input kernel (unless the workspace is ready), then one GEMV launch per block type among the segments (in their
// order), each over the segments of its type.
template <typename T>
cudaError_t launch_gguf_gemv_typed(const GgufGemvParams& p, cudaStream_t stream) {
  if (!p.work_ready) {
    const cudaError_t input =
        p.quantize_activations ? launch_gguf_input<T, true>(p, stream) : launch_gguf_input<T, false>(p, stream);
    if (input != cudaSuccess) return input;
  }
  bool launched[kGgufMaxSegments] = {};
  for (int i = 0; i < p.segments; ++i) {
    if (launched[i]) continue;
    GgufGemvParams one = p;
    one.segments = 0;
    for (int j = i; j < p.segments; ++j) {
      if (p.seg[j].kind != p.seg[i].kind) continue;
      one.seg[one.segments++] = p.seg[j];
      launched[j] = true;
    }
    // Only the last launch is right before the attention; the ones before it trigger at entry.
    for (int j = i; j < p.segments; ++j) one.feeds_attention = one.feeds_attention && launched[j];
    const cudaError_t e =
        with_kind(one.seg[0].kind, [&](auto kind) { return launch_gguf_mode<T, kind.value>(one, stream); });
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

}  // namespace
}  // namespace patcher
