"""GPT-NeoX (Pythia): LayerNorm, interleaved fused QKV with partial rotary, GELU MLP, parallel residual."""

from .spec import ArchSpec

SPEC = ArchSpec(
    model_type="gpt_neox",
    causal_lm_class="GPTNeoXForCausalLM",
    base_model="gpt_neox",
    layers="layers",
    final_norm="final_layer_norm",
    layer_class="GPTNeoXLayer",
    norm="layer",
    eps_attr="eps",
    input_norm="input_layernorm",
    post_norm="post_attention_layernorm",
    attention="attention",
    qkv=("query_key_value",),
    qkv_interleaved=True,
    qkv_bias="attention_bias",
    out_proj="dense",
    attention_kwargs=(),
    mlp="mlp",
    mlp_gated=False,
    mlp_in=("dense_h_to_4h",),
    mlp_out="dense_4h_to_h",
    act_config="hidden_act",
    parallel_residual="use_parallel_residual",  # Pythia: x + attn(ln1(x)) + mlp(ln2(x))
    rotary_fraction="partial_rotary_factor",  # Pythia: rotary_pct 0.25 (20 of 80 dims for 2.8B)
    dropout_configs=("attention_dropout", "hidden_dropout"),
    checkpoint_renames=((r"^embed_out\.", "lm_head."),),  # Pythia checkpoints name the output head embed_out
)
