"""LLaMA: RMSNorm, separate q/k/v (fused at patch time), GQA, SwiGLU MLP, sequential residual."""

from .spec import ArchSpec

SPEC = ArchSpec(
    model_type="llama",
    causal_lm_class="LlamaForCausalLM",
    base_model="model",
    layers="layers",
    final_norm="norm",
    layer_class="LlamaDecoderLayer",
    norm="rms",
    eps_attr="variance_epsilon",
    input_norm="input_layernorm",
    post_norm="post_attention_layernorm",
    attention="self_attn",
    qkv=("q_proj", "k_proj", "v_proj"),
    qkv_interleaved=False,
    qkv_bias="attention_bias",
    out_proj="o_proj",
    attention_kwargs=(),
    mlp="mlp",
    mlp_gated=True,
    mlp_in=("gate_proj", "up_proj"),
    mlp_out="down_proj",
    act_config="hidden_act",
    parallel_residual=False,
    rotary_fraction=None,
    dropout_configs=("attention_dropout",),
)
