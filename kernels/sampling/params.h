// The decode loop's next token: parameters and launcher (next_token.cu).
//
// Plain structs of pointers, sizes and strides for the torch glue (kernels/bindings.cpp) and the kernels: nothing
// here includes torch. Strides are in elements. Every launcher returns the CUDA error of its launch (cudaSuccess when
// nothing had to be launched).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/types.h"

namespace patcher {

// The decode step's last op (next_token.cu): each row's next token, the argmax of its scores (torch.argmax's order:
// NaN first, then the first index of the maximum), or pad_token once the row has finished; then finished |= token
// in eos, tokens[b, slot + 1] = token, x[b] = embed[token] (when embed is set), and slot += 1.
struct NextTokenParams {
  DType dtype;  // of scores
  int64_t batch, vocab;
  const void* scores;  // [batch, vocab], row stride scores_stride
  int64_t scores_stride;
  int64_t* tokens;  // [batch, columns], row stride tokens_stride (no write where slot + 1 >= columns)
  int64_t tokens_stride, columns;
  int64_t* slot;       // [1] device: the current token's column
  uint8_t* finished;   // [batch] device (torch.bool)
  const int64_t* eos;  // [num_eos] device, -1 for unused entries
  int32_t num_eos;
  const int64_t* pad_token;  // [] device
  const void* embed;         // [embed_rows, hidden] contiguous, or nullptr (no x)
  int64_t embed_rows, hidden, embed_elem_bytes;
  void* x;             // [batch, hidden] contiguous, embed's dtype
  int32_t* workspace;  // next_token_workspace_size(batch) int32, zero on entry and left zero
  const int64_t* ids;  // [batch, vocab], row stride ids_stride, or nullptr: the token is ids[b, argmax] where set
  int64_t ids_stride;
};
constexpr int kNextTokenMaxParts = 64, kNextTokenMaxBatch = 64;
inline int64_t next_token_workspace_size(int64_t batch) {
  return 1 + 2 * batch * kNextTokenMaxParts;  // the ticket, then each part's value and index
}
cudaError_t launch_next_token(const NextTokenParams& p, cudaStream_t stream);

// transformers' sampling warpers and the draw on top-k's survivors (warp_survivors.cu), one block a row. values and
// ids: torch.topk's m largest float32 scores of each row (values in descending order, ids distinct); noise: Exp(1)
// draws. Writes, each row's survivors in increasing id order: sorted_ids, warped (temperature, top-k, top-p with a
// stable ascending sort, min-p; -inf where one removed a token) and draw = softmax(warped) / noise.
struct WarpSurvivorsParams {
  int64_t batch, m;  // m: 1 .. kWarpSurvivorsMax
  const float* values;
  int64_t values_stride;
  const int64_t* ids;
  int64_t ids_stride;
  const float* noise;
  int64_t noise_stride;
  bool scale;             // temperature != 1: scores * inv_temperature (torch's CUDA division by a scalar)
  float inv_temperature;  // 1.0f / float(temperature)
  int32_t top_k;          // applied where 0 < top_k < m
  bool top_p_on;          // top_p < 1
  float top_p_limit;      // float(1 - top_p), the cumulative probability at or below which tokens go
  float min_p;            // <= 0: off
  float* warped;          // [batch, m] contiguous
  int64_t* sorted_ids;    // [batch, m] contiguous
  float* draw;            // [batch, m] contiguous
};
constexpr int kWarpSurvivorsMax = 1024;
cudaError_t launch_warp_survivors(const WarpSurvivorsParams& p, cudaStream_t stream);

}  // namespace patcher
