"""Reading a tensor-parallel model's shards: which layouts the fused forwards serve, and the row-wise all-reduce.

transformers (`from_pretrained(path, tp_plan="auto")`) replaces the projections' weights with DTensors on a 1-D
device mesh and wraps each projection's forward, as the config's `base_model_tp_plan` says:

- "colwise" (q/k/v, gate/up; GPT-NeoX query_key_value, dense_h_to_4h): weight and bias Shard(0). Each rank holds a
  contiguous block of output rows and hands on its block of the output, not gathered.
- "rowwise" (o_proj, down_proj; GPT-NeoX dense, dense_4h_to_h): weight Shard(1), bias replicated. Each rank
  multiplies its block of input columns, the partial outputs are summed by all_reduce, then the bias is added once.

Norms, the residual stream and the outputs of the embedding and lm_head are plain tensors, the same on every rank.

A contiguous block of q/k/v rows is a block of whole heads when the head counts divide by the mesh size; GPT-NeoX's
query_key_value rows are grouped head by head ([q k v] of head 0, then head 1, ...), so there too. A rank's query
heads then use its own kv heads with the model's group size, and every head sees the same rotary angles. So the
fused forwards run unchanged on each rank's shards with local head counts; only the row-wise outputs are summed,
before the residual add that follows, in the order HF's row-wise forward uses (sum, then bias).
"""

from __future__ import annotations

import re

import torch
from torch import nn

try:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # a torch build without distributed support: no parameter can be a DTensor
    dist = DTensor = Replicate = Shard = None

COLWISE, ROWWISE = "colwise", "rowwise"
TP_REASON = "tensor-parallel (DTensor) weights"


def sharded(t) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def shard(t: torch.Tensor | None) -> torch.Tensor | None:
    """The tensor holding this rank's values: a DTensor's local tensor (the object the DTensor reads, so re-pointing
    its `.data` re-points the DTensor's values), or `t` itself for a plain tensor (and None for None)."""
    return t._local_tensor if sharded(t) else t


def has_sharded(module: nn.Module) -> bool:
    return any(sharded(t) for t in (*module.parameters(), *module.buffers()))


def tp_styles(model: nn.Module) -> dict[int, str]:
    """id(module) -> the style transformers' tensor-parallel plan gave it ("colwise", "rowwise", ...), for every
    module the model's resolved plan (`model._tp_plan`, layer numbers written as `*`) names. Empty where no weight
    is sharded: transformers resolves the config's plan for every model, also one loaded without tensor parallelism."""
    plan = getattr(model, "_tp_plan", None) or {}
    if not plan or not has_sharded(model):
        return {}
    styles = {}
    for name, module in model.named_modules():
        style = plan.get(re.sub(r"\.\d+(\.|$)", lambda m: ".*" + m.group(1), name))
        if isinstance(style, str):
            styles[id(module)] = style
    return styles


def _projection_reason(linear, name: str, style: str | None, expected: str, mesh) -> str | None:
    if not isinstance(linear, nn.Linear):
        return f"{name} is {type(linear).__name__} (a sharded projection must be nn.Linear)"
    weight, bias = linear.weight, linear.bias
    if not sharded(weight):
        return f"{name} is not sharded while others are"
    if style != expected:
        return f"{name} is sharded {style!r}, expected {expected!r}"
    if weight.device_mesh is not mesh and weight.device_mesh != mesh:
        return f"{name} is on another device mesh"
    dim = 0 if expected == COLWISE else 1
    if tuple(weight.placements) != (Shard(dim),):
        return f"{name}.weight has placements {tuple(weight.placements)}, expected (Shard(dim={dim}),)"
    if shard(weight).shape[dim] * mesh.size() != weight.shape[dim]:
        return f"{name}.weight is split unevenly over {mesh.size()} ranks"
    if bias is not None:
        want = (Shard(0),) if expected == COLWISE else (Replicate(),)
        if not sharded(bias) or tuple(bias.placements) != want:
            return f"{name}.bias is not laid out as {want}"
    return None


def _modules_reason(parent: nn.Module, layout: dict[str, str], styles: dict[int, str]) -> str | None:
    """Why the named projections of `parent` are not sharded as `layout` (name -> expected style) says, or None."""
    linears = {name: getattr(parent, name, None) for name in layout}
    weight = next((getattr(m, "weight", None) for m in linears.values() if sharded(getattr(m, "weight", None))), None)
    if weight is None:
        return "sharded weights outside its projections"
    mesh = weight.device_mesh
    if mesh.ndim != 1:
        return f"a {mesh.ndim}-D device mesh (only a 1-D tensor-parallel mesh is supported)"
    for name, expected in layout.items():
        reason = _projection_reason(linears[name], name, styles.get(id(linears[name])), expected, mesh)
        if reason:
            return reason
    return None


def _attention_reason(module: nn.Module, spec, config, styles: dict[int, str]) -> str | None:
    layout = {name: COLWISE for name in spec.qkv} | {spec.out_proj: ROWWISE}
    reason = _modules_reason(module, layout, styles)
    if reason:
        return reason
    size = getattr(module, spec.out_proj).weight.device_mesh.size()
    heads, kv_heads = spec.num_heads(config), spec.num_kv_heads(config)
    if heads % size or kv_heads % size:
        return f"{heads} query and {kv_heads} kv heads do not divide over {size} ranks"
    return None


def _mlp_reason(module: nn.Module, spec, styles: dict[int, str]) -> str | None:
    return _modules_reason(module, {name: COLWISE for name in spec.mlp_in} | {spec.mlp_out: ROWWISE}, styles)


def sharding_reason(kind: str, module: nn.Module, spec, config, styles: dict[int, str]) -> str | None:
    """Why the fused forward can't serve this module's tensor-parallel layout, or None (also for a module with no
    sharded weights). `kind` is "layer", "attention", "mlp" or "norm"."""
    if not has_sharded(module):
        return None
    if kind == "norm":
        reason = "sharded norm weights"
    elif kind == "attention":
        reason = _attention_reason(module, spec, config, styles)
    elif kind == "mlp":
        reason = _mlp_reason(module, spec, styles)
    else:  # a layer: each of its attention and MLP may be sharded or not (a plan may shard only some)
        attention, mlp = getattr(module, spec.attention), getattr(module, spec.mlp)
        others = [c for c in module.children() if c is not attention and c is not mlp]
        if any(has_sharded(c) for c in others) or any(sharded(t) for t in module.parameters(recurse=False)):
            return f"{TP_REASON}: sharded norm weights"
        return sharding_reason("attention", attention, spec, config, styles) or sharding_reason(
            "mlp", mlp, spec, config, styles
        )
    return f"{TP_REASON}: {reason}" if reason else None


def tp_detail(module: nn.Module, out_name: str) -> str:
    """The report's note for a module whose output projection is row-wise sharded, or ""."""
    weight = getattr(getattr(module, out_name, None), "weight", None)
    if not sharded(weight):
        return ""
    return f"; tensor parallel: this rank's shards, {out_name} summed over {weight.device_mesh.size()} ranks"


def local_heads(module: nn.Module, spec, config) -> tuple[int, int]:
    """The query and kv heads of this rank's shards (the whole model's counts when nothing is sharded)."""
    projections = [getattr(module, name) for name in spec.qkv]
    if not sharded(getattr(projections[0], "weight", None)):  # (a GPTQ projection has no weight)
        return spec.num_heads(config), spec.num_kv_heads(config)
    head_dim = spec.head_dim(config)
    if len(projections) == 1:  # GPT-NeoX: [q k v] per head, as many kv heads as query heads
        heads = shard(projections[0].weight).shape[0] // (3 * head_dim)
        return heads, heads
    q, k = (shard(p.weight).shape[0] // head_dim for p in projections[:2])
    return q, k


def reduce_group(linear: nn.Module):
    """The process group whose ranks' partial outputs a row-wise projection sums, or None when not sharded."""
    weight = getattr(linear, "weight", None)
    return weight.device_mesh.get_group() if sharded(weight) else None


def rowwise_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, group, matmul=None, reduce=None
) -> torch.Tensor:
    """A row-wise projection on local shards: x @ W_local^T summed over the group's ranks, then the (replicated)
    bias, in the order transformers' row-wise forward computes it, so the sum rounds the same on every rank.
    `matmul(x, weight)`: the local product (default F.linear; the decode step passes its GEMV); `reduce(out)`: the
    sum over the ranks (default dist.all_reduce; the decode step on GPUs passes its RankSum)."""
    out = torch.nn.functional.linear(x, weight) if matmul is None else matmul(x, weight)
    if reduce is None:
        dist.all_reduce(out, group=group)
    else:
        out = reduce(out)
    return out if bias is None else out + bias
