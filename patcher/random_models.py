"""Models with random weights at real sizes (and tiny ones for CPU tests), built without any model hub.

The real-size configs copy the shapes of the published checkpoints (Pythia-2.8B/6.9B, Llama-3.1-8B,
DeepSeek-R1-Distill-Qwen-1.5B, Qwen2-7B; Llama-3.1-70B's layers at a fifth of its depth). Speed depends only on
shapes, so they are what the decode benchmarks run; correctness on trained weights is checked on SmolLM2-135M.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, GPTNeoXConfig, LlamaConfig, Qwen2Config


def _pythia(hidden, layers, heads, intermediate, vocab, parallel=True, **kw):
    return GPTNeoXConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=intermediate,
        rotary_pct=0.25,
        rotary_emb_base=10000,
        max_position_embeddings=2048,
        use_parallel_residual=parallel,
        layer_norm_eps=1e-5,
        hidden_act="gelu",
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
        **kw,
    )


def _llama(hidden, layers, heads, kv_heads, intermediate, vocab, rope, **kw):
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=intermediate,
        rms_norm_eps=1e-5,
        rope_parameters=rope,
        bos_token_id=1,
        eos_token_id=2,
        **kw,
    )


def _tiny_llama(tied: bool):
    return _llama(
        256,
        3,
        4,
        2,
        384,
        512,
        {"rope_type": "default", "rope_theta": 10000.0},
        max_position_embeddings=512,
        tie_word_embeddings=tied,
        initializer_range=0.1,
    )


def _qwen2(hidden, layers, heads, kv_heads, intermediate, vocab, theta, **kw):
    return Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=intermediate,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": theta},
        use_sliding_window=False,
        bos_token_id=1,
        eos_token_id=2,
        **kw,
    )


LLAMA31_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

CONFIGS = {
    # real sizes
    "pythia-2.8b": lambda: _pythia(2560, 32, 32, 10240, 50304),
    "pythia-6.9b": lambda: _pythia(4096, 32, 32, 16384, 50432),
    "llama-3.1-8b": lambda: _llama(
        4096, 32, 32, 8, 14336, 128256, LLAMA31_ROPE, max_position_embeddings=131072, tie_word_embeddings=False
    ),
    # Llama-3.1-70B's layer (hidden 8192, 64 q / 8 kv heads, MLP 28672) and vocabulary, 16 of its 80 layers (15.8 B
    # parameters, 31.6 GB in fp16): its tensor-parallel step on one machine, the depth scaled down to build and save
    "llama-3.1-70b-16l": lambda: _llama(
        8192, 16, 64, 8, 28672, 128256, LLAMA31_ROPE, max_position_embeddings=131072, tie_word_embeddings=False
    ),
    "llama-3.2-1b": lambda: _llama(
        2048,
        16,
        32,
        8,
        8192,
        128256,
        {**LLAMA31_ROPE, "factor": 32.0},
        max_position_embeddings=131072,
        tie_word_embeddings=True,
        head_dim=64,
    ),
    "qwen2-1.5b": lambda: _qwen2(
        1536, 28, 12, 2, 8960, 151936, 10000.0, max_position_embeddings=131072, tie_word_embeddings=False
    ),
    "qwen2-7b": lambda: _qwen2(
        3584, 28, 28, 4, 18944, 152064, 1000000.0, max_position_embeddings=131072, tie_word_embeddings=False
    ),
    "smollm2-135m": lambda: _llama(
        576,
        30,
        9,
        3,
        1536,
        49152,
        {"rope_type": "default", "rope_theta": 100000.0},
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        head_dim=64,
    ),
    # tiny, for tests: every variant the patcher handles, with the real head sizes (Pythia's 80 with 20 rotary
    # dims, 64 with GQA for LLaMA/Qwen2) so that the decode kernels run on them too; initializer_range is raised
    # so that values are O(1)
    "tiny-pythia": lambda: _pythia(320, 3, 4, 640, 512, initializer_range=0.1),
    "tiny-neox-sequential": lambda: _pythia(320, 3, 4, 640, 512, parallel=False, initializer_range=0.1),
    "tiny-llama": lambda: _tiny_llama(tied=False),
    "tiny-llama-tied": lambda: _tiny_llama(tied=True),
    "tiny-qwen2": lambda: _qwen2(
        256, 3, 4, 2, 384, 512, 10000.0, max_position_embeddings=512, tie_word_embeddings=True, initializer_range=0.1
    ),
    "tiny-qwen2-untied": lambda: _qwen2(
        256, 3, 4, 2, 384, 512, 10000.0, max_position_embeddings=512, tie_word_embeddings=False, initializer_range=0.1
    ),
}

TINY = [name for name in CONFIGS if name.startswith("tiny-")]
REAL_SIZE = [name for name in CONFIGS if not name.startswith("tiny-")]


def config(name: str):
    if name not in CONFIGS:
        raise ValueError(f"unknown random config {name!r}; choose from {', '.join(CONFIGS)}")
    return CONFIGS[name]()


def build(
    name: str,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    attn_implementation: str = "sdpa",
):
    """A *ForCausalLM with random weights (HF's own initialization), in eval mode, built directly on `device`."""
    cfg = config(name)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=attn_implementation)
    return model.eval()


def quantize_random(model, group_size: int = 128, seed: int = 0):
    """Replaces every decoder linear with a GPTQLinear of random int4 weights (v1 format), on the linear's device:
    a real-size int4 model for speed measurements without quantizing anything (weights about 1/sqrt(K))."""
    from .gptq import format as fmt
    from .gptq.linear import GPTQLinear
    from .registry import REGISTRY

    spec = REGISTRY[model.config.model_type].spec
    g = torch.Generator(device=model.device).manual_seed(seed)
    names = (*spec.qkv, spec.out_proj, *spec.mlp_in, spec.mlp_out)
    for layer in getattr(getattr(model, spec.base_model), spec.layers):
        for parent in (getattr(layer, spec.attention), getattr(layer, spec.mlp)):
            for name in names:
                linear = getattr(parent, name, None)
                if not isinstance(linear, torch.nn.Linear):
                    continue
                k, n, dev = linear.in_features, linear.out_features, linear.weight.device
                q = GPTQLinear(k, n, group_size, linear.bias is not None, device=dev)
                groups = fmt.groups_for(k, group_size)
                q.qweight.copy_(torch.randint(-(2**31), 2**31 - 1, q.qweight.shape, generator=g, device=dev))
                q.qzeros.copy_(torch.full_like(q.qzeros, 0x77777777))  # zero point 8 in every nibble (v1: 7 + 1)
                q.scales.copy_(torch.rand(groups, n, generator=g, device=dev) / (4 * k**0.5) + 1 / (8 * k**0.5))
                if linear.bias is not None:
                    q.bias.copy_(linear.bias.detach().half())
                setattr(parent, name, q)
    model.config.quantization_config = {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": False}
    return model
