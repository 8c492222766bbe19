// The decode loop's sampling and next token: parameters and launchers (sample_survivors.cu, next_token.cu,
// repetition_penalty.cu).
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

// transformers' sampling warpers and the draw on the m largest scores of each row (sample_survivors.cu): blocks of
// kSampleSurvivorsPartElems scores select their m largest into the workspace, and the last block of a row to finish
// selects the row's m largest from theirs, then warps them. Writes, each row's survivors in increasing id order:
// sorted_ids, warped (temperature, top-k, top-p with a stable ascending sort, min-p; -inf where one removed a token)
// and draw = softmax(warped) / noise, whose argmax is a draw from the warped distribution. Which of several scores
// equal to the m-th largest survive is the kernel's choice (as torch.topk's is its own), the same every launch.
struct SampleSurvivorsParams {
  DType dtype;  // of scores
  int64_t batch, vocab, m;  // m: 1 .. min(vocab, kSampleSurvivorsMax); vocab <= kSampleSurvivorsMaxVocab
  const void* scores;       // [batch, vocab], row stride scores_stride
  int64_t scores_stride;
  const float* noise;  // [batch, m] Exp(1) draws, row stride noise_stride
  int64_t noise_stride;
  bool scale;             // temperature != 1: scores * inv_temperature (torch's CUDA division by a scalar)
  float inv_temperature;  // float(1.0 / temperature): the reciprocal in double, rounded once, as torch's
  int32_t top_k;          // applied where 0 < top_k < m
  bool top_p_on;          // top_p < 1
  float top_p_limit;      // float(1 - top_p), the cumulative probability at or below which tokens go
  float min_p;            // <= 0: off
  float* warped;          // [batch, m] contiguous
  int64_t* sorted_ids;    // [batch, m] contiguous
  float* draw;            // [batch, m] contiguous
  uint32_t* workspace;    // sample_survivors_workspace_size(batch, vocab, m) uint32; its tickets zero on entry, and
                          // left zero
};
constexpr int kSampleSurvivorsMax = 1024, kSampleSurvivorsPartElems = 4096, kSampleSurvivorsMaxParts = 64;
constexpr int64_t kSampleSurvivorsMaxVocab = int64_t{kSampleSurvivorsPartElems} * kSampleSurvivorsMaxParts;
inline int sample_survivors_parts(int64_t vocab) {
  const int64_t parts = (vocab + kSampleSurvivorsPartElems - 1) / kSampleSurvivorsPartElems;
  return static_cast<int>(parts < 1 ? 1 : parts > kSampleSurvivorsMaxParts ? kSampleSurvivorsMaxParts : parts);
}
inline int64_t sample_survivors_workspace_size(int64_t batch, int64_t vocab, int64_t m) {
  return batch + 2 * batch * sample_survivors_parts(vocab) * m;  // a ticket a row, then the parts' keys and ids
}
cudaError_t launch_sample_survivors(const SampleSurvivorsParams& p, cudaStream_t stream);

// transformers' RepetitionPenaltyLogitsProcessor on a decode step's logits (repetition_penalty.cu), with the row's
// tokens so far kept in `seen` (set where the decode loop starts, then one token a step) instead of gathered again
// every step:
//   seen[b, tokens[b, slot]] = 1          (ids at or past vocab are skipped: an embedding table larger than the
//                                          lm_head)
//   out[b, v] = s = float(logits[b, v]),   or where seen[b, v]:  s < 0 ? s * penalty : s / penalty
// HF's torch.where(score < 0, score * penalty, score / penalty) on float32 scores, its division as torch divides a
// tensor by a Python scalar on the device: exactly, or (`reciprocal`) as the product with inv_penalty.
struct RepetitionPenaltyParams {
  DType dtype;  // of logits
  int64_t batch, vocab;
  const void* logits;  // [batch, vocab], row stride logits_stride
  int64_t logits_stride;
  uint8_t* seen;          // [batch, vocab] contiguous (torch.bool)
  const int64_t* tokens;  // [batch, columns], row stride tokens_stride
  int64_t tokens_stride, columns;
  const int64_t* slot;  // [1] device: the current token's column
  float penalty;        // float(penalty)
  float inv_penalty;    // float(1.0 / penalty), as inv_temperature
  bool reciprocal;      // s / penalty as s * inv_penalty
  float* out;           // [batch, vocab] contiguous float32
};
cudaError_t launch_repetition_penalty(const RepetitionPenaltyParams& p, cudaStream_t stream);

}  // namespace patcher
