// The host side of the int4 decode-step kernel (step.cuh): the stages of a model's step, the work split, the tensor
// maps and the shared-memory layout. The kernel itself is built per dtype (step_half.cu, step_bf16.cu).
#include <algorithm>
#include <cstring>
#include <vector>

#include "step.cuh"

namespace patcher {

cudaError_t launch_step_half(const StepPlan& plan, cudaStream_t stream);
cudaError_t launch_step_bf16(const StepPlan& plan, cudaStream_t stream);

namespace {

constexpr int kMinSlots = 4;  // ring slots a plan needs (fewer: not enough weights in flight to hide a barrier)

int64_t align_up(int64_t n, int64_t a) { return (n + a - 1) / a * a; }

int k_units_of(int64_t k) { return static_cast<int>((k + 255) / 256); }

// One linear of the step before its maps are made: the segments, what it computes, what it reads and writes.
struct LinearPlan {
  const StepLinearDesc* desc;
  bool silu;
  int32_t act;
  void* out;
  int32_t out_width;
  int64_t k;
  int32_t strips, slots, unit_begin;
  int32_t x_offset, x_stride;
};

struct StagePlan {
  bool attention;
  int layer;
  int num_linears;
  int linear[kStepMaxLinears];
  int norm;
  StepNorm nd;
  const void* x[kStepMaxLinears];
  int32_t units;
};

int32_t strips_of(const StepLinearDesc& l, bool silu) {
  if (silu) return static_cast<int32_t>((l.seg[0].n + 63) / 64);
  int32_t strips = 0;
  for (int s = 0; s < l.num_segments; ++s) strips += static_cast<int32_t>((l.seg[s].n + 127) / 128);
  return strips;
}

int64_t width_of(const StepLinearDesc& l) {
  int64_t n = 0;
  for (int s = 0; s < l.num_segments; ++s) n += l.seg[s].n;
  return n;
}

// Why the kernel cannot read this linear, or nullptr.
const char* linear_reason(const StepLinearDesc& l, int64_t k, bool silu, int64_t group_size) {
  if (l.num_segments < 1 || l.num_segments > kInt4MaxSegments) return "a linear with no or too many segments";
  if (silu && (l.num_segments != 2 || l.seg[0].n != l.seg[1].n))
    return "gate and up must be two segments of equal width";
  for (int s = 0; s < l.num_segments; ++s) {
    const Int4Segment& seg = l.seg[s];
    if (seg.n % (silu ? 64 : 32)) return "output widths must be multiples of 32 (gate and up: 64)";
    for (const void* ptr : {static_cast<const void*>(seg.qweight), static_cast<const void*>(seg.qzeros), seg.scales}) {
      if (reinterpret_cast<uintptr_t>(ptr) & 15u) return "GPTQ tensors must be 16-byte aligned";
    }
  }
  if (k % 8) return "in_features must be a multiple of 8";
  if (group_size < k && (group_size < 64 || (group_size & (group_size - 1))))
    return "the group size must be a power of two of at least 64, or the whole of K";
  return nullptr;
}

struct Built {
  std::vector<LinearPlan> linears;
  std::vector<StagePlan> stages;
  int final_resid;
};

// The stages of the step and the buffers they pass along:
//   parallel residual   A: x + attn + mlp, both LayerNorms; QKV (x0) and the MLP's first linear (x1)
//                       B: attention
//                       C: the attention output projection (x0 = attn) and the MLP's second linear (x1 = act)
//   sequential          A: x + mlp, the input norm, QKV   B: attention   C: output projection
//                       D: + attn, the post-attention norm, the MLP's first linear   E: its second
// The attention stage streams no weights of its own: the ring fills with the next stage's meanwhile.
Built build(const StepDesc& d) {
  Built out;
  const bool silu = d.mlp_act == kActSiluMul;
  const int32_t mlp_act = silu ? kActNone : d.mlp_act;
  const int64_t qkv_width = (d.num_q_heads + 2 * d.num_kv_heads) * d.head_dim;
  const int64_t attn_width = d.num_q_heads * d.head_dim;
  int cur = 0;  // the resid buffer that holds the residual stream
  const auto linear = [&](StagePlan& st, const StepLinearDesc& l, bool is_silu, int32_t act, void* o, int64_t width,
                          int64_t k, const void* x) {
    LinearPlan lp{};
    lp.desc = &l;
    lp.silu = is_silu;
    lp.act = act;
    lp.out = o;
    lp.out_width = static_cast<int32_t>(width);
    lp.k = k;
    lp.strips = strips_of(l, is_silu);
    out.linears.push_back(lp);
    st.x[st.num_linears] = x;
    st.linear[st.num_linears++] = static_cast<int>(out.linears.size() - 1);
  };
  const auto norm = [&](int layer, int which, const void* delta, const void* delta2, bool dual) {
    const StepLayerDesc& L = d.layers[layer];
    StepNorm nd{};
    nd.resid = d.resid[cur];
    nd.delta = delta;
    nd.delta2 = delta2;
    if (delta) {
      nd.resid_out = d.resid[cur ^ 1];
      cur ^= 1;
    }
    nd.weight = L.norm_weight[which];
    nd.bias = L.norm_bias[which];
    if (dual) {
      nd.weight2 = L.norm_weight[1];
      nd.bias2 = L.norm_bias[1];
    }
    return nd;
  };
  const auto stage = [&](int layer) {
    StagePlan st{};
    st.layer = layer;
    return st;
  };
  for (int i = 0; i < d.num_layers; ++i) {
    const StepLayerDesc& L = d.layers[i];
    const bool first = i == 0;
    const int64_t inter = width_of(L.mlp_in) / (silu ? 2 : 1);
    StagePlan attention = stage(i);
    attention.attention = true;
    if (d.parallel_residual) {
      StagePlan a = stage(i);
      a.norm = 2;
      a.nd = norm(i, 0, first ? nullptr : d.delta[0], first ? nullptr : d.delta[1], true);
      linear(a, L.qkv, false, kActNone, d.qkv, qkv_width, d.hidden, nullptr);
      linear(a, L.mlp_in, silu, mlp_act, d.act, inter, d.hidden, nullptr);
      out.stages.push_back(a);
      out.stages.push_back(attention);
      StagePlan c = stage(i);
      linear(c, L.out, false, kActNone, d.delta[0], d.hidden, attn_width, d.attn);
      linear(c, L.mlp_out, false, kActNone, d.delta[1], d.hidden, inter, d.act);
      out.stages.push_back(c);
    } else {
      StagePlan a = stage(i);
      a.norm = 1;
      a.nd = norm(i, 0, first ? nullptr : d.delta[1], nullptr, false);
      linear(a, L.qkv, false, kActNone, d.qkv, qkv_width, d.hidden, nullptr);
      out.stages.push_back(a);
      out.stages.push_back(attention);
      StagePlan c = stage(i);
      linear(c, L.out, false, kActNone, d.delta[0], d.hidden, attn_width, d.attn);
      out.stages.push_back(c);
      StagePlan e = stage(i);
      e.norm = 1;
      e.nd = norm(i, 1, d.delta[0], nullptr, false);
      linear(e, L.mlp_in, silu, mlp_act, d.act, inter, d.hidden, nullptr);
      out.stages.push_back(e);
      StagePlan f = stage(i);
      linear(f, L.mlp_out, false, kActNone, d.delta[1], d.hidden, inter, d.act);
      out.stages.push_back(f);
    }
  }
  out.final_resid = cur;
  return out;
}

// Per place in a stage (0 or 1), the workspace its linears need at most: flags and partial sums.
struct Regions {
  int64_t flags[kStepMaxLinears] = {0, 0};
  int64_t partials[kStepMaxLinears] = {0, 0};
};

// The work split (step.cuh: StageSplit) and the inputs' places: each stage's units in equal runs over `blocks`; the
// rows of partial sums each linear needs (the most blocks whose runs share one of its strips); its x in the stage's
// x area. Returns the workspace regions and (max_x) the x area's bytes.
Regions split_units(Built& built, int blocks, int64_t batch, int64_t& max_x) {
  Regions r;
  max_x = 0;
  for (StagePlan& st : built.stages) {
    if (!st.num_linears) continue;
    int64_t units = 0, x = 0;
    for (int j = 0; j < st.num_linears; ++j) {
      LinearPlan& lp = built.linears[st.linear[j]];
      lp.unit_begin = static_cast<int32_t>(units);
      units += static_cast<int64_t>(lp.strips) * k_units_of(lp.k);
      lp.x_stride = k_units_of(lp.k) * 256 + 8;  // 16 bytes of padding: batch rows in different banks
      lp.x_offset = static_cast<int32_t>(x);
      x += batch * lp.x_stride;
    }
    st.units = static_cast<int32_t>(units);
    max_x = std::max<int64_t>(max_x, x * 2);
    const LinearPlan& first = built.linears[st.linear[0]];
    const bool two = st.num_linears > 1;
    const StageSplit split{st.units,
                           blocks,
                           k_units_of(first.k),
                           two ? k_units_of(built.linears[st.linear[1]].k) : 1,
                           two ? built.linears[st.linear[1]].unit_begin : st.units,
                           first.strips};
    int strip = 0;  // numbered over both linears, as the kernel's split numbers them
    for (int j = 0; j < st.num_linears; ++j) {
      LinearPlan& lp = built.linears[st.linear[j]];
      lp.slots = 1;
      for (int t = 0; t < lp.strips; ++t, ++strip) {
        lp.slots = std::max(lp.slots, split.owner(split.last_unit(strip)) - split.owner(split.first_unit(strip)) + 1);
      }
      r.flags[j] = std::max<int64_t>(r.flags[j], static_cast<int64_t>(lp.strips) * lp.slots);
      r.partials[j] = std::max<int64_t>(r.partials[j], static_cast<int64_t>(lp.slots) * batch * lp.strips * 128);
    }
  }
  return r;
}

}  // namespace

cudaError_t plan_step(const StepDesc& d, StepLayout& layout) {
  layout = StepLayout{};
  const auto fail = [&](const char* reason) {
    layout.reason = reason;
    return cudaErrorNotSupported;
  };
  int device = 0, major = 0, sms = 0, smem_optin = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (major != 9) return fail("the step kernel needs a Hopper GPU (sm_90: copy engine, mbarriers)");
  if (d.dtype != DType::kFloat16 && d.dtype != DType::kBFloat16) return fail("the step kernel takes fp16 or bf16");
  if (d.batch < 1 || d.batch > 8) return fail("the step kernel takes batch 1 to 8");
  if (d.num_layers < 1) return fail("no layers");
  if (d.hidden % 8 || d.hidden > 8192) return fail("hidden size must be a multiple of 8, at most 8192");
  if (d.head_dim != 64 && d.head_dim != 80 && d.head_dim != 128) return fail("head_dim must be 64, 80 or 128");
  if (d.num_kv_heads < 1 || d.num_q_heads % d.num_kv_heads) return fail("query heads must be a multiple of kv heads");
  if (d.rotary_dim % 2 || d.rotary_dim > d.head_dim) return fail("bad rotary dims");
  if (d.attention_splits < 1 || d.attention_splits > 16) return fail("attention splits must be 1..16");
  if (d.interleaved && d.num_q_heads != d.num_kv_heads) return fail("interleaved qkv needs as many kv as q heads");
  const bool silu = d.mlp_act == kActSiluMul;
  for (int i = 0; i < d.num_layers; ++i) {
    const StepLayerDesc& L = d.layers[i];
    const int64_t inter = width_of(L.mlp_in) / (silu ? 2 : 1);
    const char* reason = linear_reason(L.qkv, d.hidden, false, d.group_size);
    if (!reason) reason = linear_reason(L.out, d.num_q_heads * d.head_dim, false, d.group_size);
    if (!reason) reason = linear_reason(L.mlp_in, d.hidden, silu, d.group_size);
    if (!reason) reason = linear_reason(L.mlp_out, inter, false, d.group_size);
    if (reason) return fail(reason);
    if (width_of(L.qkv) != (d.num_q_heads + 2 * d.num_kv_heads) * d.head_dim) return fail("qkv width != heads");
    if (width_of(L.out) != d.hidden || width_of(L.mlp_out) != d.hidden) return fail("projections must give hidden");
  }
  Built built = build(d);
  int64_t max_x = 0;
  const Regions regions = split_units(built, sms, d.batch, max_x);
  // Shared memory: the ring, x, the norm's inputs, the sums (two halves and the finished values), the attention's.
  int slot_bytes = 0;
  for (const LinearPlan& lp : built.linears) {
    const int64_t gpu = d.group_size >= lp.k || d.group_size >= 256 ? 1 : 256 / d.group_size;
    const int64_t columns = lp.silu ? 64 : 128, boxes = lp.silu ? 2 : 1;
    const int64_t params = boxes * (align_up(gpu * columns * 2, 128) + align_up(gpu * columns / 2, 128));
    slot_bytes = std::max(slot_bytes, static_cast<int>(align_up(kStepQBytes + params, 1024)));
  }
  const int64_t x_bytes = align_up(max_x, 128);
  const int64_t norm_bytes = align_up((4 + d.batch) * d.hidden * 2, 128);
  const int64_t red_bytes = align_up(3 * d.batch * 128 * 4, 128);
  const int64_t attn_bytes = align_up(sizeof(AttnScratch), 128);
  const int64_t budget = smem_optin - 2048 /* static */ - 1024 /* alignment */;
  const int64_t rest = x_bytes + norm_bytes + red_bytes + attn_bytes;
  const int64_t slots = std::min<int64_t>(kStepMaxSlots, (budget - rest) / slot_bytes);
  if (slots < kMinSlots) return fail("the step's inputs do not leave the weight ring enough shared memory");

  StepPlan& P = layout.plan;
  P.dtype = d.dtype;
  P.batch = static_cast<int32_t>(d.batch);
  P.hidden = static_cast<int32_t>(d.hidden);
  P.num_stages = static_cast<int32_t>(built.stages.size());
  P.blocks = sms;
  P.ring_slots = static_cast<int32_t>(slots);
  P.slot_bytes = slot_bytes;
  P.x_offset = static_cast<int32_t>(slots * slot_bytes);
  P.norm_offset = static_cast<int32_t>(P.x_offset + x_bytes);
  P.red_offset = static_cast<int32_t>(P.norm_offset + norm_bytes);
  P.attn_offset = static_cast<int32_t>(P.red_offset + red_bytes);
  P.smem_bytes = static_cast<int32_t>(P.attn_offset + attn_bytes);
  P.bounds = env_int("PATCHER_STEP_BOUNDS");  // a diagnostic (launchers.h: StepPlan::bounds)
  layout.array_bytes = align_up(static_cast<int64_t>(built.stages.size() * sizeof(StepStage)), alignof(StepLinear)) +
                       static_cast<int64_t>(built.linears.size() * sizeof(StepLinear));
  const int64_t attn_partials = d.batch * d.num_q_heads * d.attention_splits * (d.head_dim + 2);
  // Workspace: the barrier [arrivals, epoch, launches], attention counters, the linears' flags, partial sums.
  layout.workspace_bytes = 64 + align_up(d.batch * d.num_q_heads * 4, 256) +
                           (align_up(regions.flags[0], 64) + align_up(regions.flags[1], 64)) * 4 +
                           (regions.partials[0] + regions.partials[1] + attn_partials) * 4;
  layout.final_resid = built.final_resid;
  return cudaSuccess;
}

cudaError_t fill_step(const StepDesc& d, StepLayout& layout, void* host, void* device_arrays, void* workspace) {
  Built built = build(d);
  StepPlan& P = layout.plan;
  int64_t max_x = 0;
  const Regions regions = split_units(built, P.blocks, d.batch, max_x);
  std::memset(host, 0, static_cast<size_t>(layout.array_bytes));
  const int64_t stages_bytes =
      align_up(static_cast<int64_t>(built.stages.size() * sizeof(StepStage)), alignof(StepLinear));
  auto* stages = static_cast<StepStage*>(host);
  auto* linears = reinterpret_cast<StepLinear*>(static_cast<char*>(host) + stages_bytes);
  P.stages = static_cast<const StepStage*>(device_arrays);
  P.linears = reinterpret_cast<const StepLinear*>(static_cast<char*>(device_arrays) + stages_bytes);

  // The workspace, in plan_step's order.
  char* ws = static_cast<char*>(workspace);
  P.barrier = reinterpret_cast<unsigned long long*>(ws);
  ws += 64;
  P.attn_counters = reinterpret_cast<int32_t*>(ws);
  ws += align_up(d.batch * d.num_q_heads * 4, 256);
  unsigned* flags[kStepMaxLinears];
  flags[0] = reinterpret_cast<unsigned*>(ws);
  flags[1] = flags[0] + align_up(regions.flags[0], 64);
  ws += (align_up(regions.flags[0], 64) + align_up(regions.flags[1], 64)) * 4;
  float* partials[kStepMaxLinears];
  partials[0] = reinterpret_cast<float*>(ws);
  partials[1] = partials[0] + regions.partials[0];
  P.attn_partials = partials[1] + regions.partials[1];

  std::vector<int> place(built.linears.size(), 0);  // each linear's place in its stage: its workspace region
  for (const StagePlan& st : built.stages) {
    for (int j = 0; j < st.num_linears; ++j) place[st.linear[j]] = j;
  }
  for (size_t i = 0; i < built.linears.size(); ++i) {
    const LinearPlan& lp = built.linears[i];
    StepLinear& L = linears[i];
    StepLinearInfo& I = L.info;
    const StepLinearDesc& ld = *lp.desc;
    const int64_t groups = d.group_size >= lp.k ? 1 : (lp.k + d.group_size - 1) / d.group_size;
    I.group_shift = 30;
    if (d.group_size < lp.k) {
      I.group_shift = 0;
      while ((int64_t{1} << I.group_shift) < d.group_size) ++I.group_shift;
    }
    I.groups_per_unit = d.group_size >= lp.k || d.group_size >= 256 ? 1 : static_cast<int32_t>(256 / d.group_size);
    I.box_columns = lp.silu ? 64 : 128;
    I.scale_bytes = static_cast<int32_t>(align_up(I.groups_per_unit * I.box_columns * 2, 128));
    I.zero_bytes = static_cast<int32_t>(align_up(I.groups_per_unit * I.box_columns / 2, 128));
    I.num_segments = ld.num_segments;
    I.strips = lp.strips;
    I.k = static_cast<int32_t>(lp.k);
    I.k_units = k_units_of(lp.k);
    I.unit_begin = lp.unit_begin;
    I.silu = lp.silu ? 1 : 0;
    I.act = lp.act;
    I.x_offset = lp.x_offset;
    I.x_stride = lp.x_stride;
    I.zero_offset = d.zero_offset;
    I.slots = lp.slots;
    I.out = lp.out;
    I.out_width = lp.out_width;
    I.partials = partials[place[i]];
    I.flags = flags[place[i]];
    int strips = 0;
    for (int s = 0; s < ld.num_segments; ++s) {
      const Int4Segment& seg = ld.seg[s];
      I.n[s] = static_cast<int32_t>(seg.n);
      I.bias[s] = seg.bias;
      I.strips_before[s] = strips;
      strips += static_cast<int32_t>((seg.n + 127) / 128);
      if (!encode_map(L.qweight[s], CU_TENSOR_MAP_DATA_TYPE_INT32, 4, seg.qweight, seg.n, lp.k / 8, 32, 32,
                      CU_TENSOR_MAP_SWIZZLE_128B) ||
          !encode_map(L.scales[s], CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2, seg.scales, seg.n, groups, I.box_columns,
                      I.groups_per_unit) ||
          !encode_map(L.zeros[s], CU_TENSOR_MAP_DATA_TYPE_INT32, 4, seg.qzeros, seg.n / 8, groups, I.box_columns / 8,
                      I.groups_per_unit)) {
        layout.reason = "the driver rejected a tensor map of the GPTQ tensors";
        return cudaErrorNotSupported;
      }
    }
    I.strips_before[ld.num_segments] = strips;
  }
  for (size_t i = 0; i < built.stages.size(); ++i) {
    const StagePlan& sp = built.stages[i];
    StepStage& st = stages[i];
    st.attention = sp.attention ? 1 : 0;
    st.ad.k_cache = d.layers[sp.layer].k_cache;
    st.ad.v_cache = d.layers[sp.layer].v_cache;
    st.num_linears = sp.num_linears;
    for (int j = 0; j < sp.num_linears; ++j) {
      st.linear[j] = sp.linear[j];
      st.x[j] = sp.x[j];
    }
    st.units = sp.units;
    st.norm = sp.norm;
    st.nd = sp.nd;
  }
  P.rms = d.rms ? 1 : 0;
  P.eps = d.eps;
  P.num_q_heads = static_cast<int32_t>(d.num_q_heads);
  P.num_kv_heads = static_cast<int32_t>(d.num_kv_heads);
  P.head_dim = static_cast<int32_t>(d.head_dim);
  P.rotary_dim = static_cast<int32_t>(d.rotary_dim);
  P.interleaved = d.interleaved ? 1 : 0;
  P.splits = d.attention_splits;
  P.qkv_width = static_cast<int32_t>((d.num_q_heads + 2 * d.num_kv_heads) * d.head_dim);
  P.capacity = d.capacity;
  P.table_len = d.table_len;
  P.scale = d.scale;
  P.cos = d.cos;
  P.sin = d.sin;
  P.slot = d.slot;
  P.pad = d.pad;
  P.qkv = d.qkv;
  P.attn = d.attn;
  return cudaSuccess;
}

cudaError_t launch_step(const StepPlan& plan, cudaStream_t stream) {
  switch (plan.dtype) {
    case DType::kFloat16:
      return launch_step_half(plan, stream);
    case DType::kBFloat16:
      return launch_step_bf16(plan, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace patcher
