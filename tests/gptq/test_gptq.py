"""GPTQ 4-bit checkpoints: the format, the reference dequantization, the pack tool, load_gptq, and the trained
SmolLM2 packed to int4 (CPU reference backend; on the GPU the int4 kernels and the graph-captured decode).

The cross-check against optimum + gptqmodel (the loader transformers 5 itself uses) runs where those are installed;
.ci/run installs them in an environment of their own.
"""

from __future__ import annotations

import copy
import importlib.util
import json

import pytest
import torch
from conftest import (
    FP32_LOGIT_ATOL,
    assert_within_torch_error,
    max_err,
    smollm2_gguf,
    smollm2_transformers,
    wikitext_path,
)
from gptq_models import EAGER

from patcher import load_gptq, patch_model, unpatch_model
from patcher import random_models as rm
from patcher.decode import DecodeRunner, Sampling, generate_path
from patcher.gptq import format as fmt
from patcher.gptq.linear import GPTQLinear
from patcher.gptq.pack import main as pack_main
from patcher.gptq.pack import pack_model, quantize


def test_pack_and_unpack_round_trip_every_nibble():
    values = torch.randint(0, 16, (64, 24))
    values[7::8] = 15  # the top nibble of a word: the int32 goes negative
    packed = fmt.pack_rows(values)
    assert packed.dtype == torch.int32 and packed.shape == (8, 24) and (packed < 0).any()
    assert torch.equal(fmt.unpack_rows(packed).long(), values)
    zeros = torch.randint(0, 16, (3, 40))
    assert torch.equal(fmt.unpack_cols(fmt.pack_cols(zeros)).long(), zeros)


def dequantize_by_hand(qweight, qzeros, scales, g_idx, version):
    """An independent reading of the format: one element at a time, with Python integers."""
    K, N = qweight.shape[0] * 8, qweight.shape[1]
    out = torch.empty(K, N, dtype=scales.dtype)
    words, zwords = qweight.tolist(), qzeros.tolist()
    for k in range(K):
        g = int(g_idx[k])
        for n in range(N):
            q = ((words[k // 8][n] & 0xFFFFFFFF) >> (4 * (k % 8))) & 0xF
            z = ((zwords[g][n // 8] & 0xFFFFFFFF) >> (4 * (n % 8))) & 0xF
            z = z + 1 if version == 1 else z
            out[k, n] = scales[g, n] * torch.tensor(q - z, dtype=scales.dtype)
    return out


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
@pytest.mark.parametrize("act_order", [False, True])
def test_dequantize_is_bit_exact(act_order, group_size, version):
    K, N = 256, 16
    g = torch.Generator().manual_seed(group_size + version)
    qweight = torch.randint(-(2**31), 2**31 - 1, (K // 8, N), dtype=torch.int32, generator=g)
    groups = fmt.groups_for(K, group_size)
    qzeros = torch.randint(-(2**31), 2**31 - 1, (groups, N // 8), dtype=torch.int32, generator=g)
    scales = (torch.rand(groups, N, generator=g) * 0.01).half()
    g_idx = fmt.default_g_idx(K, group_size)
    if act_order:
        g_idx = g_idx[torch.randperm(K, generator=g)]
    got = fmt.dequantize(qweight, qzeros, scales, g_idx, version)
    assert torch.equal(got, dequantize_by_hand(qweight, qzeros, scales, g_idx, version))


@pytest.mark.parametrize("sym", [False, True])
@pytest.mark.parametrize("group_size", [32, 128, -1])
@pytest.mark.parametrize("act_order", [False, True])
def test_round_to_nearest_error_is_half_a_step(act_order, group_size, sym):
    w = torch.randn(48, 256)
    order = torch.randperm(256) if act_order else None
    t = quantize(w, group_size, sym, order)
    permuted = bool((t["g_idx"][:-1] > t["g_idx"][1:]).any())  # groups out of order: act-order with > 1 group
    assert t["g_idx"].shape == (256,) and permuted == (act_order and group_size != -1)
    restored = fmt.dequantize(t["qweight"], t["qzeros"], t["scales"], t["g_idx"]).float().T
    step = t["scales"][t["g_idx"].long()].T.float()
    # half a quantization step, plus the fp16 rounding of the dequantized value and sym's +7.5 edge
    assert ((restored - w).abs() / step).max() <= 0.51


def dense_reference(model):
    """The same model with every GPTQLinear replaced by an nn.Linear holding its dequantized weight."""
    ref = copy.deepcopy(model)
    for name, module in list(ref.named_modules()):
        if isinstance(module, GPTQLinear):
            linear = torch.nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
            linear = linear.to(module.scales.device, model.dtype)
            linear.weight.data = module.dequantize().to(model.dtype).T.contiguous()
            if module.bias is not None:
                linear.bias.data = module.bias.to(model.dtype)
            parent, _, child = name.rpartition(".")
            setattr(ref.get_submodule(parent), child, linear)
    return ref


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-pythia"])
@pytest.mark.parametrize("act_order", [False, True])
def test_pack_tool_and_load_gptq(name, act_order, tmp_path):
    source = rm.build(name)
    source.save_pretrained(tmp_path / "src")
    args = [str(tmp_path / "src"), str(tmp_path / "q"), "--group-size", "64"] + (["--act-order"] if act_order else [])
    assert pack_main(args) == 0
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert config["quantization_config"]["desc_act"] is act_order
    model = load_gptq(tmp_path / "q", dtype=torch.float32)
    layers = model.config.num_hidden_layers
    per_layer = 4 if name == "tiny-pythia" else 7
    assert sum(isinstance(m, GPTQLinear) for m in model.modules()) == per_layer * layers
    ids = torch.randint(3, 500, (2, 11))
    with torch.no_grad():
        got = model(ids).logits
        assert max_err(got, dense_reference(model)(ids).logits) <= FP32_LOGIT_ATOL
    # save_pretrained writes the GPTQ tensors and settings back: the reloaded model is the same
    model.save_pretrained(tmp_path / "again")
    with torch.no_grad():
        assert torch.equal(load_gptq(tmp_path / "again", dtype=torch.float32)(ids).logits, got)


def test_v1_and_v2_checkpoints_read_the_same(tmp_path):
    source = rm.build("tiny-llama")
    pack_model(source, tmp_path / "v1", group_size=32, sym=False, checkpoint_format="gptq")
    pack_model(source, tmp_path / "v2", group_size=32, sym=False, checkpoint_format="gptq_v2")
    ids = torch.randint(3, 500, (1, 9))
    with torch.no_grad():
        a = load_gptq(tmp_path / "v1", dtype=torch.float32)(ids).logits
        b = load_gptq(tmp_path / "v2", dtype=torch.float32)(ids).logits
    assert torch.equal(a, b)


def test_load_gptq_rejects_what_it_cannot_read(tmp_path):
    pack_model(rm.build("tiny-llama"), tmp_path / "q", group_size=64)
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    for change, message in [
        ({"bits": 8}, "only 4-bit"),
        ({"quant_method": "awq"}, "not GPTQ"),
        ({"checkpoint_format": "marlin"}, "checkpoint_format"),
    ]:
        broken = {**config, "quantization_config": {**config["quantization_config"], **change}}
        (tmp_path / "q" / "config.json").write_text(json.dumps(broken))
        with pytest.raises(ValueError, match=message):
            load_gptq(tmp_path / "q")
    with pytest.raises(NotImplementedError, match="one device"):
        load_gptq(tmp_path / "q", device_map={"": "cpu"})
    with pytest.raises(FileNotFoundError):
        load_gptq(tmp_path / "nowhere")


needs_smollm2 = pytest.mark.skipif(
    smollm2_gguf() is None or wikitext_path() is None, reason="needs the SmolLM2 GGUF and WikiText"
)


@pytest.fixture(scope="module")
def smollm2_int4(tmp_path_factory):
    """The trained SmolLM2 packed to int4 g128 as `python -m patcher.gptq.pack GGUF DST --group-size 128` packs it
    (asymmetric, v1), from the test process's one read of the file (once for the module)."""
    path = tmp_path_factory.mktemp("smollm2") / "q"
    model, tokenizer = smollm2_transformers()
    pack_model(model, path, group_size=128, sym=False, checkpoint_format="gptq", tokenizer=tokenizer)
    return path


def wikitext_ids(path, rows: int, length: int) -> torch.Tensor:
    """`rows` WikiText lines of more than 200 characters, their first `length` tokens each, stacked [rows, length]."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    lines = [line for line in wikitext_path().read_text(encoding="utf-8").split("\n") if len(line) > 200][:rows]
    return torch.cat([tokenizer(line, return_tensors="pt").input_ids[:, :length] for line in lines])


@pytest.mark.slow
@needs_smollm2
def test_smollm2_int4_g128(smollm2_int4):
    """The trained SmolLM2 packed to int4 g128: loads, matches its dequantized reference, and stays a language model."""
    model = load_gptq(smollm2_int4, dtype=torch.float32)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_int4)
    ids = tokenizer(wikitext_path().read_text(encoding="utf-8")[:4000], return_tensors="pt").input_ids[:, :256]
    with torch.no_grad():
        out = model(ids, labels=ids)
        assert max_err(out.logits, dense_reference(model)(ids).logits) <= 1e-4 * out.logits.abs().max().item()
    assert torch.exp(out.loss).item() < 100  # a trained model on WikiText (fp16 SmolLM2: about 18 on the full text)


SMOLLM2_NEW_TOKENS = 16


@pytest.mark.slow
@needs_smollm2
@pytest.mark.filterwarnings("ignore:patcher. generate uses transformers' loop")  # expected on the CPU
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_smollm2_int4_patched_matches_reference(device, smollm2_int4):
    """The trained SmolLM2 int4 g128, patched, against the same checkpoint unpatched (GPTQLinear: dequantize, then
    matmul), at batch 1 and 4: the prefill logits over prompt + generated tokens, and the logits of every decode step
    on those tokens (the runner's step run again at each position of its cache: on the GPU the int4 decode kernels).
    The 2x rule: the patched model's error at most twice the unpatched model's in the same dtype, both against the
    unpatched model in the next precision up. CPU: reference backend, fp32 against fp64. GPU: the int4 kernels and
    the graph-captured decode (which made the tokens), fp16 against fp32."""
    dtype, precise_dtype = (torch.float16, torch.float32) if device == "cuda" else (torch.float32, torch.float64)
    model = load_gptq(smollm2_int4, dtype=dtype, device_map=device)
    model.generation_config.eos_token_id = None
    precise = load_gptq(smollm2_int4, dtype=precise_dtype, device_map=device)
    prompts = wikitext_ids(smollm2_int4, 4, 24).to(device)
    T = prompts.shape[1]
    patch_model(model)
    got = {}
    with torch.no_grad():
        for batch in (1, 4):
            p = prompts[:batch]
            tokens = model.generate(p, attention_mask=torch.ones_like(p), max_new_tokens=SMOLLM2_NEW_TOKENS)
            if device == "cuda":
                assert generate_path(model)["path"] == "graph"
                runner = model._patcher_state.runner
            else:  # HF's loop runs the patched model on the CPU; the decode runner (no graphs) must agree with it
                runner = DecodeRunner(model, EAGER)
                assert torch.equal(
                    runner.generate(p, torch.ones_like(p), SMOLLM2_NEW_TOKENS, Sampling(), [], 0), tokens
                )
            st = runner.states[batch]
            assert torch.equal(st.tokens[:, : tokens.shape[1]], tokens)
            steps = []
            for slot in range(T, tokens.shape[1] - 1):  # the step whose input is the token at `slot`
                st.slot.fill_(slot)
                steps.append(runner.logits(st))
            got[batch] = (tokens, model(tokens).logits, torch.stack(steps, 1))
    unpatch_model(model)
    with torch.no_grad():
        for batch, (tokens, prefill, steps) in got.items():
            at_steps = slice(T, tokens.shape[1] - 1)
            low, ref = model(tokens).logits, precise(tokens).logits
            assert_within_torch_error(prefill, low, ref, f"batch {batch} prefill logits")
            assert_within_torch_error(steps, low[:, at_steps], ref[:, at_steps], f"batch {batch} decode-step logits")


HAS_GPTQMODEL = all(importlib.util.find_spec(name) is not None for name in ("gptqmodel", "optimum"))


@pytest.mark.skipif(not HAS_GPTQMODEL, reason="needs optimum + gptqmodel (.ci/run installs them separately)")
@pytest.mark.parametrize("act_order", [False, True])
def test_dequantization_matches_gptqmodel(act_order, tmp_path):
    """Our reading of a packed checkpoint against the one transformers 5 uses (optimum + gptqmodel), bit for bit."""
    from transformers import AutoModelForCausalLM

    pack_model(rm.build("tiny-llama"), tmp_path, group_size=64, act_order=act_order, sym=False)
    ours = load_gptq(tmp_path, dtype=torch.float16)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, device_map="cpu", dtype=torch.float16)
    compared = 0
    for name, module in ours.named_modules():
        if isinstance(module, GPTQLinear):
            assert torch.equal(module.dequantize(), theirs.get_submodule(name).dequantize_weight()), name
            compared += 1
    assert compared == 7 * ours.config.num_hidden_layers
