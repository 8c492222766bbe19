"""The patched attention: one QKV GEMM, one kernel for RoPE + head layout, then HF's own cache and attention.

    qkv = x @ W_qkv^T (+ b)                       one GEMM (LLaMA/Qwen2 q, k, v weights fused at patch time);
                                                  GGUF: [q | k | v], each GGUFLinear's own op
    q, k, v = rope_qkv(qkv, cos, sin)             one kernel: split, rotate (partial for Pythia), head layout
    k, v = cache.update(k, v)                     HF's cache classes, unchanged
    out = attention_interface(q, k, v, mask)      HF's SDPA / flash / eager, unchanged
    out = out @ W_o^T (+ b)

cos/sin are the ones HF's rotary embedding computed for this forward (they arrive as `position_embeddings`), so
every rope variant HF supports, including dynamic scaling, gives the same angles as unpatched.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers.cache_utils import Cache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..models.spec import ArchSpec
from ..ops import Backend, int4
from ..ops.int4 import Int4Linear
from ..parallel import local_heads, reduce_group, shard
from . import weights

FUSED_QKV = "_patcher_qkv_weight"
FUSED_QKV_BIAS = "_patcher_qkv_bias"


@dataclass
class AttentionPlan:
    ops: Backend
    qkv_weight: torch.Tensor | None  # None when the projections are GPTQ int4 (qkv_int4) or GGUF (qkv_gguf)
    qkv_bias: torch.Tensor | None
    out_weight: torch.Tensor | None
    out_bias: torch.Tensor | None
    num_heads: int
    num_kv_heads: int
    head_dim: int
    interleaved: bool
    eager_attention: Callable  # the modeling file's own eager_attention_forward, HF's fallback interface
    extra_kwargs: dict = field(default_factory=dict)
    qkv_int4: Int4Linear | None = None
    out_int4: Int4Linear | None = None
    qkv_gguf: weights.GGUFProjection | None = None
    out_gguf: weights.GGUFProjection | None = None
    group: object = None  # tensor parallel: the process group summing the output projection's partial products

    @property
    def gguf_input(self) -> weights.GGUFProjection | None:
        """The GGUF projection that takes the attention's input (LayerPlan.rounds)."""
        return self.qkv_gguf


def check_attention(module: nn.Module, spec: ArchSpec, config) -> str | None:
    projections = [getattr(module, name, None) for name in (*spec.qkv, spec.out_proj)]
    reason = weights.projection_reason(projections[:-1], spec.qkv) or weights.projection_reason(
        projections[-1:], (spec.out_proj,)
    )
    if reason:
        return reason
    qkv = projections[:-1]
    if len({p.bias is None for p in qkv}) > 1:
        return "q/k/v projections disagree on having a bias"
    heads, kv_heads, head_dim = spec.num_heads(config), spec.num_kv_heads(config), spec.head_dim(config)
    width = sum(p.out_features for p in qkv)
    if width != (heads + 2 * kv_heads) * head_dim:
        return f"q/k/v width {width} != (heads {heads} + 2 x kv_heads {kv_heads}) x head_dim {head_dim}"
    if spec.qkv_interleaved and heads != kv_heads:
        return "an interleaved query_key_value needs as many kv heads as query heads"
    if heads % kv_heads:
        return f"{heads} query heads are not a multiple of {kv_heads} kv heads"
    rotary = spec.rotary_dim(config)
    if rotary % 2 or not 0 < rotary <= head_dim:
        return f"rotary dim {rotary} must be even and in (0, head_dim {head_dim}]"
    if spec.rotary_style != "half":
        return f"rotary style {spec.rotary_style!r} is not supported (only NeoX half rotation)"
    if not hasattr(module, "scaling") or not hasattr(module, "layer_idx"):
        return "attention module lacks `scaling`/`layer_idx` (unexpected transformers version)"
    return None


def attention_plan(module: nn.Module, spec: ArchSpec, config, ops: Backend) -> AttentionPlan:
    qkv = [getattr(module, name) for name in spec.qkv]
    out = getattr(module, spec.out_proj)
    qkv_int4 = int4.from_modules(qkv) if weights.is_int4(qkv[0]) else None
    out_int4 = int4.from_modules([out]) if weights.is_int4(out) else None
    qkv_gguf = weights.GGUFProjection(qkv) if weights.is_gguf(qkv[0]) else None
    out_gguf = weights.GGUFProjection([out]) if weights.is_gguf(out) else None
    if qkv_int4 is not None or qkv_gguf is not None:
        qkv_weight = qkv_bias = None
    elif len(qkv) == 1:
        qkv_weight, qkv_bias = shard(qkv[0].weight), shard(qkv[0].bias)
    else:
        qkv_weight = weights.fuse(module, FUSED_QKV, [p.weight for p in qkv])
        qkv_bias = None if qkv[0].bias is None else weights.fuse(module, FUSED_QKV_BIAS, [p.bias for p in qkv])
    heads, kv_heads = local_heads(module, spec, config)  # (tensor parallel: this rank's heads)
    return AttentionPlan(
        ops=ops,
        qkv_weight=qkv_weight,
        qkv_bias=qkv_bias,
        out_weight=None if out_int4 or out_gguf else shard(out.weight),
        out_bias=None if out_int4 or out_gguf else shard(out.bias),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=spec.head_dim(config),
        interleaved=spec.qkv_interleaved,
        eager_attention=sys.modules[type(module).__module__].eager_attention_forward,
        extra_kwargs={name: getattr(module, name) for name in spec.attention_kwargs},
        qkv_int4=qkv_int4,
        out_int4=out_int4,
        qkv_gguf=qkv_gguf,
        out_gguf=out_gguf,
        group=reduce_group(out),
    )


def undo_attention_plan(module: nn.Module) -> None:
    weights.unfuse(module, FUSED_QKV)
    weights.unfuse(module, FUSED_QKV_BIAS)


def attention_forward(
    self,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
    attention_mask: torch.Tensor | None = None,
    past_key_values=None,
    layer_past=None,  # GPT-NeoX's name for the cache
    cache=None,  # LLaMA's and Qwen2's name for it since transformers 5.24 (past_key_values before)
    **kwargs,
):
    plan: AttentionPlan = self._patcher
    cache = next((c for c in (cache, past_key_values, layer_past) if c is not None), None)
    if cache is None:  # under a name this code does not know (it was renamed once): a cache must never be dropped
        cache = next((v for v in kwargs.values() if isinstance(v, Cache)), None)
    # (a Q8_1Rounded input: the GGUF QKV's prefill input, rounded by the layer's norm; LayerPlan.rounds)
    x = hidden_states.values if isinstance(hidden_states, weights.Q8_1Rounded) else hidden_states
    bsz, q_len = x.shape[:2]
    qkv = weights.project(plan.ops, hidden_states, plan.qkv_weight, plan.qkv_bias, plan.qkv_int4, gguf=plan.qkv_gguf)
    cos, sin = position_embeddings
    q, k, v = plan.ops.rope_qkv(qkv, cos, sin, plan.num_heads, plan.num_kv_heads, plan.head_dim, plan.interleaved)
    if cache is not None:
        k, v = cache.update(k, v, self.layer_idx)
    interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, plan.eager_attention)
    out, attn_weights = interface(
        self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling, **plan.extra_kwargs, **kwargs
    )
    out = out.reshape(bsz, q_len, -1)
    out = weights.project(plan.ops, out, plan.out_weight, plan.out_bias, plan.out_int4, plan.group, plan.out_gguf)
    return out, attn_weights
