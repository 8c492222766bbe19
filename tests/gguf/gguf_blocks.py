"""Random GGUF blocks for the tests: random bytes, with every fp16 scale field set from a chosen pool."""

from __future__ import annotations

import torch

from patcher.gguf import format as fmt

SCALE_BYTES = {"Q4_0": (0,), "Q4_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def wild_scales(n: int, gen: torch.Generator) -> torch.Tensor:
    """fp16 [n]: normal values over six decades, negatives, +0, -0, subnormals and the largest finite value."""
    normal = torch.randn(n, generator=gen) * 10 ** (torch.rand(n, generator=gen) * 6 - 4)
    special = torch.tensor([0.0, -0.0, 6e-8, -6e-8, 3e-6, -4.5e-5, 6.1e-5, 65504.0, -65504.0, 1.0])
    pick = torch.randint(0, 3, (n,), generator=gen) == 0
    values = torch.where(pick, special[torch.randint(0, len(special), (n,), generator=gen)], normal)
    return values.to(torch.float16)


def sane_scales(n: int, gen: torch.Generator) -> torch.Tensor:
    """fp16 [n] around 0.01 (weights of a trained layer's size), both signs."""
    return (torch.randn(n, generator=gen) * 0.01).to(torch.float16)


def random_blocks(kind: str, rows: int, cols: int, gen: torch.Generator, scales=sane_scales) -> torch.Tensor:
    """uint8 [rows, bytes_per_row]: random quants, each scale field drawn by `scales`."""
    t = fmt.TYPES[kind]
    data = torch.randint(0, 256, (rows, fmt.bytes_per_row(kind, cols)), dtype=torch.uint8, generator=gen)
    blocks = data.view(-1, t.type_size)
    for at in SCALE_BYTES[kind]:
        blocks[:, at : at + 2] = scales(blocks.shape[0], gen).view(torch.uint8).view(-1, 2)
    return data


def write_tiny_model(path, architecture: str = "llama", types: dict | None = None, seed: int = 0) -> dict:
    """Writes a 2-layer GGUF model (hidden 256, 4 heads, 2 kv heads, MLP 512, vocab 64) with gguf.GGUFWriter.

    types: GGUF projection name (attn_q, attn_k, attn_v, attn_output, ffn_gate, ffn_up, ffn_down, and output: the
    lm_head, Q6_K as llama.cpp writes it, F32, or None for none) -> type name; gguf.quants quantizes the types it can from random
    weights, the K-quants get random blocks. qwen2 files carry q/k/v biases. Returns the types used.
    """
    import gguf
    import numpy as np

    hidden, heads, kv_heads, ffn, vocab, layers = 256, 4, 2, 512, 64, 2
    types = {
        "attn_q": "Q4_0",
        "attn_k": "Q4_1",
        "attn_v": "Q8_0",
        "attn_output": "Q4_K",
        "ffn_gate": "Q5_K",
        "ffn_up": "Q6_K",
        "ffn_down": "Q4_0",
        "output": "Q6_K",
        **(types or {}),
    }
    shapes = {
        "attn_q": (hidden, hidden),
        "attn_k": (kv_heads * 64, hidden),
        "attn_v": (kv_heads * 64, hidden),
        "attn_output": (hidden, hidden),
        "ffn_gate": (ffn, hidden),
        "ffn_up": (ffn, hidden),
        "ffn_down": (hidden, ffn),
    }
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(layers)
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_vocab_size(vocab)

    def floats(*shape, scale=1.0):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    writer.add_tensor("token_embd.weight", floats(vocab, hidden))
    writer.add_tensor("output_norm.weight", 1 + floats(hidden, scale=0.1))

    def add_linear(name: str, kind_name: str, rows: int, cols: int) -> None:
        if kind_name == "F32":
            writer.add_tensor(name, floats(rows, cols, scale=0.05))
            return
        kind = gguf.GGMLQuantizationType[kind_name]
        if kind_name in ("Q4_K", "Q5_K", "Q6_K"):
            data = random_blocks(kind_name, rows, cols, gen, scales=_k_scales).numpy()
        else:
            data = gguf.quants.quantize(floats(rows, cols, scale=0.05), kind)
        writer.add_tensor(name, data, raw_dtype=kind)

    if types["output"] is not None:  # (None: no lm_head of its own, as a file of a tied model)
        add_linear("output.weight", types["output"], vocab, hidden)
    for i in range(layers):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", 1 + floats(hidden, scale=0.1))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", 1 + floats(hidden, scale=0.1))
        for name, (rows, cols) in shapes.items():
            add_linear(f"blk.{i}.{name}.weight", types[name], rows, cols)
            if architecture == "qwen2" and name in ("attn_q", "attn_k", "attn_v"):
                writer.add_tensor(f"blk.{i}.{name}.bias", floats(rows, scale=0.1))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return types


def _k_scales(n: int, gen: torch.Generator) -> torch.Tensor:
    """K-quant super-block scales: d * 6-bit sc (up to 63) stays near a trained weight's size."""
    return (torch.rand(n, generator=gen) * 0.0005 + 0.0001).to(torch.float16)


def q8_1_value(x: torch.Tensor) -> torch.Tensor:
    """x with each 32-value block replaced by its Q8_1 value (d * q), in x's dtype: a W4A16 layer fed this computes,
    in float, what its W4A8 form computes with integer dot products."""
    from patcher.gguf import reference

    q, d, _ = reference.quantize_q8_1(x)
    return (q.float() * d.unsqueeze(-1)).reshape(x.shape).to(x.dtype)


def set_mode(model, quantize_activations: bool) -> None:
    """Every GGUF linear of `model` in W4A8 (True) or W4A16 (False)."""
    from patcher.gguf import GGUFLinear

    for module in model.modules():
        if isinstance(module, GGUFLinear):
            module.quantize_activations = quantize_activations


def patched_logits(model, tokens: torch.Tensor):
    """patch_model's report and the patched model's logits for `tokens`; the model is unpatched again after."""
    from patcher import patch_model, unpatch_model

    report = patch_model(model)
    try:
        return report, model(tokens).logits
    finally:
        unpatch_model(model)
