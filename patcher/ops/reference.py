"""Pure-torch references for every fused op.

Each function computes exactly what the HF modules compute, with the same cast points, so that on the CPU the
patched model is numerically the unpatched one and on the GPU the kernels have something exact to be tested
against. The rules they mirror:

- Residual adds happen in the working dtype (`residual + hidden_states` in HF), so a sum is rounded to the dtype
  before it is normalized. GPT-NeoX's parallel residual is `mlp_output + attn_output + hidden_states`, i.e.
  `(mlp + attn) + x`, two roundings in that order.
- LLaMA/Qwen2 RMSNorm normalizes in fp32, casts back to the dtype, then multiplies by the weight in the dtype.
- GPT-NeoX LayerNorm is `nn.LayerNorm` in the working dtype (torch computes it in fp32 internally).
- RoPE uses cos/sin already cast to the dtype, and `q * cos + rotate_half(q) * sin` with each product rounded.
- SwiGLU is `silu(gate) * up`, with `silu(gate)` rounded first. The bias+GELU op adds the bias in the dtype,
  then applies GELU.

These functions also serve as the CPU kernels of the `patcher::` torch ops (see `library.py`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _residual_sum(x: torch.Tensor, delta: torch.Tensor, delta2: torch.Tensor | None) -> torch.Tensor:
    # HF: `residual + hidden_states` (one sub-layer) or `mlp_output + attn_output + hidden_states` (parallel).
    if delta2 is None:
        return x + delta
    return (delta2 + delta) + x


def _rms(s: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = s.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(s.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _rms(x, weight, eps)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
    """Returns (rms_norm(x + delta), x + delta)."""
    s = _residual_sum(x, delta, None)
    return _rms(s, weight, eps), s


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def dual_layer_norm(x, weight, bias, weight2, bias2, eps: float):
    """Two LayerNorms of the same input (GPT-NeoX parallel residual: input and post-attention norms)."""
    return layer_norm(x, weight, bias, eps), layer_norm(x, weight2, bias2, eps)


def add_layer_norm(x, delta, delta2, weight, bias, eps: float):
    """Returns (layer_norm(s), s) with s the residual sum of x, delta and the optional delta2."""
    s = _residual_sum(x, delta, delta2)
    return layer_norm(s, weight, bias, eps), s


def add_dual_layer_norm(x, delta, delta2, weight, bias, weight2, bias2, eps: float):
    """Returns (layer_norm(s), layer_norm2(s), s): the whole GPT-NeoX parallel-residual junction."""
    s = _residual_sum(x, delta, delta2)
    return layer_norm(s, weight, bias, eps), layer_norm(s, weight2, bias2, eps), s


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D]; cos/sin [B or 1, T, R] with R <= D. Rotates the first R dims (NeoX half rotation)."""
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat([(x_rot * cos) + (rotate_half(x_rot) * sin), x_pass], dim=-1)


def split_qkv(qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int, head_dim: int, interleaved: bool):
    """Views q [B, Hq, T, D], k/v [B, Hkv, T, D] of a fused projection output qkv [B, T, W].

    interleaved=False: W = [q heads | k heads | v heads] (LLaMA/Qwen2 q_proj, k_proj, v_proj concatenated).
    interleaved=True:  W = [head][q | k | v] (GPT-NeoX `query_key_value`, which needs Hq == Hkv).
    """
    B, T, _ = qkv.shape
    if interleaved:
        per_head = qkv.view(B, T, num_q_heads, 3 * head_dim).transpose(1, 2)
        return per_head.chunk(3, dim=-1)
    q, k, v = qkv.split([num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    return (
        q.view(B, T, num_q_heads, head_dim).transpose(1, 2),
        k.view(B, T, num_kv_heads, head_dim).transpose(1, 2),
        v.view(B, T, num_kv_heads, head_dim).transpose(1, 2),
    )


def rope_qkv(qkv, cos, sin, num_q_heads: int, num_kv_heads: int, head_dim: int, interleaved: bool):
    """Fused QKV output -> (q, k, v) in head layout [B, H, T, D], RoPE applied to q and k, all contiguous."""
    q, k, v = split_qkv(qkv, num_q_heads, num_kv_heads, head_dim, interleaved)
    return apply_rope(q, cos, sin).contiguous(), apply_rope(k, cos, sin).contiguous(), v.contiguous()


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] = [gate | up] -> silu(gate) * up, [..., I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def bias_gelu(x: torch.Tensor, bias: torch.Tensor | None, tanh: bool) -> torch.Tensor:
    """gelu(x + bias): the activation of GPT-NeoX's MLP with the bias of dense_h_to_4h folded in."""
    if bias is not None:
        x = x + bias
    return F.gelu(x, approximate="tanh" if tanh else "none")


# ---- decode path -------------------------------------------------------------------------------------------------


def _norm_prologue(
    x, delta, delta2, norm_weight, norm_bias, norm_weight2, norm_bias2, eps: float, rms: bool, fixed_delta=False
):
    """(h, sum, h2): the input of the projection and the extra outputs of the fused norm (empty when absent).
    `fixed_delta` (the int4 ops): delta may be an int4_gemv_acc accumulator (int64), rounded to x's dtype first."""
    empty = x.new_empty(0)
    if norm_weight is None:
        return x, empty, empty
    if fixed_delta and delta is not None and delta.dtype == torch.int64:
        delta = from_fixed(delta, x.dtype)
    s = x if delta is None else _residual_sum(x, delta, delta2)
    h = _rms(s, norm_weight, eps) if rms else layer_norm(s, norm_weight, norm_bias, eps)
    h2 = empty if norm_weight2 is None else layer_norm(s, norm_weight2, norm_bias2, eps)
    return h, (empty if delta is None else s), h2


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str) -> torch.Tensor:
    """F.linear for the few rows of a decode step, with the MLP activation fused:
    "none", "gelu", "gelu_tanh", or "silu_mul" (weight = [gate; up], output silu(gate) * up)."""
    y = F.linear(x, weight, bias)
    if activation == "silu_mul":
        return silu_and_mul(y)
    if activation == "none":
        return y
    return F.gelu(y, approximate="tanh" if activation == "gelu_tanh" else "none")


def rope_qkv_cache(
    qkv, cos, sin, slot, pad, k_cache, v_cache, num_q_heads: int, num_kv_heads: int, head_dim: int, interleaved: bool
) -> torch.Tensor:
    """One decode token per row: q [B, Hq, D] with RoPE, and K/V written into k_cache/v_cache[:, :, slot].

    cos/sin are tables [positions, R]; row b sits at position slot - pad[b] (pad: its leading padding tokens).
    """
    positions = (slot - pad).clamp(0, cos.shape[0] - 1)
    q, k, v = rope_qkv(
        qkv.unsqueeze(1),
        cos[positions].unsqueeze(1),
        sin[positions].unsqueeze(1),
        num_q_heads,
        num_kv_heads,
        head_dim,
        interleaved,
    )
    k_cache.index_copy_(2, slot, k)
    v_cache.index_copy_(2, slot, v)
    return q[:, :, 0].contiguous()


def norm_gemv(
    x, delta, delta2, norm_weight, norm_bias, norm_weight2, norm_bias2, eps: float, rms: bool,
    weight, bias, activation: str,
):  # fmt: skip
    """gemv behind the decode step's fused residual add + norm (norm_weight None: none, then h = x).

    Returns (out, sum, h2): out = gemv(h); h = norm(sum) with sum = x + delta (+ delta2), or norm(x) without delta;
    h2 the second LayerNorm of sum (GPT-NeoX's MLP input). sum/h2 are empty when not asked for.
    """
    h, s, h2 = _norm_prologue(x, delta, delta2, norm_weight, norm_bias, norm_weight2, norm_bias2, eps, rms)
    return gemv(h, weight, bias, activation), s, h2


def norm_gemv_rope_cache(
    x, delta, delta2, norm_weight, norm_bias, norm_weight2, norm_bias2, eps: float, rms: bool,
    weight, bias, cos, sin, slot, pad, k_cache, v_cache, num_q_heads: int, num_kv_heads: int, head_dim: int,
    interleaved: bool,
):  # fmt: skip
    """The dense decode-step attention prologue in one op: [add +] norm -> QKV projection F.linear(h, W, b) ->
    rope_qkv_cache. Returns (q, sum, h2) as norm_gemv does, q [B, Hq, D], K/V written into the caches at `slot`."""
    h, s, h2 = _norm_prologue(x, delta, delta2, norm_weight, norm_bias, norm_weight2, norm_bias2, eps, rms)
    qkv = F.linear(h, weight, bias)
    q = rope_qkv_cache(qkv, cos, sin, slot, pad, k_cache, v_cache, num_q_heads, num_kv_heads, head_dim, interleaved)
    return q, s, h2


def decode_attention(q, k_cache, v_cache, slot, pad, scale: float, splits: int, workspace) -> torch.Tensor:
    """Softmax attention of q [B, Hq, D] over keys pad[b] .. slot of the static cache; returns [B, Hq * D].

    fp32 scores, softmax and weighted sum (as SDPA computes them), rounded to the dtype once.
    `splits` and `workspace` only shape the CUDA kernel's work; the result does not depend on them.
    """
    B, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    length = int(slot.max().item()) + 1
    acc = torch.promote_types(q.dtype, torch.float32)  # fp32 math for fp16/bf16, float64 stays float64
    k = k_cache[:, :, :length].to(acc).repeat_interleave(Hq // Hkv, dim=1)
    v = v_cache[:, :, :length].to(acc).repeat_interleave(Hq // Hkv, dim=1)
    scores = torch.einsum("bhd,bhtd->bht", q.to(acc), k) * scale
    masked = torch.arange(length, device=q.device)[None, :] < pad[:, None]
    scores = scores.masked_fill(masked[:, None, :], float("-inf"))
    out = torch.einsum("bht,bhtd->bhd", torch.softmax(scores, dim=-1), v)
    return out.to(q.dtype).reshape(B, Hq * D)


def decode_attention_qkv_acc(
    acc, bias_rows, cos, sin, slot, pad, k_cache, v_cache, num_q_heads: int, interleaved: bool, scale: float,
    splits: int, workspace,
) -> torch.Tensor:  # fmt: skip
    """decode_attention with q and the current token's K/V from the QKV projection's fixed-point accumulator
    (int4_norm_gemv_acc): qkv = round(round(acc) + bias_rows) in the caches' dtype (as the projection's epilogue
    rounds it; bias_rows may be None), then rope_qkv_cache (K/V into the caches at `slot`) and the attention."""
    qkv = from_fixed(acc, k_cache.dtype)
    if bias_rows is not None:
        qkv = qkv + bias_rows
    _, num_kv_heads, _, head_dim = k_cache.shape
    q = rope_qkv_cache(qkv, cos, sin, slot, pad, k_cache, v_cache, num_q_heads, num_kv_heads, head_dim, interleaved)
    return decode_attention(q, k_cache, v_cache, slot, pad, scale, splits, workspace)


def decode_attention_workspace(
    batch: int, num_q_heads: int, num_kv_heads: int, head_dim: int, splits: int, device
) -> torch.Tensor:
    """The zeroed scratch decode_attention needs: per-(row, query head) counters (the CUDA kernel uses one per group
    of heads it gives a block), then the split partials."""
    counters = (batch * num_q_heads + 63) // 64 * 64
    return torch.zeros(counters + batch * num_q_heads * splits * (head_dim + 2), dtype=torch.int32, device=device)


def next_token(scores, tokens, slot, finished, eos, pad_token, embed_weight, x, workspace) -> None:
    """The decode step's last op, in place: each row's next token (the argmax of its scores [B, V], or pad_token
    once the row has finished), finished |= token in eos, tokens[:, slot + 1] = token, x = embed_weight[token] (when
    embed_weight is given: the next step's input), slot += 1. `workspace` (next_token_workspace) is the CUDA
    kernel's scratch."""
    token = torch.where(finished, pad_token, scores.argmax(dim=-1))
    finished |= (token[:, None] == eos[None, :]).any(-1)
    tokens.index_copy_(1, slot + 1, token[:, None])
    if embed_weight is not None:
        x.copy_(embed_weight.index_select(0, token))
    slot += 1


NEXT_TOKEN_MAX_PARTS = 64  # kNextTokenMaxParts (kernels/launchers.h): blocks per row of scores, at most


def next_token_workspace(batch: int, device) -> torch.Tensor:
    """The zeroed scratch next_token needs (each launch leaves it zero): a ticket, then each block's partial result."""
    return torch.zeros(1 + 2 * batch * NEXT_TOKEN_MAX_PARTS, dtype=torch.int32, device=device)


# ---- GPTQ int4 ---------------------------------------------------------------------------------------------------
# A GPTQ linear arrives as parallel lists, one entry per segment (q, k, v or gate, up), read side by side. Each
# segment computes what GPTQLinear.forward computes: x @ dequantize().to(x.dtype), then + bias.to(x.dtype).


def int4_weight(
    qweight, qzeros, scales, g_idx, group_size: int, act_order: bool, zero_offset: int, dtype=None
) -> torch.Tensor:
    """W [K, N]: scales[g] * (q - zero[g]), g = g_idx[k] (act-order) or k // group_size. In the scales' dtype (fp16:
    each weight rounded once, as HF's GPTQ linears form it), or in `dtype` (float64: the exact weights)."""
    from ..gptq import format as fmt  # (patcher.gptq imports the patching module, which imports this one)

    K = qweight.shape[0] * fmt.PACK
    g = g_idx.long() if act_order else torch.arange(K, device=qweight.device) // group_size
    scales = scales if dtype is None else scales.to(dtype)
    return fmt.dequantize(qweight, qzeros, scales, g, version=2 if zero_offset == 0 else 1)


def int4_linear(x, qweight, qzeros, scales, g_idx, bias, group_size: int, act_order: bool, zero_offset: int):
    """x @ W (+ bias) per segment, side by side. A float64 x (the tests' precise runs) takes the exact weights rather
    than their fp16 rounding: the precise product of what the checkpoint means. The tensor-core decode kernel,
    which multiplies x by the exact q - zero and applies the scales to the fp32 sums (kernels/int4_mma.cuh), is
    closer to it than the fp16 weights are; the other int4 kernels round each weight as HF does."""
    exact = torch.float64 if x.dtype == torch.float64 else None
    outs = []
    for qw, qz, sc, gi, b in zip(qweight, qzeros, scales, g_idx, bias):
        out = x @ int4_weight(qw, qz, sc, gi, group_size, act_order, zero_offset, exact).to(x.dtype)
        outs.append(out + b.to(x.dtype) if b is not None else out)
    return torch.cat(outs, dim=-1)


def int4_gemv(
    x, delta, delta2, norm_weight, norm_bias, norm_weight2, norm_bias2, eps: float, rms: bool,
    qweight, qzeros, scales, g_idx, bias, group_size: int, act_order: bool, zero_offset: int,
    activation: str, splits: int, workspace,
):  # fmt: skip
    """A decode-step int4 linear (1 to 8 rows), optionally behind the fused residual add + norm of the stack.

    Returns (out, sum, h2): out = act(int4_linear(h)); h = x, or norm(sum) with sum = x + delta (+ delta2); h2 the
    second LayerNorm of sum (GPT-NeoX's MLP input). sum/h2 are empty when not asked for. `splits` and `workspace`
    only shape the CUDA kernel's work.
    """
    h, s, h2 = _norm_prologue(
        x, delta, delta2, norm_weight, norm_bias, norm_weight2, norm_bias2, eps, rms, fixed_delta=True
    )
    y = int4_linear(h, qweight, qzeros, scales, g_idx, bias, group_size, act_order, zero_offset)
    if activation == "silu_mul":
        y = silu_and_mul(y)
    elif activation != "none":
        y = F.gelu(y, approximate="tanh" if activation == "gelu_tanh" else "none")
    return y, s, h2


def int4_qkv_mlp_in(
    x, delta, delta2, norm_weight, norm_bias, norm_weight2, norm_bias2, eps: float, rms: bool,
    qweight, qzeros, scales, g_idx, bias, group_size: int, act_order: bool, zero_offset: int,
    cos, sin, slot, pad, k_cache, v_cache, num_q_heads: int, num_kv_heads: int, head_dim: int, interleaved: bool,
    qkv_segments: int, activation: str, splits: int, workspace, x2=None,
):  # fmt: skip
    """GPT-NeoX's parallel residual in one decode-step op: [add +] both LayerNorms, then the int4 QKV projection of
    the first (segments [0, qkv_segments)) with rope_qkv_cache, and the MLP's int4 input projection of the second
    (the other segments) with its activation. Returns (q [B, Hq, D], hidden [B, MLP width], sum). Or, with x2 and
    no norm prologue, x and x2 are the two LayerNorms' outputs (int4_norm_prologue's h and h2); sum is empty."""
    if x2 is not None:
        if norm_weight is not None or delta is not None:
            raise ValueError("int4_qkv_mlp_in takes x2 only without the norm prologue")
    elif norm_weight is None or norm_weight2 is None or rms:
        raise ValueError(
            "int4_qkv_mlp_in takes both LayerNorms (norm_weight and norm_weight2), or their outputs as x and x2"
        )
    if not 1 <= qkv_segments < len(qweight):
        raise ValueError(f"int4_qkv_mlp_in needs q/k/v segments followed by the MLP's, got {qkv_segments} of "
                         f"{len(qweight)}")  # fmt: skip
    if activation not in ("none", "gelu", "gelu_tanh"):
        raise ValueError(f"int4_qkv_mlp_in takes none, gelu or gelu_tanh, got {activation!r}")
    if x2 is None:
        h, s, h2 = _norm_prologue(
            x, delta, delta2, norm_weight, norm_bias, norm_weight2, norm_bias2, eps, rms, fixed_delta=True
        )
    else:
        h, s, h2 = x, x.new_empty(0), x2
    parts = [(t[:qkv_segments], t[qkv_segments:]) for t in (qweight, qzeros, scales, g_idx, bias)]
    first, second = ([p[i] for p in parts] for i in (0, 1))
    qkv = int4_linear(h, *first, group_size, act_order, zero_offset)
    q = rope_qkv_cache(qkv, cos, sin, slot, pad, k_cache, v_cache, num_q_heads, num_kv_heads, head_dim, interleaved)
    hidden = int4_linear(h2, *second, group_size, act_order, zero_offset)
    if activation != "none":
        hidden = F.gelu(hidden, approximate="tanh" if activation == "gelu_tanh" else "none")
    return q, hidden, s


def int4_gemv_cat(
    x, x2, qweight, qzeros, scales, g_idx, bias, group_size: int, act_order: bool, zero_offset: int, splits: int,
    workspace, x2_early: bool = False,
):  # fmt: skip
    """[x | x2] @ W + b: one decode-step int4 linear over two activations side by side along k (GPT-NeoX's
    attention output and MLP hidden through its two output projections stacked along k, patcher/layers/out_pair.py).
    x [B, k1], x2 [B, k - k1]. `splits` and `workspace` only shape the CUDA kernel's work; `x2_early` promises the
    CUDA kernel that x2 was written before the stream's previous kernel began (its blocks that read only x2 then
    start before that kernel ends)."""
    return int4_linear(_cat(x, x2, qweight), qweight, qzeros, scales, g_idx, bias, group_size, act_order, zero_offset)


def _cat(x, x2, qweight):
    """[x | x2] along k, checked against the weight's in_features."""
    if x.dim() != 2 or x2.dim() != 2 or x.shape[0] != x2.shape[0] or x.dtype != x2.dtype:
        raise ValueError(
            f"[x | x2] takes x [batch, k1] and x2 [batch, k2] of one dtype, got {x.dtype} {list(x.shape)} "
            f"and {x2.dtype} {list(x2.shape)}"
        )
    k = qweight[0].shape[0] * 8
    if x.shape[1] + x2.shape[1] != k:
        raise ValueError(f"x and x2 widths {x.shape[1]} + {x2.shape[1]} do not add up to the weight's in_features {k}")
    return torch.cat([x, x2], dim=-1)


# The fixed point of int4_gemv_acc's accumulators, as the CUDA kernels form it (kernels/int4_tile.cuh: to_fixed):
# value * 2^28 in int64, each added term clamped to +-2^24 in fp32 first.
FIXED_SCALE = 2.0**28
FIXED_CLAMP = 2.0**24


def to_fixed(y: torch.Tensor) -> torch.Tensor:
    """fp32 sums -> int64 fixed point (round half to even, as __float2ll_rn). NaN -> -2^24, as the kernels' clamp."""
    y = torch.nan_to_num(y.float(), nan=-FIXED_CLAMP).clamp(-FIXED_CLAMP, FIXED_CLAMP)
    return torch.round(y * FIXED_SCALE).to(torch.int64)


def from_fixed(acc: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An accumulator as values in `dtype`: to fp32 (one rounding), then to dtype, as an op's output is rounded."""
    return (acc.to(torch.float32) / FIXED_SCALE).to(dtype)


def int4_gemv_acc(
    x, x2, qweight, qzeros, scales, g_idx, bias, group_size: int, act_order: bool, zero_offset: int, splits: int,
    workspace, acc, clear=None, x2_early: bool = False,
):  # fmt: skip
    """acc += [x | x2] @ W in fixed point (to_fixed; x2 may be None): the product of int4_gemv_cat without its
    rounding, bias and epilogue, which the op reading acc as its prologue's delta applies (from_fixed, then delta2
    = the bias rows). The CUDA kernel's blocks add their K slices' sums into acc, so the slices need not meet.
    `clear` (int64, may be None) is zeroed: an accumulator whose reader has run, for its next use."""
    if any(b is not None for b in bias):
        raise ValueError("int4_gemv_acc adds no bias (the reader of acc adds it, as its prologue's delta2)")
    h = x if x2 is None else _cat(x, x2, qweight)
    n = sum(q.shape[1] for q in qweight)
    if acc.dtype != torch.int64 or tuple(acc.shape) != (h.shape[0], n):
        raise ValueError(f"acc must be int64 [{h.shape[0]}, {n}], got {acc.dtype} {list(acc.shape)}")
    if clear is not None:
        if clear.dtype != torch.int64 or clear is acc:
            raise ValueError("clear must be an int64 tensor other than acc")
        clear.zero_()
    outs = [h.float() @ int4_weight(*w, group_size, act_order, zero_offset).to(h.dtype).float()
            for w in zip(qweight, qzeros, scales, g_idx)]  # fmt: skip
    acc += to_fixed(torch.cat(outs, dim=-1))


def int4_norm_prologue(x, delta, delta2, norm_weight, norm_bias, norm_weight2, norm_bias2, eps: float, rms: bool):
    """The int4 ops' add + norm prologue as an op of its own: (h, sum, h2) as int4_gemv's prologue computes them
    (delta may be an int4_gemv_acc accumulator). The decode step runs it in front of the int4 op that reads the norm,
    and the op then reads h (and GPT-NeoX's h2) with no prologue of its own."""
    if norm_weight is None:
        raise ValueError("int4_norm_prologue needs norm_weight")
    return _norm_prologue(
        x, delta, delta2, norm_weight, norm_bias, norm_weight2, norm_bias2, eps, rms, fixed_delta=True
    )


def int4_norm_gemv_acc(
    x, delta, delta2, norm_weight, norm_bias, norm_weight2, norm_bias2, eps: float, rms: bool,
    qweight, qzeros, scales, g_idx, bias, group_size: int, act_order: bool, zero_offset: int, splits: int,
    workspace, acc, clear=None,
):  # fmt: skip
    """int4_gemv_acc behind int4_gemv's add + norm prologue: acc += norm(sum) @ W in fixed point, `clear` zeroed.
    Returns (sum, h2) as int4_gemv does. The decode step's QKV projection, whose sums decode_attention_qkv_acc
    finishes (rounding, bias, RoPE, the cache writes)."""
    h, s, h2 = _norm_prologue(
        x, delta, delta2, norm_weight, norm_bias, norm_weight2, norm_bias2, eps, rms, fixed_delta=True
    )
    int4_gemv_acc(h, None, qweight, qzeros, scales, g_idx, bias, group_size, act_order, zero_offset, splits,
                  workspace, acc, clear)  # fmt: skip
    return s, h2


def int4_qkv_rope_cache(
    x, delta, delta2, norm_weight, norm_bias, norm_weight2, norm_bias2, eps: float, rms: bool,
    qweight, qzeros, scales, g_idx, bias, group_size: int, act_order: bool, zero_offset: int,
    cos, sin, slot, pad, k_cache, v_cache, num_q_heads: int, num_kv_heads: int, head_dim: int, interleaved: bool,
    splits: int, workspace,
):  # fmt: skip
    """The decode-step attention prologue of an int4 model in one op: [add +] norm -> int4 QKV -> rope_qkv_cache.
    Returns (q, sum, h2) as int4_gemv does, with q [B, Hq, D] and K/V written into the caches at `slot`."""
    h, s, h2 = _norm_prologue(
        x, delta, delta2, norm_weight, norm_bias, norm_weight2, norm_bias2, eps, rms, fixed_delta=True
    )
    qkv = int4_linear(h, qweight, qzeros, scales, g_idx, bias, group_size, act_order, zero_offset)
    q = rope_qkv_cache(qkv, cos, sin, slot, pad, k_cache, v_cache, num_q_heads, num_kv_heads, head_dim, interleaved)
    return q, s, h2
