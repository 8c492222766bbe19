"""Random GGUF blocks at a model's real shapes: GGUF models for speed measurements and kernel tests without a file.

Every type gets random quants and scales that center each block on zero (Q4_0's quants run -8..7: a mean of
-d / 2) and give weights of about 1/sqrt(K) (K the input features), so activations keep their size through the
layers:

    Q4_0  d = u / (4.6 sqrt K)                         Q4_1  as Q4_0, m = -7.5 d
    Q8_0  d = u / (73 sqrt K)                          Q6_K  scales 16..63, d = u / (40 * 18 sqrt K)
    Q4_K, Q5_K  sc = mn (6-bit, 16..63), d = u / (40 * c sqrt K), dmin = h d  (c = 4.6, h = 7.5 for Q4_K;
                c = 9.2, h = 15.5 for Q5_K)

with u uniform in [0.5, 1.5) per block.
"""

from __future__ import annotations

import torch

from . import format as fmt
from .linear import GGUFLinear


def random_blocks(kind: str, rows: int, cols: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """uint8 [rows, bytes_per_row] of `kind` (module docstring), on the generator's device (the CPU without one)."""
    t = fmt.block_type(kind)
    width = fmt.bytes_per_row(t.name, cols)
    device = generator.device if generator is not None else torch.device("cpu")
    data = torch.randint(0, 256, (rows, width), dtype=torch.uint8, generator=generator, device=device)
    blocks = data.view(-1, t.type_size)
    n = blocks.shape[0]
    u = torch.rand(n, generator=generator, device=device) + 0.5
    root = cols**0.5

    def put(at: int, values: torch.Tensor) -> None:
        blocks[:, at : at + 2] = values.to(torch.float16).view(torch.uint8).view(n, 2)

    if t.name in ("Q4_0", "Q4_1"):
        d = u / (4.6 * root)
        put(0, d)
        if t.name == "Q4_1":
            put(2, -7.5 * d.to(torch.float16).float())
    elif t.name == "Q8_0":
        put(0, u / (73 * root))
    elif t.name in ("Q4_K", "Q5_K"):
        scale = torch.randint(16, 64, (n, 8), dtype=torch.uint8, generator=generator, device=device)
        low, high = scale[:, :4], scale[:, 4:]
        packed = (low | ((high >> 4) << 6)).repeat(1, 2)  # bytes 0-3 (sc) and 4-7 (mn): the same values
        blocks[:, 4:12] = packed
        blocks[:, 12:16] = (high & 0x0F) | ((high & 0x0F) << 4)
        c, h = (4.6, 7.5) if t.name == "Q4_K" else (9.2, 15.5)
        d = u / (40 * c * root)
        put(0, d)
        put(2, h * d.to(torch.float16).float())
    else:  # Q6_K
        blocks[:, 192:208] = torch.randint(16, 64, (n, 16), dtype=torch.uint8, generator=generator, device=device)
        put(208, u / (40 * 18 * root))
    return data


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the layers whose V and down projections a Q4_K_M file stores as Q6_K: the first and
    last eighth of the layers, and every third one between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def q4_k_m(layer: int, layers: int) -> dict[str, str]:
    """The types of one layer's projections in a Q4_K_M file (llama.cpp's mix): Q4_K, but Q6_K for the V and down
    projections of use_more_bits layers. Keys are every architecture's projection names."""
    wide = "Q6_K" if use_more_bits(layer, layers) else "Q4_K"
    kinds = dict.fromkeys(("q_proj", "k_proj", "o_proj", "gate_proj", "up_proj", "dense", "dense_h_to_4h"), "Q4_K")
    kinds.update(v_proj=wide, down_proj=wide, dense_4h_to_h=wide)
    return kinds


MIXES = {"Q4_K_M": q4_k_m}  # a mix name -> (layer, layers) -> projection name -> type


def head_type(kinds: str | dict[str, str], hidden: int) -> str | None:
    """The lm_head's type in a file of `kinds` (quantize_random), as llama.cpp's quantizer writes it: Q8_0 in a Q8_0
    file or where the hidden size is not whole super-blocks of 256, Q6_K otherwise; a dict names its own ("lm_head",
    or none)."""
    if isinstance(kinds, dict):
        return kinds.get("lm_head")
    return "Q8_0" if kinds == "Q8_0" or hidden % 256 else "Q6_K"


def quantize_random(model, kinds: str | dict[str, str], quantize_activations: bool = True, seed: int = 0):
    """Replaces every decoder linear of `model`, and an lm_head not tied to the embedding, with a GGUFLinear of
    random blocks, on the linear's device.

    kinds: one type name for all, a mix of MIXES (types per layer as a file of that mix has them; GPT-NeoX's fused
    query_key_value takes Q4_K), or projection attribute name (q_proj, down_proj, ...; lm_head) -> type name (a name
    not in it keeps its nn.Linear). The lm_head takes head_type's. A linear's bias is kept. Sets
    `model.gguf_report`.
    """
    from ..registry import REGISTRY
    from .load import GGUFReport

    spec = REGISTRY[model.config.model_type].spec
    generators: dict[torch.device, torch.Generator] = {}  # one a device: the blocks are drawn where they will live
    names = (*spec.qkv, spec.out_proj, *spec.mlp_in, spec.mlp_out)
    report = GGUFReport("(random blocks)", quantize_activations=quantize_activations)
    module_names = {id(m): n for n, m in model.named_modules()}
    layers = getattr(getattr(model, spec.base_model), spec.layers)
    mix = MIXES.get(kinds) if isinstance(kinds, str) else None
    for index, layer in enumerate(layers):
        per_layer = mix(index, len(layers)) if mix else kinds
        for parent in (getattr(layer, spec.attention), getattr(layer, spec.mlp)):
            for name in names:
                linear = getattr(parent, name, None)
                if isinstance(per_layer, str):
                    kind = per_layer
                else:
                    kind = per_layer.get(name, "Q4_K" if mix else None)
                if not isinstance(linear, torch.nn.Linear) or kind is None:
                    continue
                setattr(parent, name, _random_layer(linear, kind, quantize_activations, generators, seed))
                report.quantized[module_names[id(linear)]] = fmt.block_type(kind).name
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is model.get_input_embeddings().weight
    kind = head_type(kinds, head.in_features) if isinstance(head, torch.nn.Linear) and not tied else None
    if kind is not None:
        model.set_output_embeddings(_random_layer(head, kind, quantize_activations, generators, seed))
        report.quantized[module_names[id(head)]] = fmt.block_type(kind).name
    model.gguf_report = report
    return model


def _random_layer(linear: torch.nn.Linear, kind: str, quantize_activations: bool, generators: dict, seed: int):
    """A GGUFLinear of random `kind` blocks in place of `linear`: its shape, bias and device, the blocks drawn there
    (a GPU draws an 8B model's 4.4 GB of blocks in milliseconds, the CPU in tens of seconds)."""
    device = linear.weight.device
    if device not in generators:
        generators[device] = torch.Generator(device).manual_seed(seed)
    data = random_blocks(kind, linear.out_features, linear.in_features, generators[device])
    bias = None if linear.bias is None else linear.bias.detach()
    return GGUFLinear.from_blocks(data, kind, bias, quantize_activations)
