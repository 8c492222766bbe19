"""RoPE ops (kernels/rope/rope.cu): the fused QKV projection's output split into heads with the NeoX half rotation
on q and k, for prefill (rope_qkv) and for one decode token written into the static KV cache (rope_qkv_cache).
RoPE uses cos/sin already cast to the dtype, and `q * cos + rotate_half(q) * sin` with each product rounded, as HF.
"""

from __future__ import annotations

import torch

from .library import define


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


def _rope_qkv_fake(qkv, cos, sin, num_q_heads, num_kv_heads, head_dim, interleaved):
    B, T, _ = qkv.shape
    q = qkv.new_empty((B, num_q_heads, T, head_dim))
    kv = (B, num_kv_heads, T, head_dim)
    return q, qkv.new_empty(kv), qkv.new_empty(kv)


define(
    "rope_qkv(Tensor qkv, Tensor cos, Tensor sin, int num_q_heads, int num_kv_heads, int head_dim,"
    " bool interleaved) -> (Tensor, Tensor, Tensor)",
    rope_qkv,
    _rope_qkv_fake,
)
define(
    "rope_qkv_cache(Tensor qkv, Tensor cos, Tensor sin, Tensor slot, Tensor pad, Tensor(a!) k_cache,"
    " Tensor(b!) v_cache, int num_q_heads, int num_kv_heads, int head_dim, bool interleaved) -> Tensor",
    rope_qkv_cache,
    lambda qkv, cos, sin, slot, pad, kc, vc, hq, hkv, d, inter: qkv.new_empty((qkv.shape[0], hq, d)),
)
