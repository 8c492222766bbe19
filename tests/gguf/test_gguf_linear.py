"""GGUFLinear, and load_gguf on small GGUF files written here (LLaMA and Qwen2, every supported type and one that is
not). patch_model on such models: test_gguf_patch.py."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from conftest import max_err
from gguf_blocks import q8_1_value, random_blocks, set_mode, write_tiny_model

from patcher import load_gguf
from patcher.gguf import GGUFLinear
from patcher.gguf import format as fmt
from patcher.gguf import reference as ref

pytest.importorskip("gguf")

TINY_TOKENS = torch.tensor([[3, 17, 42, 5, 60, 8, 23, 1, 33], [9, 9, 14, 50, 2, 7, 61, 30, 11]])


def test_gguf_linear_holds_the_blocks_and_runs_both_modes():
    gen = torch.Generator().manual_seed(0)
    data = random_blocks("Q4_1", 48, 96, gen)
    bias = torch.randn(48, generator=gen)
    layer = GGUFLinear.from_blocks(data, "Q4_1", bias, quantize_activations=True)
    assert (layer.in_features, layer.out_features, layer.kind) == (96, 48, "Q4_1")
    assert layer.qweight is data and set(layer.state_dict()) == {"qweight", "bias"}
    x = torch.randn(2, 3, 96, generator=gen)  # 6 rows: the decode op (on the CPU its reference)
    assert torch.equal(layer(x), ref.linear_w4a8(x, data, "Q4_1", bias))
    layer.quantize_activations = False
    assert torch.equal(layer(x), torch.nn.functional.linear(x, fmt.dequantize(data, "Q4_1"), bias))
    layer.half()
    assert layer.qweight.dtype == torch.uint8 and layer.bias.dtype == torch.float16  # blocks are never cast
    assert layer(x.half()).dtype == torch.float16
    assert "type=Q4_1" in repr(layer)


def test_gguf_linear_refuses_bad_blocks():
    with pytest.raises(ValueError, match="uint8"):
        GGUFLinear.from_blocks(torch.zeros(4, 18), "Q4_0")
    with pytest.raises(ValueError, match="bias"):
        GGUFLinear.from_blocks(torch.zeros(4, 18, dtype=torch.uint8), "Q4_0", torch.zeros(3))
    with pytest.raises(ValueError, match="multiple"):
        GGUFLinear(100, 4, "Q4_K")


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request, tmp_path_factory):
    """(GGUF path, the types written, transformers' own dequantized model of it in fp32)."""
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp(request.param)
    path = folder / "tiny.gguf"
    types = write_tiny_model(path, request.param, {"ffn_up": "Q5_0"} if request.param == "qwen2" else None)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=path.name, dtype=torch.float32).eval()
    return path, types, model


def test_pack_tool_reads_a_gguf_file(tiny, tmp_path):
    """`python -m patcher.gptq.pack FILE.gguf DST` packs the model transformers reads from the file: the same
    checkpoint, logits bit for bit, as pack_model on transformers' dequantized model."""
    from patcher import load_gptq
    from patcher.gptq.pack import main as pack_main
    from patcher.gptq.pack import pack_model

    path, _, dequantized = tiny
    assert pack_main([str(path), str(tmp_path / "cli"), "--group-size", "64"]) == 0
    pack_model(dequantized, tmp_path / "direct", group_size=64, sym=False)
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        got = load_gptq(tmp_path / "cli", dtype=torch.float32)(ids).logits
        want = load_gptq(tmp_path / "direct", dtype=torch.float32)(ids).logits
    assert torch.equal(got, want)


def gguf_layers(model) -> dict[str, GGUFLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, GGUFLinear)}


def test_load_gguf_keeps_the_supported_blocks(tiny):
    path, types, expected = tiny
    model = load_gguf(path, dtype=torch.float32, quantize_activations=False)
    report = model.gguf_report
    layers = gguf_layers(model)
    supported = [kind for name, kind in types.items() if kind in fmt.TYPES and name != "output"]
    assert len(layers) == 2 * len(supported) + 1 and report.quantized == {n: m.kind for n, m in layers.items()}
    assert sorted(m.kind for m in layers.values()) == sorted(supported * 2 + [types["output"]])
    assert layers["lm_head"] is model.get_output_embeddings() and model.lm_head.kind == types["output"] == "Q6_K"
    unsupported = {n: why for n, why in report.dequantized.items() if "up_proj" in n}
    assert len(unsupported) == (2 if "Q5_0" in types.values() else 0)
    assert all(why.startswith("Q5_0: not supported") for why in unsupported.values())
    assert all(isinstance(model.get_submodule(n), torch.nn.Linear) for n in unsupported)
    # Each kept weight is transformers' own (q and k rows in the order its LLaMA processor puts them).
    reference = dict(expected.named_modules())
    for name, layer in layers.items():
        assert torch.equal(layer.dequantize(), reference[name].weight), name
        if layer.bias is not None:
            assert torch.equal(layer.bias, reference[name].bias)
    assert "linears kept quantized" in str(report)


def test_load_gguf_logits_w4a16_equal_and_w4a8_close(tiny):
    """W4A16 computes transformers' logits bit for bit. Each W4A8 layer computes, up to fp32 rounding, what its W4A16
    form computes on the Q8_1 value of its input (the integer dot products are exact; the block sums are added in
    another order). Checked layer by layer on the inputs the W4A8 model gives them: through the model, such a
    rounding difference can move a later activation across a Q8_1 rounding boundary, a full quantization step."""
    path, _, expected = tiny
    model = load_gguf(path, dtype=torch.float32, quantize_activations=False)
    layers = gguf_layers(model).values()
    rounding, quantization = [], []

    def check(layer, args, out):
        x, weight = args[0], layer.dequantize()
        want = F.linear(q8_1_value(x), weight, layer.bias)
        rounding.append(max_err(out, want) / want.abs().max().item())
        quantization.append(max_err(out, F.linear(x, weight, layer.bias)) / want.abs().max().item())

    with torch.no_grad():
        reference = expected(TINY_TOKENS).logits
        assert torch.equal(model(TINY_TOKENS).logits, reference)
        set_mode(model, True)
        hooks = [layer.register_forward_hook(check) for layer in layers]
        model(TINY_TOKENS)
        for hook in hooks:
            hook.remove()
    assert len(rounding) == len(layers) and max(rounding) <= 1e-5, rounding
    assert min(quantization) > 100 * max(rounding), quantization  # the activations were quantized


@pytest.mark.parametrize("output", [None, "F32", "Q8_0"])
def test_load_gguf_lm_head_kept_where_untied(tmp_path, output):
    """A file without an lm_head of its own (a tied model's): the head stays transformers' tied embedding; an F32
    head stays an nn.Linear, named in the report; a quantized one is kept as blocks, and the model's logits are
    transformers' own bit for bit (W4A16)."""
    from transformers import AutoModelForCausalLM

    path = tmp_path / "tiny.gguf"
    write_tiny_model(path, "llama", {"output": output})
    model = load_gguf(path, dtype=torch.float32, quantize_activations=False)
    head, report = model.get_output_embeddings(), model.gguf_report
    if output is None:
        assert head.weight is model.get_input_embeddings().weight and "lm_head" not in report.dequantized
    elif output == "F32":
        assert type(head) is torch.nn.Linear and report.dequantized["lm_head"].startswith("F32: not supported")
    else:
        assert isinstance(head, GGUFLinear) and report.quantized["lm_head"] == head.kind == "Q8_0"
    expected = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(model(TINY_TOKENS).logits, expected(TINY_TOKENS).logits)


@pytest.mark.parametrize("patched", [False, True])
def test_resize_token_embeddings_dequantizes_a_kept_lm_head(tmp_path, patched):
    """Rows are added to float weights only: resizing the vocabulary of a model whose lm_head is kept as blocks turns
    the head into an nn.Linear holding the dequantized weight (named in the report), and the old tokens' logits stay
    those of the kept head (W4A16: the same dequantized weight either way), patched or not."""
    from patcher import patch_model

    path = tmp_path / "tiny.gguf"
    write_tiny_model(path, "llama")
    model = load_gguf(path, dtype=torch.float32, quantize_activations=False)
    if patched:
        patch_model(model)
    with torch.no_grad():
        before = model(TINY_TOKENS).logits
    vocab = before.shape[-1]
    model.resize_token_embeddings(vocab + 16, mean_resizing=False)
    head, report = model.get_output_embeddings(), model.gguf_report
    assert type(head) is torch.nn.Linear and head.weight.shape == (vocab + 16, head.in_features)
    assert "lm_head" not in report.quantized and report.dequantized["lm_head"].startswith("Q6_K: dequantized by")
    with torch.no_grad():
        after = model(TINY_TOKENS).logits
    assert after.shape[-1] == vocab + 16 and torch.equal(after[..., :vocab], before)


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_save_pretrained_writes_what_transformers_gguf_loading_holds(tmp_path, architecture):
    """save_pretrained writes each kept linear's dequantized weight (and bias) as a dense one: from_pretrained of the
    folder gives the logits of transformers' own GGUF model, and the model keeps its blocks. So does the model after
    a torch.save / torch.load round trip (which wrote the blocks) and a deepcopy."""
    from transformers import AutoModelForCausalLM

    path = tmp_path / "tiny.gguf"
    write_tiny_model(path, architecture)
    model = load_gguf(path, dtype=torch.float32, quantize_activations=False)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    expected = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    for i, saving in enumerate((model, torch.load(buffer, weights_only=False), copy.deepcopy(model))):
        saving.save_pretrained(tmp_path / f"saved{i}")
        assert isinstance(saving.get_output_embeddings(), GGUFLinear) and "lm_head.qweight" in saving.state_dict()
        reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / f"saved{i}", dtype=torch.float32).eval()
        assert reloaded.state_dict().keys() == expected.state_dict().keys()
        with torch.no_grad():
            assert torch.equal(reloaded(TINY_TOKENS).logits, expected(TINY_TOKENS).logits)
            assert torch.equal(saving(TINY_TOKENS).logits, expected(TINY_TOKENS).logits)


def test_load_gguf_dtype_and_refusals(tiny, tmp_path):
    """In bf16, W4A16 gives the logits of transformers' bf16 model (the same dequantized weights, cast once)."""
    from transformers import AutoModelForCausalLM

    path, _, _ = tiny
    model = load_gguf(path, dtype=torch.bfloat16)
    layer = next(iter(gguf_layers(model).values()))
    assert layer.quantize_activations and layer.qweight.dtype == torch.uint8
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    with torch.no_grad():
        assert model(TINY_TOKENS).logits.dtype == torch.bfloat16
        set_mode(model, False)
        expected = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.bfloat16)
        assert torch.equal(model(TINY_TOKENS).logits, expected.eval()(TINY_TOKENS).logits)
    with pytest.raises(FileNotFoundError):
        load_gguf(tmp_path / "missing.gguf")
    with pytest.raises(NotImplementedError, match="one device"):
        load_gguf(path, device_map={"": "cpu"})


@pytest.mark.gpu
@pytest.mark.parametrize("quantize_activations", [False, True])
def test_load_gguf_on_cuda_matches_the_cpu(tiny, quantize_activations):
    """Two prompts of 9 tokens (18 rows: the GEMM path of the GPU) give the CPU's logits up to fp32 rounding. With
    W4A8 that rounding may move an activation lying on a Q8_1 rounding edge by a whole step, which later layers carry
    to the logits (0.05 here on an H200, 0.14 of what quantizing the activations changes): within half of that."""
    path, _, _ = tiny
    cpu = load_gguf(path, dtype=torch.float32, quantize_activations=quantize_activations)
    cuda = load_gguf(path, dtype=torch.float32, device_map="cuda", quantize_activations=quantize_activations)
    assert all(layer.qweight.is_cuda for layer in gguf_layers(cuda).values())
    with torch.no_grad():
        expected = cpu(TINY_TOKENS).logits
        got = cuda(TINY_TOKENS.cuda()).logits.cpu()
        set_mode(cpu, False)
        quantization = max_err(expected, cpu(TINY_TOKENS).logits)  # 0 for W4A16
    assert max_err(got, expected) <= 1e-4 * expected.abs().max().item() + 0.5 * quantization
