// The CUDA implementations of the decode loop's sampling ops (schemas and references: patcher/ops/sampling.py;
// kernels: sampling/), a part of bindings.cpp, which includes it once and registers them.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <string>

#include "glue.h"
#include "sampling/params.h"

namespace {

using namespace patcher_glue;

// A device tensor of the decode loop's state that check_index (int64 [n]) does not cover: the finished flags and the
// 0-d pad id. On scores' device, of `type`, contiguous, `n` elements.
void check_state(const Tensor& t, at::ScalarType type, int64_t n, const Tensor& like, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.device() == like.device(), "patcher: ", name, " must be on ", like.device());
  TORCH_CHECK(t.scalar_type() == type && t.is_contiguous() && t.numel() == n, "patcher: ", name,
              " must be a contiguous ", c10::toString(type), " tensor of ", std::to_string(n), " element(s), got ",
              t.scalar_type(), " ", dims(t.sizes()));
}

// The tokens tensor the decode loop writes into: int64 [B, columns] on `like`'s device with contiguous rows.
void check_tokens(const Tensor& tokens, int64_t B, const Tensor& like) {
  TORCH_CHECK(tokens.is_cuda() && tokens.device() == like.device() && tokens.scalar_type() == at::kLong &&
                  tokens.dim() == 2 && tokens.size(0) == B && tokens.stride(1) == 1,
              "patcher: tokens must be an int64 [", std::to_string(B), ", columns] tensor on ", like.device(),
              " with contiguous rows, got ", tokens.scalar_type(), " ", dims(tokens.sizes()));
}

// A zeroed int32 workspace of at least `needed` elements on `like`'s device, as `maker` in patcher.ops returns it.
void check_workspace(const Tensor& workspace, int64_t needed, const Tensor& like, const char* maker) {
  TORCH_CHECK(workspace.is_cuda() && workspace.device() == like.device() && workspace.scalar_type() == at::kInt &&
                  workspace.is_contiguous() && workspace.numel() >= needed,
              "patcher: workspace must be a zeroed contiguous int32 tensor on ", like.device(), " of at least ",
              std::to_string(needed), " elements (patcher.ops.", maker, ")");
}

void next_token(const Tensor& scores, Tensor& tokens, Tensor& slot, Tensor& finished, const Tensor& eos,
                const Tensor& pad_token, const OptTensor& embed_weight, Tensor& x, Tensor& workspace,
                const OptTensor& ids) {
  TORCH_CHECK(scores.is_cuda(), "patcher: scores must be a CUDA tensor, got ", scores.device());
  const c10::cuda::CUDAGuard guard(scores.device());
  TORCH_CHECK(scores.dim() == 2 && scores.size(0) > 0 && scores.size(1) > 0,
              "patcher: scores must be [batch, vocab], got ", dims(scores.sizes()));
  const int64_t B = scores.size(0), V = scores.size(1);
  TORCH_CHECK(B <= patcher::kNextTokenMaxBatch, "patcher: next_token takes at most ",
              std::to_string(patcher::kNextTokenMaxBatch), " rows, got ", std::to_string(B));
  TORCH_CHECK(V < (int64_t{1} << 30), "patcher: next_token takes a vocabulary below 2^30, got ", std::to_string(V));
  check_tokens(tokens, B, scores);
  check_index(slot, 1, scores, "slot");
  check_state(finished, at::kBool, B, scores, "finished");
  TORCH_CHECK(eos.dim() == 1 && eos.numel() <= 64, "patcher: eos must be a 1-D tensor of at most 64 ids");
  check_index(eos, eos.numel(), scores, "eos");
  check_state(pad_token, at::kLong, 1, scores, "pad_token");
  const int64_t needed = patcher::next_token_workspace_size(B);
  check_workspace(workspace, needed, scores, "next_token_workspace");
  patcher::NextTokenParams p{};
  p.dtype = dtype_of(scores);
  p.batch = B;
  p.vocab = V;
  p.scores = scores.data_ptr();
  p.scores_stride = row_stride(scores, "scores");
  p.tokens = tokens.data_ptr<int64_t>();
  p.tokens_stride = tokens.stride(0);
  p.columns = tokens.size(1);
  p.slot = slot.data_ptr<int64_t>();
  p.finished = reinterpret_cast<uint8_t*>(finished.data_ptr<bool>());
  p.eos = eos.data_ptr<int64_t>();
  p.num_eos = static_cast<int32_t>(eos.numel());
  p.pad_token = pad_token.data_ptr<int64_t>();
  if (embed_weight.has_value()) {
    const Tensor& e = *embed_weight;
    TORCH_CHECK(e.dim() == 2 && e.is_contiguous() && (ids.has_value() || e.size(0) >= V),
                "patcher: embed_weight must be a contiguous [rows, ",
                "hidden] tensor with at least as many rows as scores has columns (", std::to_string(V), "), got ",
                dims(e.sizes()));
    (void)dtype_of(e);  // float16, bfloat16 or float32
    check_like(x, e, "x");
    TORCH_CHECK(x.dim() == 2 && x.size(0) == B && x.size(1) == e.size(1) && x.is_contiguous(), "patcher: x must be ",
                "a contiguous [", std::to_string(B), ", ", std::to_string(e.size(1)), "] tensor, got ",
                dims(x.sizes()));
    TORCH_CHECK(e.device() == scores.device(), "patcher: embed_weight is on ", e.device(), " but scores are on ",
                scores.device());
    p.embed = e.data_ptr();
    p.embed_rows = e.size(0);
    p.hidden = e.size(1);
    p.embed_elem_bytes = e.element_size();
    p.x = x.data_ptr();
  }
  p.workspace = workspace.data_ptr<int32_t>();
  if (ids.has_value()) {
    TORCH_CHECK(ids->is_cuda() && ids->device() == scores.device() && ids->scalar_type() == at::kLong &&
                    ids->sizes() == scores.sizes() && ids->stride(1) == 1,
                "patcher: ids must be an int64 tensor of scores' shape ", dims(scores.sizes()), " on ", scores.device(),
                " with contiguous rows, got ", ids->scalar_type(), " ", dims(ids->sizes()));
    p.ids = ids->data_ptr<int64_t>();
    p.ids_stride = ids->stride(0);
  }
  check_launch(patcher::launch_next_token(p, c10::cuda::getCurrentCUDAStream()), "next_token");
}

// A float32 or int64 [B, m] tensor on `like`'s device with contiguous rows (`contiguous`: wholly contiguous).
void check_rows(const Tensor& t, at::ScalarType type, const Tensor& like, bool contiguous, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.device() == like.device() && t.scalar_type() == type && t.sizes() == like.sizes() &&
                  t.stride(1) == 1 && (!contiguous || t.is_contiguous()),
              "patcher: ", name, " must be a", contiguous ? " contiguous " : " ", c10::toString(type), " ",
              dims(like.sizes()), " tensor on ", like.device(), contiguous ? "" : " with contiguous rows", ", got ",
              t.scalar_type(), " ", dims(t.sizes()));
}

void sample_survivors(const Tensor& scores, const Tensor& noise, double temperature, int64_t top_k, double top_p,
                      double min_p, Tensor& warped, Tensor& sorted_ids, Tensor& draw, Tensor& workspace) {
  TORCH_CHECK(scores.is_cuda(), "patcher: scores must be a CUDA tensor, got ", scores.device());
  const c10::cuda::CUDAGuard guard(scores.device());
  TORCH_CHECK(scores.dim() == 2 && scores.size(0) > 0 && scores.size(1) > 0 &&
                  scores.size(1) <= patcher::kSampleSurvivorsMaxVocab && scores.stride(1) == 1,
              "patcher: scores must be [batch, vocab] with contiguous rows and vocab <= ",
              std::to_string(patcher::kSampleSurvivorsMaxVocab), ", got ", dims(scores.sizes()));
  const int64_t B = scores.size(0), V = scores.size(1);
  TORCH_CHECK(warped.dim() == 2 && warped.size(0) == B && warped.size(1) >= 1 &&
                  warped.size(1) <= std::min<int64_t>(V, patcher::kSampleSurvivorsMax),
              "patcher: warped must be [", std::to_string(B), ", m] with 1 <= m <= min(vocab, ",
              std::to_string(patcher::kSampleSurvivorsMax), "), got ", dims(warped.sizes()));
  TORCH_CHECK(temperature > 0, "patcher: temperature must be positive, got ", std::to_string(temperature));
  check_rows(warped, at::kFloat, warped, true, "warped");
  check_rows(sorted_ids, at::kLong, warped, true, "sorted_ids");
  check_rows(draw, at::kFloat, warped, true, "draw");
  check_rows(noise, at::kFloat, warped, false, "noise");
  const int64_t m = warped.size(1), needed = patcher::sample_survivors_workspace_size(B, V, m);
  check_workspace(workspace, needed, scores, "sample_survivors_workspace");
  patcher::SampleSurvivorsParams p{};
  p.dtype = dtype_of(scores);
  p.batch = B;
  p.vocab = V;
  p.m = m;
  p.scores = scores.data_ptr();
  p.scores_stride = scores.stride(0);
  p.noise = noise.data_ptr<float>();
  p.noise_stride = noise.stride(0);
  p.scale = temperature != 1.0;
  p.inv_temperature = static_cast<float>(1.0 / temperature);  // torch's CUDA reciprocal of a Python scalar
  p.top_k = static_cast<int32_t>(std::min<int64_t>(std::max<int64_t>(top_k, 0), INT32_MAX));
  p.top_p_on = top_p < 1.0;
  p.top_p_limit = static_cast<float>(1.0 - top_p);
  p.min_p = static_cast<float>(min_p);
  p.warped = warped.data_ptr<float>();
  p.sorted_ids = sorted_ids.data_ptr<int64_t>();
  p.draw = draw.data_ptr<float>();
  p.workspace = reinterpret_cast<uint32_t*>(workspace.data_ptr<int32_t>());
  check_launch(patcher::launch_sample_survivors(p, c10::cuda::getCurrentCUDAStream()), "sample_survivors");
}

void repetition_penalty(const Tensor& logits, Tensor& seen, const Tensor& tokens, const Tensor& slot, double penalty,
                        bool reciprocal, Tensor& out) {
  TORCH_CHECK(logits.is_cuda(), "patcher: logits must be a CUDA tensor, got ", logits.device());
  const c10::cuda::CUDAGuard guard(logits.device());
  TORCH_CHECK(logits.dim() == 2 && logits.size(0) > 0 && logits.size(1) > 0 && logits.stride(1) == 1,
              "patcher: logits must be [batch, vocab] with contiguous rows, got ", dims(logits.sizes()));
  const int64_t B = logits.size(0), V = logits.size(1);
  TORCH_CHECK(B <= 65535, "patcher: repetition_penalty takes at most 65535 rows, got ", std::to_string(B));
  TORCH_CHECK(penalty > 0, "patcher: repetition_penalty must be positive, got ", std::to_string(penalty));
  check_state(seen, at::kBool, B * V, logits, "seen");
  TORCH_CHECK(seen.dim() == 2 && seen.size(0) == B, "patcher: seen must be [", std::to_string(B), ", ",
              std::to_string(V), "], got ", dims(seen.sizes()));
  TORCH_CHECK(out.is_cuda() && out.device() == logits.device() && out.scalar_type() == at::kFloat &&
                  out.sizes() == logits.sizes() && out.is_contiguous(),
              "patcher: out must be a contiguous float32 ", dims(logits.sizes()), " tensor on ", logits.device(),
              ", got ", out.scalar_type(), " ", dims(out.sizes()));
  check_tokens(tokens, B, logits);
  check_index(slot, 1, logits, "slot");
  patcher::RepetitionPenaltyParams p{};
  p.dtype = dtype_of(logits);
  p.batch = B;
  p.vocab = V;
  p.logits = logits.data_ptr();
  p.logits_stride = logits.stride(0);
  p.seen = reinterpret_cast<uint8_t*>(seen.data_ptr<bool>());
  p.tokens = tokens.data_ptr<int64_t>();
  p.tokens_stride = tokens.stride(0);
  p.columns = tokens.size(1);
  p.slot = slot.data_ptr<int64_t>();
  p.penalty = static_cast<float>(penalty);
  p.inv_penalty = static_cast<float>(1.0 / penalty);  // as torch's, rounded once from double
  p.reciprocal = reciprocal;
  p.out = out.data_ptr<float>();
  check_launch(patcher::launch_repetition_penalty(p, c10::cuda::getCurrentCUDAStream()), "repetition_penalty");
}

}  // namespace
