// The torch glue of the int4 decode-step kernel (step.cuh): int4_step_plan checks a model's int4 step and builds
// its plan once per set of step buffers; int4_step launches it (inside the decode step's CUDA graph).
//
// A plan holds raw pointers to every tensor it was built from (weights, norms, caches, tables, buffers): the caller
// (patcher/decode/step.py) keeps them alive as long as the plan.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "glue.h"
#include "launchers.h"

namespace {

using namespace patcher_glue;
using TensorList = c10::ArrayRef<Tensor>;
using OptTensorList = const c10::List<std::optional<Tensor>>&;

constexpr int kLinearsPerLayer = 4;  // qkv, out, mlp_in, mlp_out

// A contiguous buffer of `like`'s device and dtype with the given shape.
void check_buffer(const Tensor& t, const Tensor& like, c10::IntArrayRef shape, const char* name) {
  check_like(t, like, name);
  TORCH_CHECK(t.sizes() == shape && t.is_contiguous(), "patcher: ", name, " must be a contiguous ", dims(shape),
              " tensor, got ", dims(t.sizes()));
}

patcher::Int4Segment segment(const Tensor& qweight, const Tensor& qzeros, const Tensor& scales,
                             const std::optional<Tensor>& bias, const Tensor& like, const std::string& name) {
  TORCH_CHECK(qweight.device() == like.device() && qzeros.device() == like.device() && scales.device() == like.device(),
              "patcher: ", name, ": GPTQ tensors must be on ", like.device());
  TORCH_CHECK(qweight.scalar_type() == at::kInt && qweight.dim() == 2 && qweight.is_contiguous(), "patcher: ", name,
              ": qweight must be a contiguous int32 [in / 8, out] tensor");
  const int64_t n = qweight.size(1);
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.dim() == 2 && scales.size(1) == n && scales.is_contiguous(),
              "patcher: ", name, ": scales must be contiguous float16 [groups, ", std::to_string(n), "]");
  TORCH_CHECK(qzeros.scalar_type() == at::kInt && qzeros.dim() == 2 && qzeros.size(0) == scales.size(0) &&
                  qzeros.size(1) * 8 == n && qzeros.is_contiguous(),
              "patcher: ", name, ": qzeros must be contiguous int32 [groups, out / 8]");
  const void* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->device() == like.device() && bias->scalar_type() == at::kHalf && bias->dim() == 1 &&
                    bias->size(0) == n && bias->is_contiguous(),
                "patcher: ", name, ": bias must be contiguous float16 [", std::to_string(n), "]");
    b = bias->data_ptr();
  }
  return {qweight.data_ptr<int32_t>(), qzeros.data_ptr<int32_t>(), scales.data_ptr(), nullptr, b, n};
}

std::tuple<Tensor, Tensor, Tensor, int64_t> int4_step_plan(
    TensorList qweight, TensorList qzeros, TensorList scales, OptTensorList bias, c10::IntArrayRef segments,
    int64_t group_size, int64_t zero_offset, TensorList norm_weight, OptTensorList norm_bias, double eps, bool rms,
    bool parallel_residual, c10::string_view mlp_act, int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim,
    bool interleaved, double scale, int64_t splits, const Tensor& cos, const Tensor& sin, const Tensor& slot,
    const Tensor& pad, const Tensor& k_cache, const Tensor& v_cache, const Tensor& resid, const Tensor& delta,
    const Tensor& qkv, const Tensor& attn, const Tensor& act, const std::optional<Tensor>& timeline) {
  TORCH_CHECK(resid.is_cuda(), "patcher: int4_step_plan takes CUDA tensors, got ", resid.device());
  const c10::cuda::CUDAGuard guard(resid.device());
  TORCH_CHECK(resid.dim() == 3 && resid.size(0) == 2, "patcher: resid must be [2, batch, hidden]");
  const int64_t batch = resid.size(1), hidden = resid.size(2);
  const int64_t layers = static_cast<int64_t>(segments.size()) / kLinearsPerLayer;
  TORCH_CHECK(layers >= 1 && static_cast<int64_t>(segments.size()) == layers * kLinearsPerLayer,
              "patcher: segments must list 4 linears per layer");
  TORCH_CHECK(static_cast<int64_t>(norm_weight.size()) == 2 * layers && norm_bias.size() == norm_weight.size(),
              "patcher: norm_weight and norm_bias must list 2 norms per layer");
  TORCH_CHECK(qzeros.size() == qweight.size() && scales.size() == qweight.size() && bias.size() == qweight.size(),
              "patcher: qweight, qzeros, scales and bias must list the same segments");
  TORCH_CHECK(mlp_act == "silu_mul" || mlp_act == "gelu" || mlp_act == "gelu_tanh",
              "patcher: mlp_act must be silu_mul, gelu or gelu_tanh");
  check_buffer(delta, resid, {2, batch, hidden}, "delta");
  check_buffer(attn, resid, {batch, num_q_heads * head_dim}, "attn");
  check_buffer(qkv, resid, {batch, (num_q_heads + 2 * num_kv_heads) * head_dim}, "qkv");
  TORCH_CHECK(act.dim() == 2 && act.size(0) == batch && act.is_contiguous(), "patcher: act must be [batch, inter]");
  check_like(act, resid, "act");
  TORCH_CHECK(k_cache.dim() == 5 && k_cache.size(0) == layers, "patcher: k_cache must be [layers, batch, kv_heads, ",
              "capacity, head_dim]");
  const Tensor layer_cache = k_cache[0];
  const int64_t rotary =
      check_rope_cache_args(resid, cos, sin, slot, pad, layer_cache, v_cache[0], batch, num_kv_heads, head_dim);
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes(),
              "patcher: k_cache and v_cache must be contiguous and alike");

  patcher::StepDesc d{};
  d.dtype = dtype_of(resid);
  d.batch = batch;
  d.hidden = hidden;
  d.num_layers = layers;
  d.group_size = group_size;
  d.zero_offset = static_cast<int32_t>(zero_offset);
  d.parallel_residual = parallel_residual;
  d.rms = rms;
  d.eps = static_cast<float>(eps);
  d.mlp_act =
      mlp_act == "silu_mul" ? patcher::kActSiluMul : (mlp_act == "gelu" ? patcher::kActGelu : patcher::kActGeluTanh);
  d.num_q_heads = num_q_heads;
  d.num_kv_heads = num_kv_heads;
  d.head_dim = head_dim;
  d.rotary_dim = rotary;
  d.capacity = k_cache.size(3);
  d.table_len = cos.size(0);
  d.interleaved = interleaved;
  d.scale = static_cast<float>(scale);
  d.attention_splits = static_cast<int32_t>(splits);
  d.cos = cos.data_ptr();
  d.sin = sin.data_ptr();
  d.slot = slot.data_ptr<int64_t>();
  d.pad = pad.data_ptr<int64_t>();
  for (int i = 0; i < 2; ++i) {
    d.resid[i] = resid[i].data_ptr();
    d.delta[i] = delta[i].data_ptr();
  }
  d.qkv = qkv.data_ptr();
  d.attn = attn.data_ptr();
  d.act = act.data_ptr();

  std::vector<patcher::StepLayerDesc> descs(static_cast<size_t>(layers));
  size_t next = 0;
  const int64_t layer_cache_elems = k_cache[0].numel();
  for (int64_t i = 0; i < layers; ++i) {
    patcher::StepLayerDesc& L = descs[static_cast<size_t>(i)];
    patcher::StepLinearDesc* linears[kLinearsPerLayer] = {&L.qkv, &L.out, &L.mlp_in, &L.mlp_out};
    for (int j = 0; j < kLinearsPerLayer; ++j) {
      const int64_t count = segments[static_cast<size_t>(i * kLinearsPerLayer + j)];
      TORCH_CHECK(count >= 1 && count <= patcher::kInt4MaxSegments && next + count <= qweight.size(),
                  "patcher: bad segment count ", std::to_string(count));
      linears[j]->num_segments = static_cast<int>(count);
      for (int64_t s = 0; s < count; ++s, ++next) {
        const std::string name = "layer " + std::to_string(i) + " linear " + std::to_string(j);
        linears[j]->seg[s] = segment(qweight[next], qzeros[next], scales[next], bias.get(next), resid, name);
      }
    }
    for (int n = 0; n < 2; ++n) {
      const size_t k = static_cast<size_t>(2 * i + n);
      L.norm_weight[n] = vector_arg(norm_weight[k], resid, hidden, "norm_weight");
      L.norm_bias[n] = optional_vector_arg(norm_bias.get(k), resid, hidden, "norm_bias");
    }
    L.k_cache = static_cast<char*>(k_cache.data_ptr()) + i * layer_cache_elems * k_cache.element_size();
    L.v_cache = static_cast<char*>(v_cache.data_ptr()) + i * layer_cache_elems * v_cache.element_size();
  }
  TORCH_CHECK(next == qweight.size(), "patcher: segments do not add up to the listed GPTQ tensors");
  d.layers = descs.data();

  patcher::StepLayout layout{};
  if (patcher::plan_step(d, layout) != cudaSuccess) {
    TORCH_CHECK(false, "patcher: the int4 step kernel cannot take this model: ", layout.reason ? layout.reason : "?");
  }
  Tensor arrays = at::empty({layout.array_bytes}, resid.options().dtype(at::kByte));
  Tensor workspace = at::zeros({(layout.workspace_bytes + 3) / 4}, resid.options().dtype(at::kInt));
  std::vector<unsigned char> image(static_cast<size_t>(layout.array_bytes));
  if (patcher::fill_step(d, layout, image.data(), arrays.data_ptr(), workspace.data_ptr()) != cudaSuccess) {
    TORCH_CHECK(false, "patcher: the int4 step kernel cannot take this model: ", layout.reason ? layout.reason : "?");
  }
  check_launch(cudaMemcpy(arrays.data_ptr(), image.data(), image.size(), cudaMemcpyHostToDevice), "int4_step_plan");
  Tensor header = at::empty({static_cast<int64_t>(sizeof(patcher::StepPlan))}, at::TensorOptions().dtype(at::kByte));
  if (timeline.has_value()) {  // [blocks, stages, marks] int64, read back by patcher/decode/step.py: timeline
    const int64_t needed = static_cast<int64_t>(layout.plan.blocks) * layout.plan.num_stages * patcher::kStepMarks;
    TORCH_CHECK(timeline->is_cuda() && timeline->scalar_type() == at::kLong && timeline->is_contiguous() &&
                    timeline->numel() == needed,
                "patcher: the timeline must be a contiguous int64 CUDA tensor of ", std::to_string(needed),
                " elements (blocks x stages x marks)");
    layout.plan.timeline = reinterpret_cast<unsigned long long*>(timeline->data_ptr<int64_t>());
  }
  std::memcpy(header.data_ptr(), &layout.plan, sizeof(patcher::StepPlan));
  return {header, arrays, workspace, layout.final_resid};
}

void int4_step(const Tensor& header, const Tensor& arrays, Tensor& workspace) {
  TORCH_CHECK(header.device().is_cpu() && header.scalar_type() == at::kByte &&
                  header.numel() == static_cast<int64_t>(sizeof(patcher::StepPlan)),
              "patcher: int4_step takes the header int4_step_plan returned");
  TORCH_CHECK(arrays.is_cuda() && workspace.is_cuda(), "patcher: int4_step's arrays and workspace live on the GPU");
  const c10::cuda::CUDAGuard guard(workspace.device());
  patcher::StepPlan plan;
  std::memcpy(&plan, header.data_ptr(), sizeof(plan));
  TORCH_CHECK(plan.stages == arrays.data_ptr() && reinterpret_cast<const void*>(plan.barrier) == workspace.data_ptr(),
              "patcher: int4_step's arrays and workspace are not the ones its plan was built with");
  check_launch(patcher::launch_step(plan, c10::cuda::getCurrentCUDAStream()), "int4_step");
}

}  // namespace

TORCH_LIBRARY_IMPL(patcher, CUDA, m) {
  m.impl("int4_step_plan", &int4_step_plan);
  m.impl("int4_step", &int4_step);
}
