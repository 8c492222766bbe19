"""Which replacement forwards each architecture gets: its spec plus one entry per module role.

Adding an architecture built from the same parts (pre-norm or parallel residual, RMSNorm or LayerNorm, fused or
separate q/k/v, gated or plain MLP) means writing its spec in `patcher/models/` and one entry here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .layers import attention, decoder, mlp, norm
from .models import gpt_neox, llama, qwen2
from .models.spec import ArchSpec


@dataclass(frozen=True)
class Entry:
    spec: ArchSpec
    sequential_layer: Callable  # pre-norm layer with one residual add per sub-layer
    parallel_layer: Callable | None  # x + attn(ln1(x)) + mlp(ln2(x)), where the architecture has it
    attention: Callable
    mlp: Callable
    norm: Callable  # every norm module, including the final one


REGISTRY: dict[str, Entry] = {
    "gpt_neox": Entry(
        spec=gpt_neox.SPEC,
        sequential_layer=decoder.sequential_layer_forward,
        parallel_layer=decoder.parallel_layer_forward,
        attention=attention.attention_forward,
        mlp=mlp.gelu_mlp_forward,
        norm=norm.norm_forward,
    ),
    "llama": Entry(
        spec=llama.SPEC,
        sequential_layer=decoder.sequential_layer_forward,
        parallel_layer=None,
        attention=attention.attention_forward,
        mlp=mlp.gated_mlp_forward,
        norm=norm.norm_forward,
    ),
    "qwen2": Entry(
        spec=qwen2.SPEC,
        sequential_layer=decoder.sequential_layer_forward,
        parallel_layer=None,
        attention=attention.attention_forward,
        mlp=mlp.gated_mlp_forward,
        norm=norm.norm_forward,
    ),
}
