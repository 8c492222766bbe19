"""Qwen2: LLaMA's layer with a bias on q/k/v and an optional sliding window passed to attention."""

from dataclasses import replace

from .llama import SPEC as LLAMA

SPEC = replace(
    LLAMA,
    model_type="qwen2",
    causal_lm_class="Qwen2ForCausalLM",
    layer_class="Qwen2DecoderLayer",
    qkv_bias=True,
    attention_kwargs=("sliding_window",),
)
