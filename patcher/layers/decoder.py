"""The restructured decoder layers: residual adds fused into the next norm, across layer boundaries.

Sequential (LLaMA, Qwen2, GPT-NeoX with use_parallel_residual=False):

    h, x = add_norm(x, delta)          # the previous layer's MLP output is added here, not in that layer
    a    = attention(h)
    h, x = add_norm(x, a)
    return (x, mlp(h))                 # handed on unsummed; the next layer (or the final norm) adds it

Parallel (GPT-NeoX / Pythia):  HF computes x + attn(ln1(x)) + mlp(ln2(x)).

    h1, h2, x = add_dual_norm(x, a, m)  # sum the previous layer's three terms, both LayerNorms in one pass
    return (x, attention(h1), mlp(h2))
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from ..ops.int4 import Int4Linear
from .guard import user_hooks
from .stream import ResidualStream, as_stream, materialize, recording_hidden_states
from .weights import Q8_1Rounded


@dataclass
class LayerPlan:
    attention: nn.Module
    mlp: nn.Module
    next_patched: bool  # does the next module (layer or final norm) accept a ResidualStream?
    next_module: nn.Module | None = None
    norm: Callable | None = None  # sequential: input norm without an add (first layer)
    add_norm: Callable | None = None  # sequential: input add+norm
    post_add_norm: Callable | None = None  # sequential: add+norm before the MLP
    dual_norm: Callable | None = None  # parallel: both norms, no add (first layer)
    add_dual_norm: Callable | None = None  # parallel: add + both norms
    out_pair: Int4Linear | None = None  # parallel, GPTQ int4: both output projections stacked along k (out_pair.py)
    norm_q8_1: Callable | None = None  # sequential RMSNorm: the input norm, its output rounded through Q8_1
    post_norm_q8_1: Callable | None = None  # the same for the norm before the MLP

    def rounds(self, module: nn.Module, norm_q8_1: Callable | None, x) -> bool:
        """Whether the norm in front of `module` (the attention or the MLP) rounds its output through Q8_1 for x's
        rows: the module's first projection is GGUF and would round it itself (W4A8 prefill: GGUFProjection.
        rounds_input), and no hook of the caller's on the module could see the rounded tensor."""
        projection = getattr(getattr(module, "_patcher", None), "gguf_input", None)
        return (
            norm_q8_1 is not None and projection is not None and projection.rounds_input(x) and not user_hooks(module)
        )

    def emit(self, layer: nn.Module, residual, delta, delta2=None):
        """What the layer hands on: the stream where the next module takes it and nothing outside looks at it;
        the summed tensor where HF records hidden states, or a hook on this layer or the next module would see it."""
        if self.next_patched and not recording_hidden_states():
            if not (user_hooks(layer) or user_hooks(self.next_module)):
                return ResidualStream(residual, delta, delta2)
            layer._patcher_guard.note(
                f"{layer._patcher_guard.name}: a hook on it or on the module after it: it hands on the summed "
                "tensor, so that residual add is not fused into the next norm"
            )
        return materialize(residual, delta, delta2)


def sequential_layer_forward(
    self, hidden_states, attention_mask=None, position_ids=None, use_cache=False, position_embeddings=None, **kwargs
):
    plan: LayerPlan = self._patcher
    residual, delta, delta2 = as_stream(hidden_states)
    if plan.rounds(plan.attention, plan.norm_q8_1, residual):
        # a GGUF W4A8 QKV's prefill: the norm rounds its input through Q8_1 (delta2: GPT-NeoX only, no RMSNorm)
        h, summed = plan.norm_q8_1(residual, delta)
        residual, h = (residual if delta is None else summed), Q8_1Rounded(h)
    elif delta is None:
        h = plan.norm(residual)
    else:
        h, residual = plan.add_norm(residual, delta, delta2)
    attn, _ = plan.attention(
        hidden_states=h,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=use_cache,
        position_embeddings=position_embeddings,
        **kwargs,
    )
    if plan.rounds(plan.mlp, plan.post_norm_q8_1, residual):
        h, residual = plan.post_norm_q8_1(residual, attn)
        return plan.emit(self, residual, plan.mlp(Q8_1Rounded(h)))
    h, residual = plan.post_add_norm(residual, attn, None)
    return plan.emit(self, residual, plan.mlp(h))


def parallel_layer_forward(
    self, hidden_states, attention_mask=None, position_ids=None, use_cache=False, position_embeddings=None, **kwargs
):
    plan: LayerPlan = self._patcher
    residual, delta, delta2 = as_stream(hidden_states)
    if delta is None:
        h_attn, h_mlp = plan.dual_norm(residual)
    else:
        h_attn, h_mlp, residual = plan.add_dual_norm(residual, delta, delta2)
    attn, _ = plan.attention(
        h_attn,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=use_cache,
        position_embeddings=position_embeddings,
        **kwargs,
    )
    return plan.emit(self, residual, attn, plan.mlp(h_mlp))
