"""What a decoder architecture looks like to the patcher: attribute names and quirks, as data.

One `ArchSpec` per architecture (gpt_neox.py, llama.py, qwen2.py) says where the modules are and which quirks
apply. The patched forwards in `patcher/layers/` read only these fields, never the model type, so adding an
architecture whose layers are built from the same parts means writing one spec.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ArchSpec:
    model_type: str  # config.model_type
    causal_lm_class: str  # the *ForCausalLM class name
    base_model: str  # attribute of the *ForCausalLM holding the decoder stack ("model", "gpt_neox")
    layers: str  # attribute of the base model: the ModuleList of decoder layers
    final_norm: str  # attribute of the base model: the norm after the last layer
    layer_class: str  # class name of the decoder layers this spec describes

    norm: str  # "rms" (LLaMA RMSNorm: fp32 normalize, cast, times weight) or "layer" (nn.LayerNorm)
    eps_attr: str  # name of the eps attribute on the norm modules
    input_norm: str  # norm before attention
    post_norm: str  # norm before the MLP

    attention: str  # attribute of the layer
    qkv: tuple[str, ...]  # one fused projection, or the q, k, v projections (fused into one GEMM at patch time)
    qkv_interleaved: bool  # fused output is [head][q | k | v] (GPT-NeoX query_key_value), else [q | k | v]
    qkv_bias: str | bool  # config attribute saying whether q/k/v have a bias, or a constant (Qwen2: True)
    out_proj: str
    attention_kwargs: tuple[str, ...]  # attention-module attributes HF passes to its attention function

    mlp: str
    mlp_gated: bool  # SwiGLU act(gate) * up (gate and up fused into one GEMM), else act(fc_in) with a bias
    mlp_in: tuple[str, ...]  # ("gate_proj", "up_proj") or ("dense_h_to_4h",)
    mlp_out: str
    act_config: str  # config attribute naming the activation

    parallel_residual: str | bool  # config attribute (GPT-NeoX use_parallel_residual) or a constant
    rotary_fraction: str | None  # key of config.rope_parameters with the rotated fraction of head_dim
    rotary_style: str = "half"  # NeoX half rotation (rotate_half pairs dim i with i + rot/2); the only one here
    dropout_configs: tuple[str, ...] = ()  # config attributes that must be 0 for an exact eval-mode forward
    checkpoint_renames: tuple[tuple[str, str], ...] = ()  # (regex, replacement) from checkpoint keys to module keys

    # --- reading the config -------------------------------------------------------------------------------
    def flag(self, config, value: str | bool) -> bool:
        return bool(getattr(config, value, False)) if isinstance(value, str) else bool(value)

    def num_heads(self, config) -> int:
        return config.num_attention_heads

    def num_kv_heads(self, config) -> int:
        return getattr(config, "num_key_value_heads", None) or config.num_attention_heads

    def head_dim(self, config) -> int:
        return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

    def rotary_dim(self, config) -> int:
        fraction = 1.0
        if self.rotary_fraction is not None:
            params = getattr(config, "rope_parameters", None) or {}
            fraction = params.get(self.rotary_fraction, getattr(config, "rotary_pct", 1.0))
        return int(self.head_dim(config) * fraction)
