"""The GPTQ int4 linears of a decode step: their roles, K slices, and which hand their sums on unmet.

An int4 GEMV at batch 1 cuts K into slices so that enough blocks stream the weights; the slices' partial sums then
meet. Two forms of the meeting:

- in the op: the last block of each column tile adds the slices' sums from a workspace and runs the epilogue;
- deferred (DecodeOptions.defer_int4 / defer_qkv): the blocks add their sums into a fixed-point (int64)
  accumulator and end. The next op reads the accumulator as its delta in its add + norm prologue (rounding it,
  then adding the producer's bias as delta2, as the producer's epilogue would have), so the slices never wait for
  each other. LLaMA/Qwen2's o_proj and down, GPT-NeoX's output pair, and (defer_qkv) LLaMA/Qwen2's QKV, whose
  accumulator the decode attention finishes (rounding, bias, RoPE, the current token's K/V into the cache).

Each accumulator is zeroed for the next step by the following producer of its kind, once that producer's inputs
are ready, so no extra launch clears it. A kind with a single producer keeps the meeting in the op: that producer
would have to zero its own accumulator.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from ..ops import int4

ROLES = ("qkv", "out", "mlp_in", "mlp_out", "qkv_mlp", "out_pair")
# The roles launched just before (True) or just after (False) the attention: their K slices leave room for its blocks.
NEXT_TO_ATTENTION = {"qkv": True, "qkv_mlp": True, "out": False, "out_pair": False}
# From this many attention blocks (query heads x rows) the decode attention that finishes the QKV sums is held to
# 128 registers a thread, half an SM, as its plain form always is (kernels/attention: kAttnTwoPerSmHeads).
ATTENTION_HALF_SM_BLOCKS = 32


@dataclass
class DeferredOut:
    """The accumulator of one deferred producer in a StepState: acc [B, N] int64; the producer's bias as rows
    [B, N] in the model's dtype (the reader's delta2) or None; and the accumulator this producer zeroes."""

    acc: torch.Tensor
    bias_rows: torch.Tensor | None
    clear: torch.Tensor | None = None


def layer_roles(layer) -> dict:
    """The int4 linears a layer's decode step launches, by role (None where it launches none of that role):
    qkv, out, mlp_in (gate/up), mlp_out (down); in GPT-NeoX's merged step qkv_mlp (QKV beside the MLP's input
    projection) and out_pair (both output projections), in place of the two each replaces."""
    a, m = layer.attention, layer.mlp
    roles = dict.fromkeys(ROLES)
    roles.update(qkv=a.qkv_int4, out=a.out_int4, mlp_in=m.in_int4, mlp_out=m.out_int4)
    if layer.qkv_mlp is not None:
        roles.update(qkv=None, mlp_in=None, qkv_mlp=layer.qkv_mlp)
    if layer.out_pair is not None:
        roles.update(out=None, mlp_out=None, out_pair=layer.out_pair)
    return roles


class Int4Plan:
    """Every int4 linear of the step (id -> (Int4Linear, head_dim where its epilogue applies RoPE, else None)), their
    roles, the deferred producers ((kind, layer) -> Int4Linear) and the K slices each takes at a batch size."""

    def __init__(self, layers: list, parallel: bool, options, device: torch.device, dtype, num_heads: int,
                 head_dim: int):  # fmt: skip
        self.device, self.dtype, self.num_heads = device, dtype, num_heads
        self.defer_qkv = options.defer_qkv
        self.linears = {}
        for layer in layers:
            a, m = layer.attention, layer.mlp
            for lin, head in ((a.qkv_int4, head_dim), (a.out_int4, None), (m.in_int4, None), (m.out_int4, None),
                              (layer.out_pair, None), (layer.qkv_mlp, head_dim)):  # fmt: skip
                if lin is not None:
                    self.linears[id(lin)] = (lin, head)
        self.deferred = self._deferred(layers, parallel) if options.defer_int4 else {}
        for (kind, _), lin in self.deferred.items():
            if kind == "qkv":  # a plain int4 op now (the attention applies RoPE): its K slices for plain tiles
                self.linears[id(lin)] = (lin, None)
        self.roles = {id(lin): role for layer in layers for role, lin in layer_roles(layer).items() if lin is not None}
        present = set(self.roles.values())
        for role in options.int4_splits:
            if role not in present:
                raise ValueError(
                    f"int4_splits: no int4 linear of role {role!r} in this model's decode step (it has: "
                    f"{', '.join(r for r in ROLES if r in present) or 'none'})"
                )
        self.splits_override = dict(options.int4_splits)

    def _deferred(self, layers: list, parallel: bool) -> dict:
        """(kind, layer) -> Int4Linear of every output projection whose output the next op's int4 norm prologue
        reads: LLaMA/Qwen2's o_proj ("attn_out", read by the MLP's op) and down ("mlp_out", by the next layer's QKV
        op), GPT-NeoX's out pair ("out", by the next layer's int4_qkv_mlp_in), the last layer's by the final norm;
        and with defer_qkv LLaMA/Qwen2's QKV ("qkv", read by decode_attention_qkv_acc)."""
        found = {}
        for i, layer in enumerate(layers):
            a, m = layer.attention, layer.mlp
            following = layers[i + 1] if i + 1 < len(layers) else None
            if parallel:
                if layer.out_pair is not None and (following is None or following.qkv_mlp is not None):
                    found[("out", i)] = layer.out_pair
                continue
            if self.defer_qkv and a.qkv_int4 is not None:
                found[("qkv", i)] = a.qkv_int4
            if a.out_int4 is not None and m.in_int4 is not None:
                found[("attn_out", i)] = a.out_int4
            if m.out_int4 is not None and (following is None or following.attention.qkv_int4 is not None):
                found[("mlp_out", i)] = m.out_int4
        kinds = Counter(kind for kind, _ in found)
        return {key: lin for key, lin in found.items() if kinds[key[0]] > 1}

    def deferred_outputs(self, batch: int) -> dict:
        """(kind, layer) -> DeferredOut for a StepState: each producer zeroes the accumulator of the producer of its
        kind before it (cyclically: the first one the last one's, which the step before filled)."""
        out = {}
        for key, lin in self.deferred.items():
            n = sum(lin.widths)
            rows = None
            if any(b is not None for b in lin.bias):  # the reader adds round(round(acc) + bias), as the epilogue
                bias = [torch.zeros(w, device=self.device) if b is None else b for b, w in zip(lin.bias, lin.widths)]
                rows = torch.cat([b.to(self.dtype) for b in bias]).expand(batch, n).contiguous()
            out[key] = DeferredOut(torch.zeros(batch, n, dtype=torch.int64, device=self.device), rows)
        for kind in {k for k, _ in out}:
            keys = sorted(key for key in out if key[0] == kind)
            for prev, key in zip(keys[-1:] + keys[:-1], keys):
                out[key].clear = out[prev].acc
        return out

    def workspace_numel(self, batch: int, splits: dict) -> int:
        """The int32 workspace the int4 ops of one stream share (each leaves its counters zero)."""
        sizes = [int4.workspace_numel(batch, lin, splits[key], head) for key, (lin, head) in self.linears.items()]
        return max(sizes, default=0)

    def splits(self, batch: int, linear, head_dim) -> int:
        """K slices for `linear` at this batch size: DecodeOptions.int4_splits for its role, else the rule."""
        role = self.roles.get(id(linear))
        if role in self.splits_override:
            splits = self.splits_override[role]
            low, high = int4.splits_limit(batch, linear, self.dtype, head_dim)
            if not low <= splits <= high:
                raise ValueError(
                    f"int4_splits[{role!r}] = {splits}: the int4 kernels take {low} to {high} K slices for this "
                    f"linear at batch {batch} (K = {linear.in_features}; fewer make a slice too large for the "
                    "kernel's shared-memory stage, more leave slices with no rows)"
                )
            return splits
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count if self.device.type == "cuda" else 1
        return int4.splits_for(batch, linear, sms, head_dim, self.dtype, self.attention_beside(batch, linear))

    def attention_beside(self, batch: int, linear) -> int4.Beside | None:
        """The decode attention's blocks at a short context (one a query head and row) as the split rule sees them
        from `linear`, or None where it is not the linear just before or just after the attention: each takes half
        an SM, but below ATTENTION_HALF_SM_BLOCKS the form that finishes the QKV sums takes a whole one."""
        before = NEXT_TO_ATTENTION.get(self.roles.get(id(linear)))
        if before is None:
            return None
        blocks = self.num_heads * batch
        whole = any(kind == "qkv" for kind, _ in self.deferred) and blocks < ATTENTION_HALF_SM_BLOCKS
        return int4.Beside(blocks, 512 if whole else int4.ATTENTION_THREADS, before)
