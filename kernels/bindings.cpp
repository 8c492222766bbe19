// The CUDA implementations of the patcher:: torch ops, one m.impl per op at the end (schemas: patcher/ops/, one
// module per op family; the int4 ops' functions are in bindings_int4.h, the GGUF ops' in bindings_gguf.h, the norms'
// in bindings_norm.h).
//
// Each op checks its inputs (device, dtype, shape, strides) with a clear message, allocates contiguous outputs,
// fills a launcher struct and launches on the current stream. Inputs are never copied: a tensor whose layout a
// kernel can't read is rejected. Nothing here syncs with the host, so every op can be captured in a CUDA graph.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>

#include "activation/params.h"
#include "attention/params.h"
#include "bindings_gguf.h"
#include "bindings_int4.h"
#include "bindings_norm.h"
#include "bindings_sampling.h"
#include "gemv/params.h"
#include "glue.h"
#include "norm/params.h"
#include "parallel/params.h"
#include "rope/params.h"

namespace {

using namespace patcher_glue;

// ---- attention prologue -----------------------------------------------------------------------------------

std::tuple<Tensor, Tensor, Tensor> rope_qkv(const Tensor& qkv, const Tensor& cos, const Tensor& sin,
                                            int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim,
                                            bool interleaved) {
  TORCH_CHECK(qkv.is_cuda(), "patcher: qkv must be a CUDA tensor, got ", qkv.device());
  const c10::cuda::CUDAGuard guard(qkv.device());
  TORCH_CHECK(qkv.dim() == 3, "patcher: qkv must be [batch, tokens, width], got ", dims(qkv.sizes()));
  TORCH_CHECK(num_q_heads > 0 && num_kv_heads > 0 && head_dim > 0 && num_q_heads % num_kv_heads == 0,
              "patcher: bad head counts q ", std::to_string(num_q_heads), ", kv ", std::to_string(num_kv_heads),
              ", head_dim ", std::to_string(head_dim));
  TORCH_CHECK(!interleaved || num_q_heads == num_kv_heads,
              "patcher: interleaved qkv needs as many kv heads as q heads");
  const int64_t B = qkv.size(0), T = qkv.size(1);
  TORCH_CHECK(qkv.size(2) == (num_q_heads + 2 * num_kv_heads) * head_dim, "patcher: qkv width ",
              std::to_string(qkv.size(2)), " != (", std::to_string(num_q_heads), " + 2 x ",
              std::to_string(num_kv_heads), ") x ", std::to_string(head_dim));
  TORCH_CHECK(qkv.size(2) <= 1 || qkv.stride(2) == 1, "patcher: the last dimension of qkv must be contiguous");
  for (const Tensor* t : {&cos, &sin}) {
    const char* name = t == &cos ? "cos" : "sin";
    check_like(*t, qkv, name);
    TORCH_CHECK(t->dim() == 3 && (t->size(0) == B || t->size(0) == 1) && t->size(1) == T, "patcher: ", name,
                " must be [", std::to_string(B), " or 1, ", std::to_string(T), ", rotary_dim], got ", dims(t->sizes()));
    TORCH_CHECK(t->size(2) <= 1 || t->stride(2) == 1, "patcher: the last dimension of ", name, " must be contiguous");
  }
  TORCH_CHECK(cos.sizes() == sin.sizes(), "patcher: cos ", dims(cos.sizes()), " and sin ", dims(sin.sizes()),
              " differ");
  const int64_t rotary = cos.size(2);
  TORCH_CHECK(rotary % 2 == 0 && rotary <= head_dim, "patcher: rotary_dim ", std::to_string(rotary),
              " must be even and <= ", std::to_string(head_dim));

  patcher::RopeQkvParams p{};
  p.dtype = dtype_of(qkv);
  p.batch = B;
  p.tokens = T;
  p.qkv = qkv.data_ptr();
  p.qkv_stride_b = qkv.stride(0);
  p.qkv_stride_t = qkv.stride(1);
  p.cos = cos.data_ptr();
  p.cos_stride_b = cos.size(0) == 1 ? 0 : cos.stride(0);
  p.cos_stride_t = cos.stride(1);
  p.sin = sin.data_ptr();
  p.sin_stride_b = sin.size(0) == 1 ? 0 : sin.stride(0);
  p.sin_stride_t = sin.stride(1);
  p.rotary_dim = rotary;
  p.num_q_heads = num_q_heads;
  p.num_kv_heads = num_kv_heads;
  p.head_dim = head_dim;
  p.interleaved = interleaved;
  Tensor q = at::empty({B, num_q_heads, T, head_dim}, qkv.options());
  Tensor k = at::empty({B, num_kv_heads, T, head_dim}, qkv.options());
  Tensor v = at::empty({B, num_kv_heads, T, head_dim}, qkv.options());
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  check_launch(patcher::launch_rope_qkv(p, c10::cuda::getCurrentCUDAStream()), "rope_qkv");
  return {q, k, v};
}

// ---- activations ------------------------------------------------------------------------------------------

Tensor silu_and_mul(const Tensor& x) {
  TORCH_CHECK(x.is_cuda(), "patcher: x must be a CUDA tensor, got ", x.device());
  const c10::cuda::CUDAGuard guard(x.device());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) % 2 == 0, "patcher: silu_and_mul needs an even last dimension, got ",
              dims(x.sizes()));
  patcher::ActivationParams p{};
  p.dtype = dtype_of(x);
  p.cols = x.size(-1) / 2;
  p.rows = p.cols == 0 ? 0 : x.numel() / x.size(-1);
  p.x = x.data_ptr();
  p.x_stride = row_stride(x, "x");
  auto sizes = x.sizes().vec();
  sizes.back() = p.cols;
  Tensor out = at::empty(sizes, x.options());
  p.out = out.data_ptr();
  check_launch(patcher::launch_silu_and_mul(p, c10::cuda::getCurrentCUDAStream()), "silu_and_mul");
  return out;
}

Tensor bias_gelu(const Tensor& x, const OptTensor& bias, bool tanh) {
  TORCH_CHECK(x.is_cuda(), "patcher: x must be a CUDA tensor, got ", x.device());
  const c10::cuda::CUDAGuard guard(x.device());
  TORCH_CHECK(x.dim() >= 1, "patcher: bias_gelu needs at least one dimension");
  patcher::ActivationParams p{};
  p.dtype = dtype_of(x);
  p.cols = x.size(-1);
  p.rows = p.cols == 0 ? 0 : x.numel() / p.cols;
  p.x = x.data_ptr();
  p.x_stride = row_stride(x, "x");
  p.bias = optional_vector_arg(bias, x, p.cols, "bias");
  Tensor out = at::empty(x.sizes(), x.options());
  p.out = out.data_ptr();
  check_launch(patcher::launch_bias_gelu(p, tanh, c10::cuda::getCurrentCUDAStream()), "bias_gelu");
  return out;
}

// ---- decode path ------------------------------------------------------------------------------------------

int32_t gemv_activation(c10::string_view activation) {
  if (activation == "none") return patcher::kActNone;
  if (activation == "gelu") return patcher::kActGelu;
  if (activation == "gelu_tanh") return patcher::kActGeluTanh;
  if (activation == "silu_mul") return patcher::kActSiluMul;
  TORCH_CHECK(false, "patcher: gemv activation must be none, gelu, gelu_tanh or silu_mul, got ", activation);
}

// The checks and fields every decode GEMV shares: x [..., k] (1 to 8 rows), weight [rows, k], bias [rows].
patcher::GemvParams gemv_params(const char* op, const Tensor& x, const Tensor& weight, const OptTensor& bias,
                                int32_t act) {
  check_like(weight, x, "weight");
  TORCH_CHECK(weight.dim() == 2, "patcher: weight must be [out_features, in_features], got ", dims(weight.sizes()));
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == weight.size(1) && weight.size(1) > 0, "patcher: x ", dims(x.sizes()),
              " does not match weight ", dims(weight.sizes()));
  const int64_t rows_w = weight.size(0);
  TORCH_CHECK(act != patcher::kActSiluMul || rows_w % 2 == 0, "patcher: silu_mul needs an even weight height");
  patcher::GemvParams p{};
  p.act = act;
  p.dtype = dtype_of(x);
  p.k = x.size(-1);
  p.batch = x.numel() / p.k;
  TORCH_CHECK(p.batch <= 8, "patcher: ", op, " takes at most 8 rows of x (decode); got ", std::to_string(p.batch),
              ", use F.linear");
  p.n = act == patcher::kActSiluMul ? rows_w / 2 : rows_w;
  p.x = x.data_ptr();
  p.x_stride = row_stride(x, "x");
  p.w = weight.data_ptr();
  p.w_stride = row_stride(weight, "weight");
  p.bias = optional_vector_arg(bias, x, rows_w, "bias");
  return p;
}

void launch_gemv_checked(const patcher::GemvParams& p, const char* op) {
  const size_t smem = patcher::gemv_prologue_smem(p, false);
  TORCH_CHECK(smem <= patcher::gemv_max_smem(), "patcher: ", op,
              ": the norm prologue stages batch x in_features = ", std::to_string(p.batch * p.k),
              " elements in shared memory, more than this GPU has (", std::to_string(patcher::gemv_max_smem()),
              " bytes); use the separate norm op");
  check_launch(patcher::launch_gemv(p, c10::cuda::getCurrentCUDAStream()), op);
}

Tensor gemv(const Tensor& x, const Tensor& weight, const OptTensor& bias, c10::string_view activation) {
  TORCH_CHECK(x.is_cuda(), "patcher: x must be a CUDA tensor, got ", x.device());
  const c10::cuda::CUDAGuard guard(x.device());
  patcher::GemvParams p = gemv_params("gemv", x, weight, bias, gemv_activation(activation));
  auto sizes = x.sizes().vec();
  sizes.back() = p.n;
  Tensor out = at::empty(sizes, x.options());
  p.out = out.data_ptr();
  launch_gemv_checked(p, "gemv");
  return out;
}

// gemv behind the optional norm prologue (x is then the residual stream): returns (out, sum, h2).
std::tuple<Tensor, Tensor, Tensor> norm_gemv(const Tensor& x, const OptTensor& delta, const OptTensor& delta2,
                                             const OptTensor& norm_weight, const OptTensor& norm_bias,
                                             const OptTensor& norm_weight2, const OptTensor& norm_bias2, double eps,
                                             bool rms, const Tensor& weight, const OptTensor& bias,
                                             c10::string_view activation) {
  TORCH_CHECK(x.is_cuda(), "patcher: x must be a CUDA tensor, got ", x.device());
  const c10::cuda::CUDAGuard guard(x.device());
  patcher::GemvParams p = gemv_params("norm_gemv", x, weight, bias, gemv_activation(activation));
  const Prologue pro =
      fill_prologue(p.norm, x, p.k, delta, delta2, norm_weight, norm_bias, norm_weight2, norm_bias2, eps, rms);
  auto sizes = x.sizes().vec();
  sizes.back() = p.n;
  Tensor out = at::empty(sizes, x.options());
  p.out = out.data_ptr();
  launch_gemv_checked(p, "norm_gemv");
  return {out, pro.sum, pro.h2};
}

Tensor rope_qkv_cache(const Tensor& qkv, const Tensor& cos, const Tensor& sin, const Tensor& slot, const Tensor& pad,
                      Tensor& k_cache, Tensor& v_cache, int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim,
                      bool interleaved) {
  TORCH_CHECK(qkv.is_cuda(), "patcher: qkv must be a CUDA tensor, got ", qkv.device());
  const c10::cuda::CUDAGuard guard(qkv.device());
  TORCH_CHECK(qkv.dim() == 2, "patcher: qkv must be [batch, width] (one token per row), got ", dims(qkv.sizes()));
  TORCH_CHECK(qkv.size(1) <= 1 || qkv.stride(1) == 1, "patcher: the last dimension of qkv must be contiguous");
  patcher::RopeCacheParams p{};
  Tensor q = rope_cache_target(p, qkv, qkv.size(0), qkv.size(1), cos, sin, slot, pad, k_cache, v_cache, num_q_heads,
                               num_kv_heads, head_dim, interleaved);
  p.qkv = qkv.data_ptr();
  p.qkv_stride = qkv.stride(0);
  check_launch(patcher::launch_rope_qkv_cache(p, c10::cuda::getCurrentCUDAStream()), "rope_qkv_cache");
  return q;
}

// The dense decode-step attention prologue in one kernel: [add +] norm, x @ W_qkv^T (+ bias), RoPE, K/V into the
// cache. Returns (q, sum, h2).
std::tuple<Tensor, Tensor, Tensor> norm_gemv_rope_cache(const Tensor& x, const OptTensor& delta,
                                                        const OptTensor& delta2, const OptTensor& norm_weight,
                                                        const OptTensor& norm_bias, const OptTensor& norm_weight2,
                                                        const OptTensor& norm_bias2, double eps, bool rms,
                                                        const Tensor& weight, const OptTensor& bias, const Tensor& cos,
                                                        const Tensor& sin, const Tensor& slot, const Tensor& pad,
                                                        Tensor& k_cache, Tensor& v_cache, int64_t num_q_heads,
                                                        int64_t num_kv_heads, int64_t head_dim, bool interleaved) {
  TORCH_CHECK(x.is_cuda(), "patcher: x must be a CUDA tensor, got ", x.device());
  const c10::cuda::CUDAGuard guard(x.device());
  patcher::GemvParams p = gemv_params("norm_gemv_rope_cache", x, weight, bias, patcher::kActRopeCache);
  TORCH_CHECK(x.dim() == 2, "patcher: x must be [batch, hidden] (one token per row), got ", dims(x.sizes()));
  TORCH_CHECK(head_dim > 0 && head_dim % 2 == 0, "patcher: norm_gemv_rope_cache needs an even head_dim");
  const Prologue pro =
      fill_prologue(p.norm, x, p.k, delta, delta2, norm_weight, norm_bias, norm_weight2, norm_bias2, eps, rms);
  Tensor q = rope_cache_target(p.rope, x, p.batch, p.n, cos, sin, slot, pad, k_cache, v_cache, num_q_heads,
                               num_kv_heads, head_dim, interleaved);
  p.out = q.data_ptr();
  launch_gemv_checked(p, "norm_gemv_rope_cache");
  return {q, pro.sum, pro.h2};
}

Tensor decode_attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& slot,
                        const Tensor& pad, double scale, int64_t splits, Tensor& workspace) {
  TORCH_CHECK(q.is_cuda(), "patcher: q must be a CUDA tensor, got ", q.device());
  const c10::cuda::CUDAGuard guard(q.device());
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "patcher: q must be contiguous [batch, heads, head_dim], got ",
              dims(q.sizes()));
  patcher::DecodeAttentionParams p{};
  Tensor out = attention_params(p, q, q.size(0), q.size(1), q.size(2), k_cache, v_cache, slot, pad, scale, splits,
                                workspace, "decode_attention");
  p.q = q.data_ptr();
  check_launch(patcher::launch_decode_attention(p, c10::cuda::getCurrentCUDAStream()), "decode_attention");
  return out;
}

// decode_attention with q and the current token's K/V taken from the QKV projection's accumulator (int4_norm_gemv_acc:
// acc [B, (Hq + 2 Hkv) * D] int64), rounded, + bias_rows ([B, that width] in the caches' dtype, or None), RoPE'd;
// K/V are written into the caches at slot, as rope_qkv_cache writes them.
Tensor decode_attention_qkv_acc(const Tensor& acc, const OptTensor& bias_rows, const Tensor& cos, const Tensor& sin,
                                const Tensor& slot, const Tensor& pad, Tensor& k_cache, Tensor& v_cache,
                                int64_t num_q_heads, bool interleaved, double scale, int64_t splits,
                                Tensor& workspace) {
  TORCH_CHECK(k_cache.is_cuda(), "patcher: k_cache must be a CUDA tensor, got ", k_cache.device());
  const c10::cuda::CUDAGuard guard(k_cache.device());
  TORCH_CHECK(k_cache.dim() == 4, "patcher: k_cache must be [batch, kv_heads, capacity, head_dim]");
  const int64_t B = k_cache.size(0), Hkv = k_cache.size(1), D = k_cache.size(3);
  const int64_t width = (num_q_heads + 2 * Hkv) * D;
  TORCH_CHECK(acc.is_cuda() && acc.device() == k_cache.device() && acc.scalar_type() == at::kLong &&
                  acc.is_contiguous() && acc.dim() == 2 && acc.size(0) == B && acc.size(1) == width,
              "patcher: acc must be a contiguous int64 [", std::to_string(B), ", ", std::to_string(width),
              "] tensor on ", k_cache.device(), ", got ", acc.scalar_type(), " ", dims(acc.sizes()));
  patcher::DecodeAttentionParams p{};
  Tensor out = attention_params(p, k_cache, B, num_q_heads, D, k_cache, v_cache, slot, pad, scale, splits, workspace,
                                "decode_attention_qkv_acc");
  // The tables, heads and layout as rope_qkv_cache takes them (no q: the kernel makes it from acc).
  fill_rope_cache(p.rope, k_cache, B, width, cos, sin, slot, pad, k_cache, v_cache, num_q_heads, Hkv, D, interleaved);
  p.qkv_acc = acc.data_ptr<int64_t>();
  if (bias_rows.has_value()) {
    TORCH_CHECK(bias_rows->scalar_type() == k_cache.scalar_type() && bias_rows->device() == k_cache.device() &&
                    bias_rows->is_contiguous() && bias_rows->sizes() == acc.sizes(),
                "patcher: bias_rows must be a contiguous [", std::to_string(B), ", ", std::to_string(width),
                "] tensor of the caches' dtype on their device");
    p.qkv_bias = bias_rows->data_ptr();
  }
  check_launch(patcher::launch_decode_attention(p, c10::cuda::getCurrentCUDAStream()), "decode_attention_qkv_acc");
  return out;
}

// qkv is the QKV projection's output for the caches: contiguous [B, width] in their dtype, on their device.
void check_qkv_output(const Tensor& qkv, const Tensor& k_cache, int64_t B, int64_t width) {
  TORCH_CHECK(qkv.is_cuda() && qkv.device() == k_cache.device() && qkv.scalar_type() == k_cache.scalar_type() &&
                  qkv.is_contiguous() && qkv.dim() == 2 && qkv.size(0) == B && qkv.size(1) == width,
              "patcher: qkv must be a contiguous [", std::to_string(B), ", ", std::to_string(width), "] tensor of ",
              "the caches' dtype on ", k_cache.device(), ", got ", qkv.scalar_type(), " ", dims(qkv.sizes()));
}

// decode_attention with q and the current token's K/V taken from the QKV projection's output qkv [B, (Hq + 2 Hkv) * D]
// in the caches' dtype, RoPE'd, K/V written into the caches at slot: rope_qkv_cache, then decode_attention, in one
// kernel. The op before it triggers after its wait (gguf_norm_gemv_cat's feeds_attention).
Tensor decode_attention_qkv(const Tensor& qkv, const Tensor& cos, const Tensor& sin, const Tensor& slot,
                            const Tensor& pad, Tensor& k_cache, Tensor& v_cache, int64_t num_q_heads,
                            bool interleaved, double scale, int64_t splits, Tensor& workspace) {
  TORCH_CHECK(k_cache.is_cuda(), "patcher: k_cache must be a CUDA tensor, got ", k_cache.device());
  const c10::cuda::CUDAGuard guard(k_cache.device());
  TORCH_CHECK(k_cache.dim() == 4, "patcher: k_cache must be [batch, kv_heads, capacity, head_dim]");
  const int64_t B = k_cache.size(0), Hkv = k_cache.size(1), D = k_cache.size(3);
  const int64_t width = (num_q_heads + 2 * Hkv) * D;
  check_qkv_output(qkv, k_cache, B, width);
  patcher::DecodeAttentionParams p{};
  Tensor out = attention_params(p, k_cache, B, num_q_heads, D, k_cache, v_cache, slot, pad, scale, splits, workspace,
                                "decode_attention_qkv");
  fill_rope_cache(p.rope, k_cache, B, width, cos, sin, slot, pad, k_cache, v_cache, num_q_heads, Hkv, D, interleaved);
  p.qkv = qkv.data_ptr();
  check_launch(patcher::launch_decode_attention(p, c10::cuda::getCurrentCUDAStream()), "decode_attention_qkv");
  return out;
}

// gguf_gemv_cat(decode_attention_qkv(...)): the attention writes the output projection's input as its GEMV reads it
// (Q8_1 blocks, or fp32 for W4A16), in place of the GEMV's input kernel; head_dim a multiple of 32 (a Q8_1 block
// within a head). Returns the projection's output [B, sum of the modules' out_features].
Tensor gguf_attention_gemv_cat(const Tensor& qkv, const Tensor& cos, const Tensor& sin, const Tensor& slot,
                               const Tensor& pad, Tensor& k_cache, Tensor& v_cache, int64_t num_q_heads,
                               bool interleaved, double scale, int64_t splits, Tensor& workspace, TensorList blocks,
                               c10::string_view kinds, OptTensorList biases, bool quantize_activations) {
  TORCH_CHECK(k_cache.is_cuda(), "patcher: k_cache must be a CUDA tensor, got ", k_cache.device());
  const c10::cuda::CUDAGuard guard(k_cache.device());
  TORCH_CHECK(k_cache.dim() == 4, "patcher: k_cache must be [batch, kv_heads, capacity, head_dim]");
  const int64_t B = k_cache.size(0), Hkv = k_cache.size(1), D = k_cache.size(3);
  TORCH_CHECK(D % 32 == 0, "patcher: gguf_attention_gemv_cat needs a head_dim that is a multiple of 32, got ",
              std::to_string(D));
  const int64_t width = (num_q_heads + 2 * Hkv) * D;
  check_qkv_output(qkv, k_cache, B, width);
  patcher::DecodeAttentionParams p{};
  const Tensor attended = attention_params(p, k_cache, B, num_q_heads, D, k_cache, v_cache, slot, pad, scale, splits,
                                           workspace, "gguf_attention_gemv_cat");
  // The projection's launch, checked against the attention output's shape ([B, Hq * D]; the attention writes the
  // workspace instead of that tensor).
  GgufLaunch l = gguf_launch(attended, blocks, kinds, biases, quantize_activations);
  fill_rope_cache(p.rope, k_cache, B, width, cos, sin, slot, pad, k_cache, v_cache, num_q_heads, Hkv, D, interleaved);
  p.qkv = qkv.data_ptr();
  p.gguf_work = l.p.work;
  p.gguf_a8 = quantize_activations;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  check_launch(patcher::launch_decode_attention(p, stream), "gguf_attention_gemv_cat");
  l.p.work_ready = true;
  check_launch(patcher::launch_gguf_gemv(l.p, stream), "gguf_gemv");
  return l.out;
}

// ---- tensor parallelism -----------------------------------------------------------------------------------

// `inbox`: this rank's inbox (int64 words, 2 halves x world senders x capacity), allocated in torch's symmetric memory;
// `inboxes`: the device address of the array of every rank's inbox that torch hands out for it; `epochs`: this rank's
// per-block call counts (patcher/parallel/rank_sum.py keeps both). `group` is used by the reference only.
Tensor rank_sum(const Tensor& x, const Tensor& inbox, const Tensor& epochs, int64_t inboxes, int64_t rank,
                int64_t world, const std::string& group) {
  (void)group;
  TORCH_CHECK(x.is_cuda(), "patcher: x must be a CUDA tensor, got ", x.device());
  const c10::cuda::CUDAGuard guard(x.device());
  TORCH_CHECK(x.is_contiguous(), "patcher: rank_sum needs a contiguous x");
  TORCH_CHECK(world >= 1 && world <= patcher::kRankSumMaxWorld && rank >= 0 && rank < world,
              "patcher: rank_sum takes 1 to ", std::to_string(patcher::kRankSumMaxWorld), " ranks, got rank ",
              std::to_string(rank), " of ", std::to_string(world));
  TORCH_CHECK(inbox.device() == x.device() && inbox.scalar_type() == at::kLong && inbox.is_contiguous() &&
                  inbox.numel() % (2 * world) == 0,
              "patcher: rank_sum's inbox must be a contiguous int64 tensor of 2 x world rows on x's device");
  TORCH_CHECK(epochs.device() == x.device() && epochs.scalar_type() == at::kInt && epochs.is_contiguous() &&
                  epochs.numel() == patcher::kRankSumBlocks,
              "patcher: rank_sum's epochs must be a contiguous int32 tensor of ",
              std::to_string(patcher::kRankSumBlocks), " counts on x's device");
  const int64_t capacity = inbox.numel() / (2 * world);
  const int64_t words = (x.numel() * x.element_size() + 3) / 4;
  TORCH_CHECK(words <= capacity, "patcher: rank_sum's inbox rows hold ", std::to_string(capacity), " words, x needs ",
              std::to_string(words));
  TORCH_CHECK(inboxes != 0, "patcher: rank_sum needs the address of the inboxes' array");
  patcher::RankSumParams p{};
  p.dtype = dtype_of(x);
  p.numel = x.numel();
  p.x = x.data_ptr();
  Tensor out = at::empty(x.sizes(), x.options());
  p.out = out.data_ptr();
  p.inboxes = reinterpret_cast<uint64_t* const*>(inboxes);
  p.capacity = capacity;
  p.epochs = reinterpret_cast<uint32_t*>(epochs.data_ptr<int32_t>());
  p.rank = static_cast<int>(rank);
  p.world = static_cast<int>(world);
  check_launch(patcher::launch_rank_sum(p, c10::cuda::getCurrentCUDAStream()), "rank_sum");
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(patcher, CUDA, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rms_norm_q8_1", &rms_norm_q8_1);
  m.impl("layer_norm", &layer_norm);
  m.impl("dual_layer_norm", &dual_layer_norm);
  m.impl("add_layer_norm", &add_layer_norm);
  m.impl("add_dual_layer_norm", &add_dual_layer_norm);
  m.impl("rope_qkv", &rope_qkv);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("bias_gelu", &bias_gelu);
  m.impl("gemv", &gemv);
  m.impl("rope_qkv_cache", &rope_qkv_cache);
  m.impl("norm_gemv", &norm_gemv);
  m.impl("norm_gemv_rope_cache", &norm_gemv_rope_cache);
  m.impl("decode_attention", &decode_attention);
  m.impl("decode_attention_qkv_acc", &decode_attention_qkv_acc);
  m.impl("decode_attention_qkv", &decode_attention_qkv);
  m.impl("gguf_attention_gemv_cat", &gguf_attention_gemv_cat);
  m.impl("next_token", &next_token);
  m.impl("sample_survivors", &sample_survivors);
  m.impl("repetition_penalty", &repetition_penalty);
  m.impl("int4_linear", &int4_linear);
  m.impl("int4_gemv", &int4_gemv);
  m.impl("int4_gemv_cat", &int4_gemv_cat);
  m.impl("int4_gemv_acc", &int4_gemv_acc);
  m.impl("int4_norm_gemv_acc", &int4_norm_gemv_acc);
  m.impl("int4_norm_prologue", &int4_norm_prologue);
  m.impl("int4_qkv_rope_cache", &int4_qkv_rope_cache);
  m.impl("int4_qkv_mlp_in", &int4_qkv_mlp_in);
  m.impl("gguf_gemv", &gguf_gemv);
  m.impl("gguf_gemv_cat", &gguf_gemv_cat);
  m.impl("gguf_norm_gemv_cat", &gguf_norm_gemv_cat);
  m.impl("gguf_silu_mul_gemv_cat", &gguf_silu_mul_gemv_cat);
  m.impl("gguf_dequantize", &gguf_dequantize);
  m.impl("gguf_dequantize_cat", &gguf_dequantize_cat);
  m.impl("round_q8_1", &round_q8_1);
  m.impl("rank_sum", &rank_sum);
}
