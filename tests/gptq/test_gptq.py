"""GPTQ 4-bit checkpoints: the format, the reference dequantization, the pack tool, load_gptq, and patched int4
models (CPU reference backend; on the GPU the int4 kernels and the graph-captured decode).

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
from streams import one_and_two_stream_tokens

from patcher import load_gptq, patch_model, unpatch_model
from patcher import random_models as rm
from patcher.decode import DecodeOptions, DecodeRunner, Sampling, generate_path, int4_plan
from patcher.gptq import format as fmt
from patcher.gptq.linear import GPTQLinear
from patcher.gptq.pack import main as pack_main
from patcher.gptq.pack import pack_model, quantize
from patcher.ops import int4 as int4_ops

EAGER = DecodeOptions(use_graphs=False)


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


def test_split_rule_keeps_the_group_stage_within_the_kernel_limit():
    """The decode-step split rule raises splits until a K slice's scales and zero points fit the tensor-core
    kernel's shared memory (kernels/int4.cu: int4_group_stage_bytes): a Llama-70B-sized gate/up at group size 32
    fills the SMs with one slice per tile, whose 256 groups would take 80 KB."""
    meta = {"dtype": torch.int32, "device": "meta"}
    lin = int4_ops.Int4Linear(
        [torch.empty(1024, 28672, **meta)] * 2, [], [], [], [None, None], 32, False, 1
    )  # K 8192, gate | up
    assert int4_ops.group_stage_bytes(lin, 1) == 256 * 128 * 5 // 2
    splits = int4_ops.splits_for(1, lin, multiprocessors=132)
    assert splits == 2 and int4_ops.group_stage_bytes(lin, splits) <= int4_ops.GROUP_STAGE_BYTES
    # A slice that does not start on a group boundary may span two groups more than its length holds.
    odd = int4_ops.Int4Linear([torch.empty(300, 256, **meta)], [], [], [], [None], 64, False, 1)  # K 2400
    assert int4_ops.group_stage_bytes(odd, 7) == (5 + 2) * 128 * 5 // 2  # slices of 44 rows: 352 k, 5.5 groups
    act = int4_ops.Int4Linear([torch.empty(300, 256, **meta)], [], [], [], [None], 32, True, 1)
    assert int4_ops.group_stage_bytes(act, 1) == 0  # act-order takes the CUDA-core kernel


def test_split_rule_sizes_the_x_stage_by_the_kernel():
    """The split rule's x stage (kernels/int4/int4.cu: int4_stage_bytes, 32 KB): the tensor-core kernel (fp16/bf16, no
    act-order) holds x in 2 bytes an element, in whole 4-row steps of a slice; the CUDA-core kernel (fp32 or act-order)
    in 4. At 8 rows Llama-3.1-8B's gate/up then takes 2 K slices in fp16 and 4 in fp32,
    its down 8 and 14; at one row both dtypes take the same slices."""
    meta = {"dtype": torch.int32, "device": "meta"}

    def linear(k, widths, act_order=False):
        return int4_ops.Int4Linear([torch.empty(k // 8, n, **meta) for n in widths], [], [], [], [None] * len(widths),
                                   128, act_order, 1)  # fmt: skip

    gate_up, down = linear(4096, [14336, 14336]), linear(14336, [4096])
    for lin, fp16, fp32 in ((gate_up, 2, 4), (down, 8, 14)):
        assert int4_ops.splits_for(8, lin, 132, dtype=torch.float16) == fp16
        assert int4_ops.splits_for(8, lin, 132, dtype=torch.bfloat16) == fp16
        assert int4_ops.splits_for(8, lin, 132, dtype=torch.float32) == fp32
        assert int4_ops.splits_for(8, lin, 132) == fp32  # the default: a rule that holds for any dtype
        assert int4_ops.splits_for(1, lin, 132, dtype=torch.float16) == int4_ops.splits_for(1, lin, 132)
    assert int4_ops.stage_bytes(8, gate_up, 2, torch.float16) == int4_ops.STAGE_BYTES
    assert int4_ops.stage_bytes(8, linear(4096, [512], act_order=True), 2, torch.float16) == 2 * int4_ops.STAGE_BYTES
    assert int4_ops.stage_bytes(1, down, 3, torch.float16) == 600 * 8 * 2  # 597.3 rows a slice, in whole steps


def test_split_rule_leaves_room_for_the_attention():
    """Next to the decode attention (`beside`) an op takes fewer K slices where that lets every attention block fit
    beside its blocks on 132 SMs, unless that costs more than a quarter of its blocks in an op of more than 4 MB.
    Before the attention the op's blocks are spread first and the attention's take the SMs left with room; after it
    the op's fill the SMs around them. At one row: Llama-3.1-8B's QKV (48 tiles) 5 -> 4 and o_proj (32 tiles) 8 -> 7
    beside 32 half-SM blocks (4 and 6 at two rows; at four, 128 blocks leave room for 2 and 4: unchanged);
    Pythia-2.8B's output pair 13 -> 11, but not its QKV + MLP-input op (112 tiles of 160 threads, 3 an SM: 2 slices
    would be a third fewer blocks); Qwen2-7B's o_proj 9 -> 7 beside 28 whole-SM blocks, but not its QKV (7 -> 2);
    Qwen2-1.5B's QKV (1.6 MB) 12 -> 7, so that 12 SMs stay empty for its whole-SM blocks, its o_proj unchanged."""
    meta = {"dtype": torch.int32, "device": "meta"}

    def linear(k, widths):
        return int4_ops.Int4Linear(
            [torch.empty(k // 8, n, **meta) for n in widths],
            [torch.empty(k // 128, n // 8, **meta) for n in widths],
            [torch.empty(k // 128, n, dtype=torch.float16, device="meta") for n in widths],
            [], [None] * len(widths), 128, False, 1,
        )  # fmt: skip

    def splits(batch, lin, beside=None, head_dim=None):
        return int4_ops.splits_for(batch, lin, 132, head_dim, torch.float16, beside)

    Beside = int4_ops.Beside
    qkv, o_proj = linear(4096, [4096, 1024, 1024]), linear(4096, [4096])
    for batch, want_qkv, want_o in ((1, 4, 7), (2, 4, 6), (4, 5, 8)):
        assert (splits(batch, qkv), splits(batch, o_proj)) == (5, 8)
        got = splits(batch, qkv, Beside(32 * batch)), splits(batch, o_proj, Beside(32 * batch, before=False))
        assert got == (want_qkv, want_o), batch
    # at one row: 264 - 32 block slots (2 an SM, an attention block taking one of them)
    assert 48 * 4 <= 232 < 48 * 5 and 32 * 7 <= 232 < 32 * 8
    pair, qkv_mlp = linear(2560 + 10240, [2560]), linear(2560, [7680, 10240])
    assert (splits(1, pair), splits(1, pair, Beside(32, before=False))) == (13, 11)
    assert (splits(1, qkv_mlp, head_dim=80), splits(1, qkv_mlp, Beside(32), head_dim=80)) == (3, 3)
    whole = {"threads": 512}
    qkv_7b, o_7b = linear(3584, [3584, 512, 512]), linear(3584, [3584])
    assert (splits(1, qkv_7b), splits(1, qkv_7b, Beside(28, **whole))) == (7, 7)
    assert (splits(1, o_7b), splits(1, o_7b, Beside(28, **whole, before=False))) == (9, 7)
    qkv_15b, o_15b = linear(1536, [1536, 256, 256]), linear(1536, [1536])
    assert qkv_15b.nbytes() <= int4_ops.SMALL_OP_BYTES < qkv_7b.nbytes()
    assert (splits(1, qkv_15b), splits(1, qkv_15b, Beside(12, **whole))) == (12, 7)  # 112 blocks: 20 SMs empty
    assert (splits(1, o_15b), splits(1, o_15b, Beside(12, **whole, before=False))) == (12, 12)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-pythia"])
def test_decode_step_gives_the_attention_room_beside_its_neighbours(name, tmp_path, monkeypatch):
    """The decode runner passes the attention's blocks (query heads x rows) as `beside` for the int4 linears launched
    just before and after it (QKV or GPT-NeoX's QKV + MLP input; the output projection or pair) and for no other,
    each block half an SM, but a whole one for LLaMA's attention that finishes the QKV sums below
    ATTENTION_HALF_SM_BLOCKS blocks (kernels/decode_attention.cu)."""
    model = gptq_model(name, tmp_path)
    patch_model(model)
    heads = model.config.num_attention_heads
    for defer_qkv in (True, False):
        step = DecodeRunner(model, EAGER.replace(defer_qkv=defer_qkv)).decode_step

        # what the step launches next to the attention: GPT-NeoX's merged ops where it has them, else QKV and o_proj
        def launched_next(layer):
            if layer.qkv_mlp is not None:
                return layer.qkv_mlp, layer.out_pair
            return layer.attention.qkv_int4, layer.attention.out_int4

        near = {id(lin) for layer in step.layers for lin in launched_next(layer)}
        mlp = {id(lin) for layer in step.layers for lin in (layer.mlp.in_int4, layer.mlp.out_int4) if lin is not None}
        assert near and mlp and not near & mlp
        from_acc = name == "tiny-llama" and defer_qkv
        first = step.layers[0]
        for lin in (launched_next(first)[0], first.mlp.in_int4):
            for batch in (1, 8, int4_plan.ATTENTION_HALF_SM_BLOCKS // heads):
                beside = step.int4.attention_beside(batch, lin)
                if lin is first.mlp.in_int4:
                    assert beside is None
                    continue
                half_sm = not from_acc or heads * batch >= int4_plan.ATTENTION_HALF_SM_BLOCKS
                assert beside == int4_ops.Beside(heads * batch, 256 if half_sm else 512, before=True)
        seen = {}

        def record(batch, lin, sms, head_dim, dtype, beside, seen=seen):
            seen[id(lin)] = beside
            return 1

        monkeypatch.setattr(int4_ops, "splits_for", record)
        for lin, head in step.int4.linears.values():
            step.int4.splits(8, lin, head)
        monkeypatch.undo()
        assert {key for key, beside in seen.items() if beside is not None} == near
        assert {seen[key].before for key in near} == {True, False}
        assert all(seen[key].blocks == heads * 8 for key in near)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-pythia"])
def test_decode_runner_takes_k_slices_by_role(name, tmp_path):
    """DecodeOptions(int4_splits={role: slices}) runs the linears of those roles at those K slices (the others by the
    rule) and rejects what the step cannot take, with the reason: a role the model's step does not launch (GPT-NeoX's
    merged step runs qkv_mlp and out_pair in place of qkv, mlp_in, out and mlp_out), a count that is not a whole
    number >= 1, a count outside what the kernels take for that linear."""
    int4_roles = int4_plan.layer_roles
    model = gptq_model(name, tmp_path)
    patch_model(model)
    roles = ("qkv", "out", "mlp_in", "mlp_out") if name == "tiny-llama" else ("qkv_mlp", "out_pair")
    rule = DecodeRunner(model, EAGER)
    launched = {r for layer in rule.decode_step.layers for r, lin in int4_roles(layer).items() if lin is not None}
    assert launched == set(roles)
    ids, mask = torch.randint(3, 500, (1, 5)), torch.ones(1, 5, dtype=torch.long)
    tokens = rule.generate(ids, mask, 4, Sampling(), eos=[], pad_token_id=0)
    chosen = {roles[0]: 3, roles[1]: 2}
    runner = DecodeRunner(model, EAGER.replace(int4_splits=chosen))
    assert torch.equal(runner.generate(ids, mask, 4, Sampling(), eos=[], pad_token_id=0), tokens)
    # (GPT-NeoX's merged linears are made per runner)
    for layer, rule_layer in zip(runner.decode_step.layers, rule.decode_step.layers):
        by_rule = {
            r: rule.states[1].int4_splits[id(lin)] for r, lin in int4_roles(rule_layer).items() if lin is not None
        }
        got = {r: runner.states[1].int4_splits[id(lin)] for r, lin in int4_roles(layer).items() if lin is not None}
        assert got == {**by_rule, **chosen}
    other = "qkv_mlp" if name == "tiny-llama" else "qkv"
    for bad, message in (({other: 2}, f"no int4 linear of role {other!r}"), ({roles[0]: 0}, "whole number"),
                         ({roles[0]: 2.0}, "whole number"), ({roles[0]: True}, "whole number")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            DecodeRunner(model, EAGER.replace(int4_splits=bad))
    too_many = DecodeRunner(model, EAGER.replace(int4_splits={roles[0]: model.config.hidden_size}))
    with pytest.raises(ValueError, match=r"the int4 kernels take 1 to \d+ K slices"):
        too_many.generate(ids, mask, 2, Sampling(), eos=[], pad_token_id=0)


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


def gptq_model(name, tmp_path, act_order=False, dtype=torch.float32, device="cpu", group_size=64):
    pack_model(rm.build(name), tmp_path / "q", group_size=group_size, act_order=act_order)
    model = load_gptq(tmp_path / "q", dtype=dtype, device_map=device)
    model.generation_config.eos_token_id = None
    return model


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-pythia", "tiny-neox-sequential"])
@pytest.mark.parametrize("act_order", [False, True])
def test_patch_model_runs_gptq_models_on_int4_ops(name, act_order, tmp_path):
    """CPU, reference backend: the patched int4 model (restructured stack, int4 ops, the decode step with its fused
    norm prologues) computes what the unpatched GPTQ model computes; unpatch is bit-identical."""
    model = gptq_model(name, tmp_path, act_order)
    ids = torch.randint(3, 500, (2, 11))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        expected = model(ids).logits
        tokens = model.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, pad_token_id=0)
        report = patch_model(model)
        got = model(ids).logits
        runner = DecodeRunner(model, EAGER)
        decoded = runner.generate(ids, mask, 16, Sampling(), eos=[], pad_token_id=0)
    assert report.layers_restructured == model.config.num_hidden_layers and not report.unpatched
    assert all("int4" in r.detail for r in report.replaced if r.name.endswith(("attention", "mlp", "self_attn")))
    assert max_err(got, expected) <= FP32_LOGIT_ATOL
    assert torch.equal(decoded, tokens)
    unpatch_model(model)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, expected)


def test_int4_out_pair(tmp_path):
    """GPT-NeoX int4 (CPU, reference backend): patch_model stacks each layer's dense and dense_4h_to_h along k in one
    buffer that their tensors are views of (state_dict unchanged); the decode step runs them as one int4_gemv_cat,
    and QKV with the MLP's input projection as one int4_qkv_mlp_in, and its tokens and logits match the step with
    the five linears apart; unpatch gives each its own storage back. With act-order the output projections stay
    apart and the report says why."""
    model = gptq_model("tiny-pythia", tmp_path)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = patch_model(model)
    layer = model.gpt_neox.layers[0]
    dense, out = layer.attention.dense, layer.mlp.dense_4h_to_h
    storage = layer._patcher_out_qweight.untyped_storage().data_ptr()
    assert dense.qweight.untyped_storage().data_ptr() == out.qweight.untyped_storage().data_ptr() == storage
    assert all("one int4 GEMV" in r.detail for r in report.replaced if r.kind == "GPTNeoXLayer")
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())
    ids, mask = torch.randint(3, 500, (2, 11)), torch.ones(2, 11, dtype=torch.long)
    logits = {}
    with torch.no_grad():
        for use in (True, False):
            runner = DecodeRunner(model, EAGER.replace(merge_int4=use))
            steps = runner.decode_step.layers
            assert all((step.out_pair is not None) == use == (step.qkv_mlp is not None) for step in steps)
            tokens = runner.generate(ids, mask, 8, Sampling(), eos=[], pad_token_id=0)
            logits[use] = (tokens, runner.logits(runner.states[2]))
    assert torch.equal(logits[True][0], logits[False][0])
    assert max_err(logits[True][1], logits[False][1]) <= FP32_LOGIT_ATOL
    unpatch_model(model)
    assert dense.qweight.untyped_storage().data_ptr() != out.qweight.untyped_storage().data_ptr()
    assert not any(name.startswith("_patcher") for name in layer._buffers)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())

    act_order = gptq_model("tiny-pythia", tmp_path / "act", act_order=True)
    report = patch_model(act_order)
    assert all("apart (act-order" in r.detail for r in report.replaced if r.kind == "GPTNeoXLayer")
    assert DecodeRunner(act_order, EAGER).decode_step.layers[0].out_pair is None


def test_fixed_point_accumulators():
    """int4_gemv_acc's fixed point (value * 2^28 in int64): exact for fp32 values of magnitude 2^-5 or more, the
    rest within half a step of 2^-28; clamped to +-2^24 (NaN to -2^24), so 2^11 - 1 clamped terms still add up."""
    from patcher.ops.reference import FIXED_CLAMP, from_fixed, to_fixed

    v = torch.randn(10000) * torch.logspace(-12, 6, 10000, base=2.0)
    back = from_fixed(to_fixed(v), torch.float32)
    big = v.abs() >= 2.0**-5
    assert big.sum() > 1000 and torch.equal(back[big], v[big])
    assert (back[~big] - v[~big]).abs().max() <= 2.0**-29
    edge = to_fixed(torch.tensor([1e9, -1e9, float("nan"), float("inf")]))
    assert from_fixed(edge, torch.float32).tolist() == [FIXED_CLAMP, -FIXED_CLAMP, -FIXED_CLAMP, FIXED_CLAMP]
    assert from_fixed(edge[:1] * (2**11 - 1), torch.float32).item() == FIXED_CLAMP * (2**11 - 1)  # no overflow


def _quantized(n, k, group):
    """The int4 argument tuple (qweight, qzeros, scales, g_idx, bias, group, act_order, zero_offset) of a random
    [n, k] weight, one segment, no bias."""
    q = quantize(torch.randn(n, k) / k**0.5, group, sym=False)
    return [q["qweight"]], [q["qzeros"]], [q["scales"]], [q["g_idx"]], [None], group, False, 1


def test_int4_gemv_acc_reference():
    """CPU: int4_gemv_acc adds [x | x2] @ W into acc without rounding, bias or epilogue, zeroes `clear`, and rejects
    a bias; an int4 op reading acc as its prologue's delta, with the bias rows as delta2, computes what it computes
    from int4_gemv_cat's rounded, biased output."""
    from patcher.ops import KERNELS, reference

    torch.manual_seed(0)
    k1, k2, n = 128, 256, 96
    args = _quantized(n, k1 + k2, 64)
    bias = torch.randn(n).half()
    biased = (*args[:4], [bias], *args[5:])
    x, x2 = torch.randn(2, k1).half(), torch.randn(2, k2).half()
    start = torch.randint(-(2**40), 2**40, (2, n))
    acc, clear = start.clone(), torch.randint(1, 9, (5,))
    torch.library.opcheck(torch.ops.patcher.int4_gemv_acc.default, (x, x2, *args, 1, None, acc.clone(), clear.clone()))
    # the CPU dispatch: the reference (feeds_attention, as the decode step passes it, only places the CUDA trigger)
    KERNELS.int4_gemv_acc(x, x2, *args, 1, None, acc, clear, feeds_attention=True)
    assert int(clear.abs().sum()) == 0
    w = reference.int4_weight(args[0][0], args[1][0], args[2][0], args[3][0], 64, False, 1)
    exact = torch.cat([x, x2], -1).double() @ w.double()
    added = (acc - start).double() / reference.FIXED_SCALE
    assert (added - exact).abs().max() <= 1e-5 * exact.abs().max()
    with pytest.raises(ValueError, match="no bias"):
        reference.int4_gemv_acc(x, x2, *biased, 1, None, acc)
    with pytest.raises(ValueError, match="acc must be int64"):
        reference.int4_gemv_acc(x, x2, *args, 1, None, acc[:, :8])

    acc = torch.zeros(2, n, dtype=torch.int64)
    reference.int4_gemv_acc(x, x2, *args, 1, None, acc)
    out = reference.int4_gemv_cat(x, x2, *biased, 1, None)
    residual, norm_w = torch.randn(2, n).half(), torch.rand(n).half() + 0.5
    reader = (*_quantized(32, n, 32), "none", 1, None)
    norm = (norm_w, None, None, None, 1e-6, True)
    from_acc = reference.int4_gemv(residual, acc, bias.expand(2, n).contiguous(), *norm, *reader)
    from_out = reference.int4_gemv(residual, out, None, *norm, *reader)
    # round(round(bias + round(acc)) + residual) against round(round(round(acc) + bias) + residual): the same sums,
    # but where the fp32 product and the fp16 matmul round the last bit apart
    assert max_err(from_acc[1], from_out[1]) <= 2e-3 * from_out[1].abs().max()
    assert max_err(from_acc[0], from_out[0]) <= 2e-3 * from_out[0].abs().max()


def test_qkv_acc_reference():
    """CPU: the QKV projection handed on unmet and finished by the attention (runner.py) against the op it replaces:
    int4_norm_gemv_acc gives int4_gemv's residual sum and the product unrounded in acc; decode_attention_qkv_acc
    over it (the bias as rows) writes the current token's K/V at slot only and attends as decode_attention does over
    int4_gemv's rounded, biased output through rope_qkv_cache (within fp16 rounding: the fixed point may round a last
    bit apart)."""
    from patcher.ops import KERNELS, reference

    torch.manual_seed(0)
    hq, hkv, d, k, slot = 4, 2, 8, 64, 5
    n = (hq + 2 * hkv) * d
    args = _quantized(n, k, 32)
    bias = torch.randn(n).half()
    biased = (*args[:4], [bias], *args[5:])
    x, delta, w = torch.randn(2, k).half(), torch.randn(2, k).half(), torch.rand(k).half() + 0.5
    pro = (x, delta, None, w, None, None, None, 1e-6, True)
    acc, clear = torch.zeros(2, n, dtype=torch.int64), torch.ones(7, dtype=torch.int64)
    ops = torch.ops.patcher
    torch.library.opcheck(ops.int4_norm_gemv_acc.default, (*pro, *args, 1, None, acc.clone(), clear.clone()))
    total, h2 = KERNELS.int4_norm_gemv_acc(*pro, *args, 1, None, acc, clear)  # the CPU dispatch: the reference
    qkv, total_ref, _ = reference.int4_gemv(*pro, *biased, "none", 1, None)
    assert torch.equal(total, total_ref) and h2.numel() == 0 and int(clear.abs().sum()) == 0

    angles = torch.randn(16, d // 2) * 3
    cos, sin = torch.cat([angles, angles], -1).cos().half(), torch.cat([angles, angles], -1).sin().half()
    caches = [torch.randn(2, hkv, 16, d).half() for _ in range(2)]
    expected_caches = [c.clone() for c in caches]
    slots, pad = torch.tensor([slot]), torch.tensor([0, 2])
    rows = bias.expand(2, n).contiguous()
    tail = (hq, False, d**-0.5, 1, None)
    torch.library.opcheck(ops.decode_attention_qkv_acc.default,
                          (acc, rows, cos, sin, slots, pad, *[c.clone() for c in caches], *tail))  # fmt: skip
    out = KERNELS.decode_attention_qkv_acc(acc, rows, cos, sin, slots, pad, *caches, *tail)
    q = reference.rope_qkv_cache(qkv, cos, sin, slots, pad, *expected_caches, hq, hkv, d, False)
    expected = reference.decode_attention(q, *expected_caches, slots, pad, d**-0.5, 1, None)
    assert max_err(out, expected) <= 4e-3 * expected.abs().max()
    keep = torch.arange(16) != slot
    for got, want in zip(caches, expected_caches):
        assert torch.equal(got[:, :, keep], want[:, :, keep])
        assert max_err(got[:, :, slot], want[:, :, slot]) <= 4e-3 * want[:, :, slot].abs().max()


def deferred_expected(runner) -> set:
    """The (kind, layer) producers that should run as int4_gemv_acc (with defer_qkv also the QKV projections, as
    int4_norm_gemv_acc) in an all-int4 model (decode/int4_plan.py)."""
    step = runner.decode_step
    layers = range(step.num_layers)  # the last layer's output projection too: the final norm reads its sums
    if step.parallel:
        return {("out", i) for i in layers}
    kinds = ("qkv", "attn_out", "mlp_out") if runner.options.defer_qkv else ("attn_out", "mlp_out")
    return {(kind, i) for kind in kinds for i in layers}


def check_accumulators(runner, batch: int) -> None:
    """After a step: each producer zeroes the accumulator of the producer of its kind before it, so of each kind only
    the last one's holds a sum (which the next step's first producer zeroes)."""
    st = runner.states[batch]
    for kind in {k for k, _ in st.deferred}:
        keys = sorted(key for key in st.deferred if key[0] == kind)
        assert all(st.deferred[key].clear is st.deferred[prev].acc for prev, key in zip(keys[-1:] + keys[:-1], keys))
        assert [bool(st.deferred[key].acc.any()) for key in keys] == [False] * (len(keys) - 1) + [True], kind


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-pythia", "tiny-neox-sequential"])
def test_int4_output_projections_hand_on_unmet_sums(name, tmp_path):
    """CPU, reference backend: the decode step runs every int4 output projection whose output an int4 norm prologue
    reads as int4_gemv_acc (runner.py; the biases of GPT-NeoX's as the reader's delta2), and gives the tokens and
    logits of the step with the K slices meeting (defer_int4=False), over steps that reuse every accumulator; so
    does the step whose QKV projections the attention finishes too (defer_qkv, the default; LLaMA/Qwen2)."""
    model = gptq_model(name, tmp_path)
    patch_model(model)
    ids, mask = torch.randint(3, 500, (2, 11)), torch.ones(2, 11, dtype=torch.long)
    results = {}
    with torch.no_grad():
        for defer in ("qkv", True, False):
            runner = DecodeRunner(model, EAGER.replace(defer_int4=bool(defer), defer_qkv=defer == "qkv"))
            assert set(runner.decode_step.int4.deferred) == (deferred_expected(runner) if defer else set())
            tokens = runner.generate(ids, mask, 8, Sampling(), eos=[], pad_token_id=0)
            results[defer] = (tokens, runner.logits(runner.states[2]))
            if defer:
                check_accumulators(runner, 2)
                # as a step cut short would leave them: generate starts from zeros again
                for d in runner.states[2].deferred.values():
                    d.acc.random_(-(2**40), 2**40)
                assert torch.equal(runner.generate(ids, mask, 8, Sampling(), eos=[], pad_token_id=0), tokens)
    for defer in ("qkv", True):
        assert torch.equal(results[defer][0], results[False][0])
        assert max_err(results[defer][1], results[False][1]) <= FP32_LOGIT_ATOL


def randomize_norms(model, seed=0):
    """Random weights and biases for every norm (HF initializes them to ones and zeros, which makes GPT-NeoX's two
    LayerNorms of a layer equal, so that a step reading one for the other would pass)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__.endswith("Norm"):
                module.weight.copy_(1 + 0.3 * torch.randn(module.weight.shape, generator=g))
                if getattr(module, "bias", None) is not None:
                    module.bias.copy_(0.1 * torch.randn(module.bias.shape, generator=g))


# (model, DecodeOptions fields, int4_norm_prologue calls a layer): every path of the step through an int4 norm op.
NORM_IN_FRONT = [
    ("tiny-llama", {}, 2),  # QKV as int4_gemv_acc (the attention finishes it), gate/up
    ("tiny-llama", {"defer_qkv": False}, 2),  # QKV as int4_qkv_rope_cache
    ("tiny-qwen2", {}, 2),
    ("tiny-pythia", {}, 1),  # both LayerNorms in front of int4_qkv_mlp_in
    ("tiny-pythia", {"merge_int4": False}, 1),  # ... of int4_qkv_rope_cache and the MLP's int4_gemv on h2
    ("tiny-neox-sequential", {}, 2),
]


@pytest.mark.parametrize("name,kwargs,per_layer", NORM_IN_FRONT)
def test_int4_norm_in_front(name, kwargs, per_layer, tmp_path, monkeypatch):
    """CPU, reference backend: from DecodeOptions.int4_separate_norm_batch rows on (every batch size by default),
    the decode step runs each int4 op's add + norm as int4_norm_prologue in front of it, the op reading h (and h2),
    and the final norm as int4_norm_prologue where the last layer's sums come unmet (at any batch size), and gives
    the tokens and logits of the step with the norms inside the ops (int4_separate_norm_batch above the batch
    size)."""
    model = gptq_model(name, tmp_path)
    randomize_norms(model)
    patch_model(model)
    ids, mask = torch.randint(3, 500, (2, 11)), torch.ones(2, 11, dtype=torch.long)
    results = {}
    with torch.no_grad():
        for in_front in (True, False):
            options = EAGER.replace(int4_separate_norm_batch=2 if in_front else 9, **kwargs)
            runner = DecodeRunner(model, options)
            tokens = runner.generate(ids, mask, 8, Sampling(), eos=[], pad_token_id=0)
            calls = []
            ops = runner.decode_step.ops
            monkeypatch.setattr(
                ops, "int4_norm_prologue", lambda *a, f=ops.int4_norm_prologue, c=calls: c.append(1) or f(*a)
            )
            results[in_front] = (tokens, runner.logits(runner.states[2]))
            monkeypatch.undo()
            assert runner.states[2].int4_separate_norm == in_front
            layers = model.config.num_hidden_layers
            # and the final norm where the last layer's output projection leaves its sums unmet
            deferred = runner.decode_step.int4.deferred
            final = int(any(kind in ("mlp_out", "out") and i == layers - 1 for kind, i in deferred))
            assert len(calls) == (per_layer * layers if in_front else 0) + final
    assert torch.equal(results[True][0], results[False][0])
    assert torch.equal(results[True][1], results[False][1])


def test_gptq_layers_the_kernels_cannot_read_are_left_with_a_reason(tmp_path):
    model = gptq_model("tiny-qwen2", tmp_path)
    model.model.layers[1].self_attn.k_proj.scales.data = model.model.layers[1].self_attn.k_proj.scales.float()
    ids = torch.randint(3, 500, (1, 9))
    with torch.no_grad():
        expected = model(ids).logits
        report = patch_model(model)
        got = model(ids).logits
    assert report.layers_restructured == model.config.num_hidden_layers - 1
    assert len(report.unpatched) == 1 and "scales in torch.float32" in report.unpatched[0].detail
    assert max_err(got, expected) <= FP32_LOGIT_ATOL


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-pythia"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("act_order", [False, True])
def test_int4_model_on_the_gpu(name, dtype, act_order, tmp_path):
    """GPU: patched int4 logits within the 2x rule of the unpatched GPTQ model (both against its fp32 run); the
    graph-captured decode equals the same step run eagerly, batch 1 and 3."""
    model = gptq_model(name, tmp_path, act_order, dtype=dtype, device="cuda")
    ids = torch.randint(3, 500, (3, 13), device="cuda")
    mask = torch.ones_like(ids)
    with torch.no_grad():
        ref32 = load_gptq(tmp_path / "q", dtype=torch.float32, device_map="cuda")(ids).logits
        hf = model(ids).logits
        patch_model(model)
        got = model(ids).logits
    assert_within_torch_error(got, hf, ref32, f"{name} int4 logits")
    for batch in (1, 3):
        eager = DecodeRunner(model, EAGER).generate(ids[:batch], mask[:batch], 24, Sampling(), eos=[], pad_token_id=0)
        graph = model.generate(ids[:batch], attention_mask=mask[:batch], max_new_tokens=24, do_sample=False)
        assert generate_path(model)["path"] == "graph"
        assert torch.equal(graph, eager)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-pythia", "tiny-neox-sequential"])
def test_int4_unmet_sums_on_the_gpu(name, tmp_path):
    """GPU: the graph-captured decode with the int4 output projections as int4_gemv_acc leaves the accumulators
    zeroed in turn across replays, and one step on the same cache and tokens gives the logits of the step with the
    K slices meeting (defer_int4=False) within fp16 rounding (a missing bias, a stale or doubled sum: O(1) off); so
    does the step whose QKV projections the attention finishes too (defer_qkv, the default)."""
    model = gptq_model(name, tmp_path, False, dtype=torch.float16, device="cuda")
    patch_model(model)
    ids = torch.randint(3, 500, (3, 13), device="cuda")
    mask = torch.ones_like(ids)
    runners = {defer: DecodeRunner(model, DecodeOptions(defer_int4=defer, defer_qkv=False)) for defer in (True, False)}
    runners["qkv"] = DecodeRunner(model, DecodeOptions(defer_int4=True, defer_qkv=True))
    with torch.no_grad():
        for runner in runners.values():
            runner.generate(ids, mask, 16, Sampling(), eos=[], pad_token_id=0)
            assert runner.states[3].graph is not None
        for defer in (True, "qkv"):
            assert set(runners[defer].decode_step.int4.deferred) == deferred_expected(runners[defer])
            check_accumulators(runners[defer], 3)
        states = {defer: runner.states[3] for defer, runner in runners.items()}
        for other in (False, "qkv"):
            for field in ("k", "v", "tokens", "slot", "pad"):
                getattr(states[other], field).copy_(getattr(states[True], field))
        logits = {defer: runners[defer].logits(states[defer]) for defer in runners}
    for defer in (True, "qkv"):
        assert max_err(logits[defer], logits[False]) <= 1e-2 * max(1.0, logits[False].abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("name,kwargs", [(name, kwargs) for name, kwargs, _ in NORM_IN_FRONT])
def test_int4_norm_in_front_on_the_gpu(name, kwargs, tmp_path):
    """GPU: the graph-captured decode (batch 3) with each int4 op's add + norm as int4_norm_prologue in front gives,
    one step on the same cache and tokens, the logits of the step with the norms inside the ops, within fp16
    rounding (the two compute each row's statistics in blocks of different sizes, so h may differ in its last bit)."""
    model = gptq_model(name, tmp_path, False, dtype=torch.float16, device="cuda")
    randomize_norms(model)
    patch_model(model)
    ids = torch.randint(3, 500, (3, 13), device="cuda")
    mask = torch.ones_like(ids)
    options = {front: DecodeOptions(int4_separate_norm_batch=2 if front else 9, **kwargs) for front in (1, 0)}
    runners = {front: DecodeRunner(model, options[front]) for front in (1, 0)}
    with torch.no_grad():
        for runner in runners.values():
            runner.generate(ids, mask, 16, Sampling(), eos=[], pad_token_id=0)
            assert runner.states[3].graph is not None
        states = {front: runner.states[3] for front, runner in runners.items()}
        for field in ("k", "v", "tokens", "slot", "pad"):
            getattr(states[0], field).copy_(getattr(states[1], field))
        logits = {front: runners[front].logits(states[front]) for front in runners}
    assert states[1].int4_separate_norm and not states[0].int4_separate_norm
    assert max_err(logits[1], logits[0]) <= 1e-2 * max(1.0, logits[0].abs().max().item())


@pytest.mark.gpu
def test_int4_mlp_branch_stream_changes_no_result(tmp_path):
    """int4 GPT-NeoX with its MLP on a second stream (with its own K-split workspace), the five-kernel step that
    DecodeOptions(merge_int4=False) keeps: tokens equal the one-stream step's. (With the merged ops a layer runs on
    one stream, and the runner makes no branch stream.)"""
    model = gptq_model("tiny-pythia", tmp_path, False, dtype=torch.float16, device="cuda")
    model.generation_config.eos_token_id = None
    patch_model(model)
    ids = torch.randint(3, 500, (3, 13), device="cuda")
    tokens = one_and_two_stream_tokens(model, ids, torch.ones_like(ids), DecodeOptions(merge_int4=False))
    assert DecodeRunner(model).decode_step.branch_stream is None
    assert torch.equal(tokens[True], tokens[False])


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
