// GGUF block-quantized linears: parameters and launchers (gguf.cu).
//
// Plain structs of pointers, sizes and strides for the torch glue (kernels/bindings_gguf.h) and the kernels: nothing
// here includes torch. Strides are in elements. The launcher returns the CUDA error of its launch (cudaSuccess when
// nothing had to be launched).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/types.h"

namespace patcher {

// The GGUF block types the kernels take (ggml's type numbers; layouts in patcher/gguf/format.py):
//   Q4_0   32 values, 18 bytes: d fp16 | qs[16]           w = d * (nibble - 8)
//   Q4_1   32 values, 20 bytes: d fp16 | m fp16 | qs[16]   w = d * nibble + m
//   Q8_0   32 values, 34 bytes: d fp16 | qs int8[32]       w = d * q
// Nibbles: element i < 16 is the low nibble of qs[i], element i >= 16 the high nibble of qs[i - 16].
// The K-quants, super-blocks of 256 values in 8 sub-blocks of 32 (16 groups of 16 for Q6_K's scales):
//   Q4_K  144 bytes: d fp16 | dmin fp16 | scales[12] | qs[128]            w = (d * sc[j]) * q - dmin * mn[j]
//   Q5_K  176 bytes: d fp16 | dmin fp16 | scales[12] | qh[32] | qs[128]   w as Q4_K, q of 5 bits
//   Q6_K  210 bytes: ql[128] | qh[64] | scales int8[16] | d fp16            w = (d * scales[g]) * (q - 32)
enum GgufKind : int32_t { kGgufQ4_0 = 2, kGgufQ4_1 = 3, kGgufQ8_0 = 8, kGgufQ4_K = 12, kGgufQ5_K = 13, kGgufQ6_K = 14 };

// y [batch, n] = x [batch, k] . W^T + bias, W [n, k] the GGUF rows `blocks` (n rows of k / block values blocks, row
// after row, each row `row_bytes` = k / block values * block bytes long). Two modes (patcher/gguf/reference.py):
//   quantize_activations (W4A8): each row of x quantized to Q8_1 blocks of 32 (d = max|x| / 127 stored as fp16,
//     q = roundf(x / d), s = d * sum(q)); per block the integer dot product isum of the weight's and the activation's
//     integers, then  y = sum_blocks (d_w * d_a) * isum  +  sum_blocks m_w * s_a  (Q4_1 only)  +  bias  in fp32,
//     each product and sum rounded once (no fused multiply-add), rounded to the dtype once at the end. The K-quants
//     take the same form per 32-value sub-block, d_w = d * sc[j] and m_w = -(dmin * mn[j]) (each an fp32 product);
//     Q6_K per 16-value group, d_w = d * scales[g], with the d_a of the Q8_1 block the group lies in, no m_w.
//   otherwise (W4A16): the weights dequantized in fp32 as gguf.quants forms them, rounded to the dtype (the
//     reference's weight.to(x.dtype)), multiplied with x in fp32, plus the bias rounded to the dtype, rounded once.
// Up to kGgufMaxSegments weights (a projection's modules: q, k, v) share x and one output, side by side: segment i
// writes columns [out_col, out_col + n) of out [batch, out_stride]. Their block types may differ.
constexpr int kGgufMaxSegments = 3;
struct GgufSegment {
  int32_t kind;           // GgufKind
  int64_t n;              // output features (rows of W)
  const uint8_t* blocks;  // [n, row_bytes] contiguous
  int64_t row_bytes;
  const void* bias;  // [n] or nullptr, in bias_dtype
  DType bias_dtype;
  int64_t out_col;  // the first column of out this segment writes
};
struct GgufGemvParams {
  DType dtype;  // of x and out
  bool quantize_activations;
  int64_t batch;  // rows of x, 1..8
  int64_t k;      // input features, a positive multiple of every segment's block values (32, or 256 for K-quants)
  const void* x;  // [batch, k], row stride x_stride, last dimension contiguous
  int64_t x_stride;
  GgufSegment seg[kGgufMaxSegments];
  int32_t segments;  // 1..kGgufMaxSegments
  void* out;         // [batch, out_stride] contiguous
  int64_t out_stride;
  void* work;  // gguf_gemv_work_bytes(batch, k, quantize_activations), 16-byte aligned: x as the GEMV reads it
  // The workspace already holds x (the norm in front wrote it: NormParams::gguf_work): no input kernel, x unread.
  bool work_ready;
  // x is a gated MLP's [gate | up] [batch, 2k] (row stride x_stride, x pointing at the gate half): the input kernel
  // takes silu(gate) * up as silu_and_mul rounds it (kernels/activation/activation.cu) for the GEMV's input.
  bool silu_mul_input;
  // The op right before a decode attention that reads its output (decode_attention_qkv): the last GEMV launch
  // triggers after its wait (common.cuh: griddep_trigger_after_wait).
  bool feeds_attention;
};
// The workspace of one product: x written once in the form the GEMV's lanes read (kernels/gguf/gguf_gemv.cuh).
// W4A8: q int8 [batch, k] | d fp32 [batch, k / 32] | s fp32 [batch, k / 32] | sum(q) int32 [batch, k / 32];
// W4A16: x in fp32 [batch, k].
inline int64_t gguf_gemv_work_bytes(int64_t batch, int64_t k, bool quantize_activations) {
  return quantize_activations ? batch * k + 3 * 4 * batch * (k / 32) : 4 * batch * k;
}
// Bytes per block of a GgufKind, 0 for any other value.
PATCHER_HOST_DEVICE inline int gguf_block_bytes(int32_t kind) {
  switch (kind) {
    case kGgufQ4_0:
      return 18;
    case kGgufQ4_1:
      return 20;
    case kGgufQ8_0:
      return 34;
    case kGgufQ4_K:
      return 144;
    case kGgufQ5_K:
      return 176;
    case kGgufQ6_K:
      return 210;
  }
  return 0;
}
// Values per block of a GgufKind: 256 for the K-quants' super-blocks, 32 otherwise.
PATCHER_HOST_DEVICE inline int gguf_block_values(int32_t kind) {
  return kind == kGgufQ4_K || kind == kGgufQ5_K || kind == kGgufQ6_K ? 256 : 32;
}
constexpr int64_t kGgufMaxBatch = 8;
cudaError_t launch_gguf_gemv(const GgufGemvParams& p, cudaStream_t stream);

// The prefill path (more rows than a decode step): W [n, k] dequantized into `out` in the dtype, each value formed
// in fp32 as gguf.quants forms it (format.dequantize) and rounded to the dtype once, for a cuBLAS GEMM.
struct GgufDequantizeParams {
  DType dtype;  // of out
  int32_t kind;
  int64_t n, k;
  const uint8_t* blocks;  // [n, row_bytes] contiguous
  int64_t row_bytes;
  void* out;  // [n, k] contiguous
};
cudaError_t launch_gguf_dequantize(const GgufDequantizeParams& p, cudaStream_t stream);

// x rounded through Q8_1 as the W4A8 GEMV quantizes it (reference.quantize_q8_1): per 32 values q = roundf(x / d),
// then out = q * d (d its fp16 value; the product exact in fp32) rounded to the dtype. A GEMM of these values with
// the dequantized weights is the W4A8 product up to the dtype's rounding of q * d.
struct Q8_1RoundParams {
  DType dtype;  // of x and out
  int64_t rows, k;  // k a multiple of 32
  const void* x;  // [rows, k], row stride x_stride, last dimension contiguous
  int64_t x_stride;
  void* out;  // [rows, k] contiguous
  // x is a gated MLP's [gate | up] [rows, 2k] (row stride x_stride, x pointing at the gate half): the values
  // rounded are silu(gate) * up as silu_and_mul rounds it (the down projection's prefill input).
  bool silu_mul_input;
};
cudaError_t launch_round_q8_1(const Q8_1RoundParams& p, cudaStream_t stream);

}  // namespace patcher
