"""The pure-torch references compute exactly what the HF modules compute (CPU), and the op schemas are sound."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import DTYPES, NORM_OPS, norm_args
from transformers.activations import ACT2FN
from transformers.models.gpt_neox import modeling_gpt_neox as neox
from transformers.models.llama import modeling_llama as llama

from patcher.ops import KERNELS, reference


def rand(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=torch.float32).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_is_llama_residual_plus_rmsnorm(dtype):
    norm = llama.LlamaRMSNorm(96, eps=1e-5).to(dtype)
    norm.weight.data = rand(96, dtype=dtype)
    x, d = rand(3, 5, 96, dtype=dtype), rand(3, 5, 96, dtype=dtype)
    out, s = reference.add_rms_norm(x, d, norm.weight, norm.variance_epsilon)
    assert torch.equal(s, x + d)
    assert torch.equal(out, norm(x + d))
    assert torch.equal(reference.rms_norm(x, norm.weight, 1e-5), norm(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_dual_layer_norm_is_neox_parallel_junction(dtype):
    ln1, ln2 = torch.nn.LayerNorm(80, eps=1e-5).to(dtype), torch.nn.LayerNorm(80, eps=1e-5).to(dtype)
    for p in (*ln1.parameters(), *ln2.parameters()):
        p.data = rand(80, dtype=dtype)
    x, attn, mlp = (rand(2, 7, 80, dtype=dtype) for _ in range(3))
    h = mlp + attn + x  # GPTNeoXLayer: hidden_states = mlp_output + attn_output + hidden_states
    a, b, s = reference.add_dual_layer_norm(x, attn, mlp, ln1.weight, ln1.bias, ln2.weight, ln2.bias, 1e-5)
    assert torch.equal(s, h) and torch.equal(a, ln1(h)) and torch.equal(b, ln2(h))
    a, b = reference.dual_layer_norm(x, ln1.weight, ln1.bias, ln2.weight, ln2.bias, 1e-5)
    assert torch.equal(a, ln1(x)) and torch.equal(b, ln2(x))
    out, s = reference.add_layer_norm(x, attn, None, ln1.weight, ln1.bias, 1e-5)
    assert torch.equal(s, attn + x) and torch.equal(out, ln1(attn + x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary", [20, 80])
def test_rope_qkv_matches_gpt_neox_attention_prologue(dtype, rotary):
    B, T, H, D = 2, 5, 4, 80
    qkv = rand(B, T, 3 * H * D, dtype=dtype)
    cos, sin = rand(1, T, rotary, dtype=dtype), rand(1, T, rotary, dtype=dtype)
    # GPTNeoXAttention.forward
    per_head = qkv.view(B, T, -1, 3 * D).transpose(1, 2)
    q, k, v = per_head.chunk(3, dim=-1)
    q_hf, k_hf = neox.apply_rotary_pos_emb(q, k, cos, sin)
    q_out, k_out, v_out = reference.rope_qkv(qkv, cos, sin, H, H, D, True)
    assert torch.equal(q_out, q_hf) and torch.equal(k_out, k_hf) and torch.equal(v_out, v)
    assert q_out.is_contiguous() and k_out.is_contiguous() and v_out.is_contiguous()


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_qkv_matches_llama_gqa_prologue(dtype):
    B, T, Hq, Hkv, D = 3, 4, 6, 2, 64
    qkv = rand(B, T, (Hq + 2 * Hkv) * D, dtype=dtype)
    cos, sin = rand(B, T, D, dtype=dtype), rand(B, T, D, dtype=dtype)
    q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
    q = q.view(B, T, Hq, D).transpose(1, 2)
    k = k.view(B, T, Hkv, D).transpose(1, 2)
    v = v.view(B, T, Hkv, D).transpose(1, 2)
    q_hf, k_hf = llama.apply_rotary_pos_emb(q, k, cos, sin)
    q_out, k_out, v_out = reference.rope_qkv(qkv, cos, sin, Hq, Hkv, D, False)
    assert torch.equal(q_out, q_hf) and torch.equal(k_out, k_hf) and torch.equal(v_out, v)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_is_llama_mlp_activation(dtype):
    gate, up = rand(4, 7, 33, dtype=dtype), rand(4, 7, 33, dtype=dtype)
    expected = ACT2FN["silu"](gate) * up  # LlamaMLP: act_fn(gate_proj(x)) * up_proj(x)
    got = reference.silu_and_mul(torch.cat([gate, up], dim=-1))
    # Bit-exact on most CPUs; a vectorized and a scalar exp (contiguous gate vs a strided view) may differ by an ulp,
    # which the product with up can carry into a second one.
    ulp = {torch.float32: 2.4e-7, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]  # two units in the last place
    torch.testing.assert_close(got, expected, rtol=ulp, atol=0)


@pytest.mark.parametrize("act,tanh", [("gelu", False), ("gelu_pytorch_tanh", True)])
def test_bias_gelu_is_neox_mlp_activation(act, tanh):
    x, w, b = rand(5, 16), rand(24, 16), rand(24)
    expected = ACT2FN[act](F.linear(x, w, b))
    got = reference.bias_gelu(F.linear(x, w), b, tanh)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)  # the GEMM's bias is added after rounding


def _samples():
    x, d, d2 = rand(3, 64), rand(3, 64), rand(3, 64)
    w, b, w2, b2 = rand(64), rand(64), rand(64), rand(64)
    qkv = rand(2, 3, (4 + 2 * 2) * 16)
    cos, sin = rand(1, 3, 8), rand(1, 3, 8)
    return {op: norm_args(op, x, d, d2, w, b, w2, b2) for op in NORM_OPS} | {
        "rope_qkv": (qkv, cos, sin, 4, 2, 16, False),
        "silu_and_mul": (rand(3, 5, 64),),
        "bias_gelu": (rand(3, 64), b, False),
    }


@pytest.mark.parametrize("op", list(_samples()))
def test_op_schema_and_fake_kernel(op):
    """torch.library.opcheck on the CPU kernel (the reference): schema, fake tensor, AOT dispatch."""
    args = _samples()[op]
    torch.library.opcheck(getattr(torch.ops.patcher, op).default, args)
    expected = getattr(reference, op)(*args)
    got = getattr(KERNELS, op)(*args)
    for e, g in zip(
        expected if isinstance(expected, tuple) else (expected,), got if isinstance(got, tuple) else (got,)
    ):
        assert torch.equal(e, g) and g.is_contiguous()


def test_decode_attention_qkv_is_rope_then_attention():
    """decode_attention_qkv (CPU: its reference) writes the current token's rotated K and its V at slot, leaves the
    rest of the caches as they were, and attends with the rotated q as decode_attention does (GQA, two rows, one
    padded); schema and fake kernel pass opcheck."""
    hq, hkv, d, slot = 4, 2, 16, 5
    qkv = rand(2, (hq + 2 * hkv) * d).half()
    angles = torch.randn(16, d // 2) * 3
    cos, sin = torch.cat([angles, angles], -1).cos().half(), torch.cat([angles, angles], -1).sin().half()
    caches = [rand(2, hkv, 16, d).half() for _ in range(2)]
    before = [c.clone() for c in caches]
    slots, pad = torch.tensor([slot]), torch.tensor([0, 2])
    tail = (hq, False, d**-0.5, 1, None)
    torch.library.opcheck(torch.ops.patcher.decode_attention_qkv.default,
                          (qkv, cos, sin, slots, pad, *[c.clone() for c in caches], *tail))  # fmt: skip
    out = KERNELS.decode_attention_qkv(qkv, cos, sin, slots, pad, *caches, *tail)
    q, k, v = reference.rope_qkv(qkv[:, None], cos[slot - pad][:, None], sin[slot - pad][:, None], hq, hkv, d, False)
    keep = torch.arange(16) != slot
    for got, old, new in zip(caches, before, (k, v)):
        assert torch.equal(got[:, :, keep], old[:, :, keep]) and torch.equal(got[:, :, slot], new[:, :, 0])
    expected = reference.decode_attention(q[:, :, 0].contiguous(), *caches, slots, pad, d**-0.5, 1, None)
    assert torch.equal(out, expected) and out.shape == (2, hq * d)
