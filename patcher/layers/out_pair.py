"""GPT-NeoX's two output projections as one int4 linear in the decode step.

With a parallel residual, a layer adds attn @ W_dense + h @ W_out (plus both biases) to the residual, where attn is
the attention's output and h the MLP's hidden activation. For GPTQ int4 layers the decode step computes that sum as
one GEMV over [attn | h] with the two weights stacked along k:

    delta = [attn | h] @ [W_dense; W_out] + (b_dense + b_out)       one int4_gemv_cat instead of two int4 GEMVs

At batch 1 an int4 GEMV of a few MB is mostly fixed cost (the K slices meeting, the tail), so one launch of
3.4 + 13.1 MB costs about as much as the larger of the two alone (Pythia-2.8B). The sum is rounded once instead of
twice: within the fp16 rounding of the two products, closer to the exact sum than HF's order.

The checkpoint tensors are concatenated along k (the qweight rows, and the group rows of qzeros and scales) into
buffers of the layer, and the modules' own tensors become views of their slices (layers/weights.py), so the weights
take no more memory and `state_dict` is unchanged; only the stack's g_idx and summed bias are new (Pythia-2.8B: 56 KB
a layer). Groups must not straddle the seam: both projections need the same
group size, no act-order, and the attention width a multiple of the group size.
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops.int4 import Int4Linear
from . import weights

FUSED = {"qweight": "_patcher_out_qweight", "qzeros": "_patcher_out_qzeros", "scales": "_patcher_out_scales"}
G_IDX = "_patcher_out_g_idx"
BIAS = "_patcher_out_bias"


def out_pair_reason(dense: Int4Linear | None, out: Int4Linear | None) -> str | None:
    """Why these two int4 linears (attention output, MLP output) can't run as one over [attn | h], or None."""
    if dense is None or out is None:
        return "the output projections are not both GPTQ int4"
    if dense.act_order or out.act_order:
        return "act-order GPTQ output projections"
    if (dense.group_size, dense.zero_offset) != (out.group_size, out.zero_offset):
        return (
            f"the output projections differ in group size or format ({dense.group_size} and {out.group_size}; "
            "a group of -1 is a whole in_features, which differ)"
        )
    if dense.in_features % dense.group_size:
        return f"the attention width {dense.in_features} is not a multiple of the group size {dense.group_size}"
    if dense.widths != out.widths or len(dense.widths) != 1:
        return "the output projections differ in out_features"
    return None


def fuse_out_pair(layer: nn.Module, dense: nn.Module, out: nn.Module, group_size: int, zero_offset: int) -> Int4Linear:
    """Stacks the GPTQLinear modules `dense` and `out` along k into buffers of `layer` (their tensors become views)
    and returns the Int4Linear of the stack. out_pair_reason must have accepted them."""
    stacked = {}
    for field, name in FUSED.items():
        stacked[field] = weights.fuse(layer, name, [getattr(dense, field), getattr(out, field)])
    k = dense.in_features + out.in_features
    g_idx = torch.arange(k, device=stacked["qweight"].device, dtype=torch.int32) // group_size
    layer.register_buffer(G_IDX, g_idx, persistent=False)
    biases = [b for b in (dense.bias, out.bias) if b is not None]
    bias = None
    if biases:  # added once, in float16 as the checkpoints store them: round(b_dense + b_out)
        bias = torch.stack([b.float() for b in biases]).sum(0).to(biases[0].dtype)
        layer.register_buffer(BIAS, bias, persistent=False)
    return Int4Linear(
        qweight=[stacked["qweight"]],
        qzeros=[stacked["qzeros"]],
        scales=[stacked["scales"]],
        g_idx=[g_idx],
        bias=[bias],
        group_size=group_size,
        act_order=False,
        zero_offset=zero_offset,
    )


def undo_out_pair(layer: nn.Module) -> None:
    """Gives the output projections their own tensors again and drops the layer's buffers."""
    for name in FUSED.values():
        weights.unfuse(layer, name)
    for name in (G_IDX, BIAS):
        layer._buffers.pop(name, None)
