"""One decode step of a patched model, from the same patch plans the eager forward reads.

Each layer runs the dataflow of its eager forward (patcher/layers/decoder.py) on the decode kernels, with the
residual stream carried as (residual, delta, delta2) exactly as the eager layers hand it on:

    sequential (LLaMA, Qwen2)     [add +] norm -> QKV, RoPE, K/V into the cache -> decode attention -> o_proj
                                  -> add + norm -> gate/up with SiLU * up -> down
    parallel (GPT-NeoX)           [adds +] both LayerNorms -> QKV, RoPE, K/V into the cache -> attention -> dense
                                  beside: the MLP on the second LayerNorm (dense: on a second stream)

What changes against the eager forward is only where an op boundary falls:
- every linear that reads a norm's output can take that add + norm as its prologue (norm_gemv,
  norm_gemv_rope_cache, int4 ops): dense GEMVs do so up to DecodeOptions.fused_norm_max_hidden (RMSNorm) or
  fused_layer_norm_max_hidden (LayerNorm), int4 ops below int4_separate_norm_batch; elsewhere the norm runs as its
  own kernel in front, with the same values;
- the QKV projection writes RoPE'd K/V into the static cache in its epilogue;
- from DecodeOptions.cublas_min_batch rows dense linears run on cuBLAS, then the activation or RoPE kernel;
- a GGUF projection (layers/weights.py GGUFProjection) runs its GGUFLinear modules' own ops (gguf_gemv), with the
  norm kernel in front and the activation or rope_qkv_cache after it;
- GPTQ int4 output projections may hand their sums on unmet (decode/int4_plan.py), and GPT-NeoX's int4 layer
  is three launches: both LayerNorms + QKV + the MLP's input projection, the attention, both output projections.
The final norm takes the last layer's stream the same way, and the lm_head is a GEMV after it.

Tensor parallel (transformers' tp_plan, patcher/parallel/): every plan holds this rank's shards and local head
counts, so the cache and the attention hold this rank's heads; the hidden size is whole on every rank. Each
row-wise output projection sums the ranks' partial products before its bias (rowwise_linear, the eager forward's
function; on GPUs the rank_sum kernel over buffers every rank maps, parallel/rank_sum.py); an embedding sharded
by vocabulary is looked up on this rank's block and summed, and an lm_head sharded by vocabulary gathers its
blocks of logits, so every rank has the same [B, V] logits and picks the same token (parallel/vocab.py).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..gguf import GGUFLinear
from ..layers.weights import GGUFProjection, head_device, head_rows
from ..ops import int4
from ..parallel import RankSum, embedding_lookup, gather_logits, rank_sum_reason, rowwise_linear, shard, vocab_group
from ..registry import REGISTRY
from .int4_plan import Int4Plan

NO_PROLOGUE = (None,) * 6 + (0.0, False)  # the prologue arguments of an op that takes no add + norm


def segments(devices: list[torch.device]) -> list[tuple[torch.device, int, int]]:
    """(device, first layer, end) of each run of consecutive layers on one device."""
    runs: list[tuple[torch.device, int, int]] = []
    for i, device in enumerate(devices):
        if runs and runs[-1][0] == device:
            runs[-1] = (device, runs[-1][1], i + 1)
        else:
            runs.append((device, i, i + 1))
    return runs


MAX_SPLITS = 16  # decode_attention merges at most this many partial softmaxes per (row, kv head)


@dataclass
class QkvOut:
    """A QKV projection's output [B, (Hq + 2 Hkv) * D] handed to the attention before RoPE and the cache write,
    which decode_attention_qkv does in its own kernel (the GGUF QKV, whose GEMV has no RoPE epilogue)."""

    qkv: torch.Tensor


@dataclass
class LayerStep:
    """What one layer's decode step reads: its modules' patch plans and its norms' parameters."""

    attention: object  # AttentionPlan
    mlp: object  # MlpPlan
    scale: float
    mlp_act: str  # the activation fused into the MLP's first linear: "silu_mul", "gelu" or "gelu_tanh"
    norms: tuple  # ((weight, bias, eps) of the input norm, (weight, bias, eps) of the post-attention norm)
    separate_norms: tuple  # the norms as their own kernels: (x, delta, delta2) -> (h, sum, h2)
    out_pair: object = None  # GPT-NeoX int4: both output projections as one Int4Linear over [attn | h]
    qkv_mlp: object = None  # GPT-NeoX int4: QKV and the MLP's input projection side by side (int4_qkv_mlp_in)


def norm_params(norm, spec) -> tuple:
    return norm.weight, getattr(norm, "bias", None), float(getattr(norm, spec.eps_attr))


def separate_norm(norm, add_norm):
    """A norm plan's closures (patcher/layers/norm.py) as (x, delta, delta2) -> (h, sum, h2). sum is x where
    there is no delta; no h2."""
    return lambda x, d, d2: (norm(x), x, None) if d is None else (*add_norm(x, d, d2), None)


def separate_dual_norm(plan):
    """GPT-NeoX's junction (both LayerNorms of one sum) from a layer plan, as separate_norm returns it."""

    def run(x, d, d2):
        if d is None:
            h, h2 = plan.dual_norm(x)
            return h, x, h2
        h, h2, total = plan.add_dual_norm(x, d, d2)
        return h, total, h2

    return run


def layer_step(layer, spec, parallel: bool, merge_int4: bool) -> LayerStep:
    """A decoder layer's LayerStep from the plans patch_model gave its modules."""
    attention, mlp, plan = getattr(layer, spec.attention), getattr(layer, spec.mlp), layer._patcher
    if spec.mlp_gated:
        act = "silu_mul"
    else:
        act = "gelu_tanh" if getattr(mlp._patcher, "tanh", False) else "gelu"
    norms = (norm_params(getattr(layer, spec.input_norm), spec), norm_params(getattr(layer, spec.post_norm), spec))
    if parallel:
        separate = (separate_dual_norm(plan), None)
    else:
        separate = (separate_norm(plan.norm, plan.add_norm), separate_norm(None, plan.post_add_norm))
    step = LayerStep(attention._patcher, mlp._patcher, float(attention.scaling), act, norms, separate)
    if merge_int4 and parallel and act != "silu_mul":
        step.out_pair = plan.out_pair  # stacked by patch_model where it could (patcher/layers/out_pair.py)
        a, m = attention._patcher, mlp._patcher
        if a.qkv_int4 is not None and m.in_int4 is not None:
            step.qkv_mlp = int4.side_by_side(a.qkv_int4, m.in_int4)
    return step


class DecodeStep:
    """The logits of the current tokens of a StepState, K/V written into its cache: the model's layers as decode
    kernels. Runs eagerly, or inside a graph capture (runner.py)."""

    def __init__(self, model, options):
        config = model.config
        spec = REGISTRY[config.model_type].spec
        base = getattr(model, spec.base_model, model)
        self.model, self.config, self.spec, self.options = model, config, spec, options
        self.embed = model.get_input_embeddings()
        # tensor parallel: tables sharded by vocabulary, run on this rank's block (embedding_lookup, gather_logits)
        self.embed_group = vocab_group(self.embed.weight)
        # next_token writes the next step's input itself where the embedding is a plain, whole table lookup;
        # otherwise (a subclass with its own forward, max_norm, a sharded table) the step looks the tokens up.
        plain = type(self.embed).forward is torch.nn.Embedding.forward and self.embed.max_norm is None
        fused = options.fuse_next_token and plain and self.embed_group is None and self.embed.weight.is_contiguous()
        self.embed_weight = self.embed.weight if fused else None
        lm_head = model.get_output_embeddings()
        # A GGUF file's lm_head kept as blocks (load_gguf) runs its module's own op, as the layers' GGUF projections.
        self.lm_gguf = GGUFProjection([lm_head]) if isinstance(lm_head, GGUFLinear) else None
        head_weight = None if self.lm_gguf else lm_head.weight
        self.lm_group = None if self.lm_gguf else vocab_group(head_weight)
        self.lm_weight, self.lm_bias = shard(head_weight), shard(getattr(lm_head, "bias", None))
        self.vocab = head_rows(lm_head)  # the whole vocabulary (a DTensor's shape is the global one)
        head_at = head_device(lm_head)
        self.rotary = base.rotary_emb
        final_norm = getattr(base, spec.final_norm)
        self.final_norm = norm_params(final_norm, spec)
        self.final_separate_norm = separate_norm(final_norm._patcher.norm, final_norm._patcher.add_norm)
        self.parallel = spec.flag(config, spec.parallel_residual)
        self.rms = spec.norm == "rms"
        layers = getattr(base, spec.layers)
        self.layers = [layer_step(layer, spec, self.parallel, options.merge_int4) for layer in layers]
        # A model split over GPUs (accelerate's device_map): runs of consecutive layers on one device, each a part of
        # the step the runner captures as its own graph; the embedding goes with the first, the head with the last.
        self.segments = segments([next(layer.parameters()).device for layer in layers])
        if self.segments[0][0] != self.embed.weight.device:  # the embedding on a device of its own
            self.segments.insert(0, (self.embed.weight.device, 0, 0))
        if self.segments[-1][0] != head_at:  # so the final norm and the lm_head
            self.segments.append((head_at, len(layers), len(layers)))
        if len(self.segments) > 1:  # next_token's embedding copy would read the first segment's table from the last
            self.embed_weight = None
        self.gguf = self.lm_gguf is not None or any(
            p is not None
            for layer in self.layers
            for p in (layer.attention.qkv_gguf, layer.attention.out_gguf, layer.mlp.in_gguf, layer.mlp.out_gguf)
        )
        self.ops = self.layers[0].attention.ops
        self.num_layers = len(self.layers)
        first = self.layers[0].attention  # (tensor parallel: this rank's heads; every layer has the same counts)
        self.num_heads, self.num_kv_heads = first.num_heads, first.num_kv_heads
        self.tensor_parallel = any(
            g is not None for g in (self.embed_group, self.lm_group, *(x.attention.group for x in self.layers),
                                    *(x.mlp.group for x in self.layers))
        )  # fmt: skip
        self.head_dim = spec.head_dim(config)
        self.hidden = lm_head.in_features if self.lm_gguf else self.lm_weight.shape[1]
        # (the activations' dtype: a GGUF head's blocks have none, the embedding its load_gguf dtype)
        self.device = head_at
        self.dtype = self.embed.weight.dtype if self.lm_gguf else self.lm_weight.dtype
        # the row-wise projections' sums: a RankSum of each StepState where every layer sums over one group that
        # rank_sum serves (NCCL on GPUs), else dist.all_reduce
        groups = {id(g): g for x in self.layers for g in (x.attention.group, x.mlp.group) if g is not None}
        self.reduce_group = next(iter(groups.values())) if len(groups) == 1 else None
        if self.reduce_group is not None and rank_sum_reason(self.reduce_group, self.device, self.dtype) is not None:
            self.reduce_group = None
        self.int4 = Int4Plan(self.layers, self.parallel, options, self.device, self.dtype, self.num_heads,
                             self.head_dim)  # fmt: skip
        # GPT-NeoX's MLP on a second stream, beside QKV -> attention -> dense (the graph captures the two as
        # parallel branches: HBM keeps streaming MLP weights while the attention, which reads little, runs); none
        # where every layer runs int4_qkv_mlp_in on one stream, and none with tensor parallelism: the ranks'
        # collectives on one communicator must run in the same order on every rank, which two streams don't fix.
        merged = all(layer.qkv_mlp is not None for layer in self.layers)
        branch = options.parallel_branch and self.parallel and not merged and self.device.type == "cuda"
        branch = branch and not self.tensor_parallel
        self.branch_stream = torch.cuda.Stream(self.device) if branch else None

    # ---- shapes of the step's buffers -----------------------------------------------------------------------
    def rank_sum(self, batch: int) -> RankSum | None:
        """The row-wise sums of a step of `batch` rows over the ranks' shared buffers (a collective: every rank
        asks at the same point), or None where they run on dist.all_reduce."""
        if self.reduce_group is None:
            return None
        try:
            return RankSum(self.reduce_group, batch * self.hidden, self.dtype, self.device, self.ops)
        except RuntimeError as error:  # (symmetric memory needs peer access between the GPUs)
            warnings.warn(f"patcher: the row-wise sums stay on dist.all_reduce: {error}", stacklevel=2)
            self.reduce_group = None
            return None

    def attention_splits(self, batch: int) -> int:
        """Key splits per (row, kv head) of the decode attention: enough blocks to cover the GPU twice."""
        if self.device.type != "cuda":
            return 1
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        return max(1, min(MAX_SPLITS, math.ceil(2 * sms / (batch * self.num_kv_heads))))

    def rope_tables(self, capacity: int, device: torch.device | None = None):
        """cos/sin [capacity, rotary_dim] for positions 0..capacity-1, from the model's own rotary embedding, on
        `device` (default: the step's)."""
        buffers = list(self.rotary.buffers())
        home = buffers[0].device if buffers else self.device
        positions = torch.arange(capacity, device=home)[None]
        probe = torch.empty(1, device=home, dtype=self.dtype)
        with torch.no_grad():
            cos, sin = self.rotary(probe, position_ids=positions)
        device = self.device if device is None else device
        return cos[0].contiguous().to(device), sin[0].contiguous().to(device)

    # ---- the ops of a layer -----------------------------------------------------------------------------------
    def _prologue(self, delta, delta2, norm, norm2=None) -> tuple:
        """The add + norm arguments every prologue-taking op shares."""
        (w, b, eps), (w2, b2) = norm, (norm2[:2] if norm2 else (None, None))
        return (delta, delta2, w, b, w2, b2, eps, self.rms)

    def _norm_linear(self, x, pro, separate, weight, bias, act: str, st, int4_linear=None, fuse=True, gguf=None):
        """act(norm(x [+ deltas]) @ W^T + b) with the add + norm as the op's prologue where the kernels take it (and
        `fuse`), else in front: int4_norm_prologue for an int4 linear, `separate` for a dense or GGUF one (gguf: a
        GGUFProjection, whose modules take no prologue). Returns (out, sum, h2)."""
        if int4_linear is not None:
            if not st.int4_separate_norm:
                return self.ops.int4_gemv(x, *pro, *int4_linear.args(), act, st.int4_splits[id(int4_linear)],
                                          st.int4_workspace)  # fmt: skip
            h, total, h2 = self.ops.int4_norm_prologue(x, *pro)
        elif st.fused_norms and fuse and gguf is None:
            return self.ops.norm_gemv(x, *pro, weight, bias, act)
        elif gguf is not None and (fused := self._gguf_norm_linear(x, pro, gguf)) is not None:
            return self._activation(fused[0], act), fused[1], None
        else:
            h, total, h2 = separate(x, pro[0], pro[1])
        return self._linear(h, weight, bias, act, st, int4_linear, gguf=gguf), total, h2

    def _gguf_norm_linear(self, x, pro, gguf, feeds_attention: bool = False) -> tuple | None:
        """(gguf(rms_norm(x [+ delta])), sum) in one op, the norm writing the projection's input as its GEMV reads
        it (Q8_1 blocks), one kernel less than the norm and the projection apart; None where that op does not serve
        (a LayerNorm, two deltas or norms, or a projection whose modules take different paths). feeds_attention: the
        output goes straight to decode_attention_qkv."""
        if not self.rms or pro[1] is not None or pro[4] is not None or (args := gguf.op_args(x)) is None:
            return None
        out, total = self.ops.gguf_norm_gemv_cat(x, pro[0], pro[2], pro[6], *args, feeds_attention=feeds_attention)
        return out, (x if pro[0] is None else total)

    def _linear(self, h, weight, bias, act: str, st, int4_linear=None, workspace=None, gguf=None, group=None):
        """h @ W^T (+ b) with the MLP activation: our GEMV (epilogue fused), or cuBLAS then the activation; a GGUF
        projection (gguf) runs its modules' own ops, then the activation. `workspace`: the int4 workspace of the
        stream it runs on (default: the main stream's). `group`: a dense row-wise shard (tensor parallel), whose
        partial products are summed over the group's ranks before the bias."""
        if group is not None:
            matmul = lambda x, w: self._linear(x, w, None, act, st)
            return rowwise_linear(h, weight, bias, group, matmul, st.rank_sum)
        if int4_linear is not None:
            workspace = st.int4_workspace if workspace is None else workspace
            return self.ops.int4_gemv(h, *NO_PROLOGUE, *int4_linear.args(), act, st.int4_splits[id(int4_linear)],
                                      workspace)[0]  # fmt: skip
        if gguf is not None:
            return self._activation(gguf(h), act)
        if not st.cublas:
            return self.ops.gemv(h, weight, bias, act)
        return self._activation(F.linear(h, weight, bias), act)

    def _activation(self, y, act: str):
        """The activation a GEMV's epilogue would apply, as its own op after a linear that has none."""
        if act == "silu_mul":
            return self.ops.silu_and_mul(y)
        if act != "none":
            return F.gelu(y, approximate="tanh" if act == "gelu_tanh" else "none")
        return y

    def _accumulate(self, kind: str, i: int, x, x2, lin, st, early: bool = False) -> tuple:
        """x (and x2 beside it along k) through the deferred linear (kind, i) into its accumulator: (delta, delta2)
        for the reader's prologue."""
        d = st.deferred[(kind, i)]
        args = lin.args(bias=False)
        self.ops.int4_gemv_acc(x, x2, *args, st.int4_splits[id(lin)], st.int4_workspace, d.acc, d.clear, early)
        return d.acc, d.bias_rows

    @staticmethod
    def _qkv_takes_norm(layer: LayerStep, st) -> bool:
        """Whether the QKV op computes the input norm in its prologue (int4, or dense with fused norms; a GGUF
        projection never does)."""
        a = layer.attention
        return a.qkv_gguf is None and (a.qkv_int4 is not None or st.fused_norms)

    @staticmethod
    def _rope_args(layer: LayerStep, index: int, st) -> tuple:
        a = layer.attention
        return st.cos, st.sin, st.slot, st.pad, st.k[index], st.v[index], a.num_heads, a.num_kv_heads, a.head_dim

    def _qkv(self, layer: LayerStep, index: int, x, pro, st):
        """[add +] norm -> QKV -> RoPE -> K/V into the cache slot; returns (q, sum, h2)."""
        a, ops = layer.attention, self.ops
        if a.qkv_int4 is not None and st.int4_separate_norm:
            h, total, h2 = ops.int4_norm_prologue(x, *pro)
            return self._qkv_rope(layer, index, h, st), total, h2
        if a.qkv_gguf is not None and (fused := self._gguf_norm_linear(x, pro, a.qkv_gguf, True)) is not None:
            return QkvOut(fused[0]), fused[1], None  # RoPE and the cache write in the attention's kernel
        if not self._qkv_takes_norm(layer, st):
            h, total, h2 = layer.separate_norms[0](x, pro[0], pro[1])
            return self._qkv_rope(layer, index, h, st), total, h2
        rope = self._rope_args(layer, index, st)
        if a.qkv_int4 is not None:
            lin = a.qkv_int4
            return ops.int4_qkv_rope_cache(x, *pro, *lin.args(), *rope, a.interleaved, st.int4_splits[id(lin)],
                                           st.int4_workspace)  # fmt: skip
        return ops.norm_gemv_rope_cache(x, *pro, a.qkv_weight, a.qkv_bias, *rope, a.interleaved)

    def _qkv_acc(self, layer: LayerStep, index: int, x, pro, st) -> tuple:
        """The int4 QKV projection behind its add + norm into its accumulator, for the attention to finish:
        (the DeferredOut to pass as _attention's q, sum)."""
        lin, d = layer.attention.qkv_int4, st.deferred[("qkv", index)]
        args = (*lin.args(bias=False), st.int4_splits[id(lin)], st.int4_workspace, d.acc, d.clear)
        if st.int4_separate_norm:
            h, total, _ = self.ops.int4_norm_prologue(x, *pro)
            self.ops.int4_gemv_acc(h, None, *args, feeds_attention=True)
            return d, total
        total, _ = self.ops.int4_norm_gemv_acc(x, *pro, *args)
        return d, total

    def _qkv_rope(self, layer: LayerStep, index: int, h, st):
        """QKV -> RoPE -> K/V into the cache slot from the norm's output h; returns q."""
        a, ops = layer.attention, self.ops
        rope = self._rope_args(layer, index, st)
        if a.qkv_gguf is not None:
            return ops.rope_qkv_cache(a.qkv_gguf(h), *rope, a.interleaved)
        if a.qkv_int4 is not None:
            lin = a.qkv_int4
            return ops.int4_qkv_rope_cache(h, *NO_PROLOGUE, *lin.args(), *rope, a.interleaved, st.int4_splits[id(lin)],
                                           st.int4_workspace)[0]  # fmt: skip
        if not st.cublas:
            return ops.norm_gemv_rope_cache(h, *NO_PROLOGUE, a.qkv_weight, a.qkv_bias, *rope, a.interleaved)[0]
        qkv = self._linear(h, a.qkv_weight, a.qkv_bias, "none", st)
        return ops.rope_qkv_cache(qkv, *rope, a.interleaved)

    def _qkv_mlp(self, layer: LayerStep, index: int, x, delta, delta2, st):
        """GPT-NeoX int4 in one op: [adds +] both LayerNorms, QKV -> RoPE -> K/V into the cache from the first, the
        MLP's input projection and activation from the second; returns (q, MLP hidden, sum)."""
        a, lin = layer.attention, layer.qkv_mlp
        norm, post_norm = layer.norms
        pro = self._prologue(delta, delta2, norm, post_norm)
        rope = self._rope_args(layer, index, st)
        args = (*lin.args(), *rope, a.interleaved, len(a.qkv_int4.widths), layer.mlp_act, st.int4_splits[id(lin)],
                st.int4_workspace)  # fmt: skip
        if st.int4_separate_norm:  # both LayerNorms in front; the op's QKV tiles read h, its MLP tiles h2
            h, total, h2 = self.ops.int4_norm_prologue(x, *pro)
            q, hidden, _ = self.ops.int4_qkv_mlp_in(h, *NO_PROLOGUE, *args, h2)
            return q, hidden, total
        return self.ops.int4_qkv_mlp_in(x, *pro, *args)

    def _attention(self, layer: LayerStep, q, st, index: int, project: bool = True):
        """Attention over the cache and (with `project`) the output projection. q: the query [B, Hq, D], the QKV
        projection's DeferredOut (q and the current token's K/V still in its accumulator), or its QkvOut (its output,
        before RoPE and the cache write)."""
        a = layer.attention
        if isinstance(q, torch.Tensor):
            out = self.ops.decode_attention(q, st.k[index], st.v[index], st.slot, st.pad, layer.scale, st.splits,
                                            st.workspace)  # fmt: skip
        elif isinstance(q, QkvOut):
            args = (q.qkv, st.cos, st.sin, st.slot, st.pad, st.k[index], st.v[index], a.num_heads, a.interleaved,
                    layer.scale, st.splits, st.workspace)  # fmt: skip
            into = q.qkv[:, : a.num_heads * a.head_dim]  # the attention's output shape, for the projection's path
            gguf = a.out_gguf if project and a.head_dim % 32 == 0 else None
            if gguf is not None and (out_args := gguf.op_args(into)) is not None:
                # the attention writes the GGUF output projection's input itself (one kernel less)
                return self.ops.gguf_attention_gemv_cat(*args, *out_args)
            out = self.ops.decode_attention_qkv(*args)
        else:
            out = self.ops.decode_attention_qkv_acc(q.acc, q.bias_rows, st.cos, st.sin, st.slot, st.pad, st.k[index],
                                                    st.v[index], a.num_heads, a.interleaved, layer.scale, st.splits,
                                                    st.workspace)  # fmt: skip
        if not project:
            return out
        return self._linear(out, a.out_weight, a.out_bias, "none", st, a.out_int4, gguf=a.out_gguf, group=a.group)

    def _branch_mlp(self, layer: LayerStep, h, st):
        """GPT-NeoX's MLP on h = ln2(x), on the branch stream where there is one: it then runs beside the attention
        path until the layer joins the stream. h and the output stay referenced until after that join, so neither
        stream reuses their memory while the other may still use it. With the layer's out pair, only the first
        linear (its output projection is the out pair's second half)."""
        m, stream, workspace = layer.mlp, self.branch_stream, st.int4_workspace
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))  # after the work queued so far
            workspace = st.branch_int4_workspace
        with torch.cuda.stream(stream):  # None: a no-op, the work stays on the current stream
            inner = self._linear(h, m.in_weight, m.in_bias, layer.mlp_act, st, m.in_int4, workspace, m.in_gguf)
            if layer.out_pair is not None:
                return inner
            return self._linear(inner, m.out_weight, m.out_bias, "none", st, m.out_int4, workspace, m.out_gguf, m.group)

    # ---- a layer, per residual kind --------------------------------------------------------------------------
    def sequential_layer(self, layer: LayerStep, i: int, residual, delta, delta2, st) -> tuple:
        """x -> (x + attn(norm(x))) handed on with mlp(post_norm(...)) as the next delta (LLaMA, Qwen2)."""
        m = layer.mlp
        norm, post_norm = layer.norms
        pro = self._prologue(delta, delta2, norm)
        if ("qkv", i) in st.deferred:
            q, total = self._qkv_acc(layer, i, residual, pro, st)
        else:
            q, total, _ = self._qkv(layer, i, residual, pro, st)
        residual = residual if delta is None else total
        if ("attn_out", i) in st.deferred:
            out = self._attention(layer, q, st, i, project=False)
            attn, attn2 = self._accumulate("attn_out", i, out, None, layer.attention.out_int4, st)
        else:
            attn, attn2 = self._attention(layer, q, st, i), None
        pro = self._prologue(attn, attn2, post_norm)
        # GGUF gate/up and down: the down projection's input kernel computes the activation (one kernel less)
        silu_into_down = layer.mlp_act == "silu_mul" and m.in_gguf is not None and m.out_gguf is not None
        act = "none" if silu_into_down else layer.mlp_act
        inner, residual, _ = self._norm_linear(
            residual, pro, layer.separate_norms[1], m.in_weight, m.in_bias, act, st, m.in_int4, gguf=m.in_gguf
        )
        if silu_into_down:
            args = m.out_gguf.op_args(inner[..., : inner.shape[-1] // 2])
            if args is None:
                return residual, m.out_gguf(self._activation(inner, "silu_mul")), None
            return residual, self.ops.gguf_silu_mul_gemv_cat(inner, *args), None
        if ("mlp_out", i) in st.deferred:
            return (residual, *self._accumulate("mlp_out", i, inner, None, m.out_int4, st))
        out = self._linear(inner, m.out_weight, m.out_bias, "none", st, m.out_int4, gguf=m.out_gguf, group=m.group)
        return residual, out, None

    def parallel_layer(self, layer: LayerStep, i: int, residual, delta, delta2, st) -> tuple:
        """x -> x + attn(ln1(x)) + mlp(ln2(x)), the two terms handed on as (delta, delta2) (GPT-NeoX)."""
        m = layer.mlp
        norm, post_norm = layer.norms
        if layer.qkv_mlp is not None:  # int4: QKV and the MLP's input projection in one launch
            q, mlp_out, total = self._qkv_mlp(layer, i, residual, delta, delta2, st)
        elif self._qkv_takes_norm(layer, st):  # ln2(x) comes out of the QKV op as h2
            q, total, h_mlp = self._qkv(layer, i, residual, self._prologue(delta, delta2, norm, post_norm), st)
            mlp_out = self._branch_mlp(layer, h_mlp, st)
        else:  # the norm kernel first, so that the MLP starts beside the QKV GEMV
            h, total, h_mlp = layer.separate_norms[0](residual, delta, delta2)
            mlp_out = self._branch_mlp(layer, h_mlp, st)
            q = self._qkv_rope(layer, i, h, st)
        residual = residual if delta is None else total
        pair = layer.out_pair
        attn = self._attention(layer, q, st, i, project=pair is None)
        if layer.qkv_mlp is None and self.branch_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.branch_stream)
        elif layer.qkv_mlp is not None and pair is None:
            mlp_out = self._linear(mlp_out, m.out_weight, m.out_bias, "none", st, m.out_int4, gguf=m.out_gguf)
        if pair is None:
            return residual, attn, mlp_out
        # Both output projections as one GEMV over [attention | MLP hidden] (layers/out_pair.py). With
        # int4_qkv_mlp_in the MLP hidden was written before the attention began: the op's MLP slices may start
        # streaming their weights while the attention runs (`early`).
        early = layer.qkv_mlp is not None
        if ("out", i) in st.deferred:
            return (residual, *self._accumulate("out", i, attn, mlp_out, pair, st, early))
        splits = st.int4_splits[id(pair)]
        return residual, self.ops.int4_gemv_cat(attn, mlp_out, *pair.args(), splits, st.int4_workspace, early), None

    # ---- the whole step ---------------------------------------------------------------------------------------
    def layers_forward(self, stream, st, start: int = 0, end: int | None = None) -> tuple:
        """Layers [start, end) of the step (default: all) on the residual stream (residual, delta, delta2); returns
        it for the next layers or the final add + norm. st holds those layers' caches, the first at index 0."""
        layer_fn = self.parallel_layer if self.parallel else self.sequential_layer
        for i in range(start, self.num_layers if end is None else end):
            stream = layer_fn(self.layers[i], i - start, *stream, st)
        return stream

    def logits(self, st, x: torch.Tensor | None = None) -> torch.Tensor:
        """The next-token logits [B, V] of the current tokens (st.tokens[:, slot]); their K/V land in the cache.
        x: their embeddings [B, H] where next_token already looked them up (st.x), else they are looked up here."""
        x = self.embed_tokens(st.current_tokens()) if x is None else x
        return self.head(self.layers_forward((x, None, None), st), st)

    def head(self, stream, st) -> torch.Tensor:
        """The logits [B, V] from the last layer's residual stream: the final add + norm, then the lm_head."""
        residual, delta, delta2 = stream
        pro = self._prologue(delta, delta2, self.final_norm)
        if delta is not None and delta.dtype == torch.int64:  # the last int4 projection left its sums unmet
            h = self.ops.int4_norm_prologue(residual, *pro)[0]
            logits = self._linear(h, self.lm_weight, self.lm_bias, "none", st, gguf=self.lm_gguf)
        else:
            # On a GPU the lm_head never takes the final norm as its prologue: its vocab / 8 blocks would each
            # recompute the norm, which costs more than a norm kernel in front.
            fuse = self.device.type != "cuda"
            head = (self.lm_weight, self.lm_bias, "none", st)
            logits = self._norm_linear(residual, pro, self.final_separate_norm, *head, fuse=fuse, gguf=self.lm_gguf)[0]
        return logits if self.lm_group is None else gather_logits(logits, st.gathered_logits, self.lm_group)

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """The embeddings [B, H] of `tokens` [B]: the module's lookup, or (sharded by vocabulary) this rank's block
        summed over the ranks, as transformers' embedding_rowwise forward computes it."""
        if self.embed_group is not None:
            return embedding_lookup(tokens, self.embed.weight)
        return self.embed(tokens)
