"""Patched GPTQ int4 models: the decode step's split rule and K slices, the int4 ops in every layer and the output
pair (CPU reference backend; on the GPU the int4 kernels and the graph-captured decode).
"""

from __future__ import annotations

import pytest
import torch
from conftest import (
    FP32_LOGIT_ATOL,
    assert_within_torch_error,
    max_err,
)
from gptq_models import EAGER, gptq_model
from streams import one_and_two_stream_tokens

from patcher import load_gptq, patch_model, unpatch_model
from patcher.decode import DecodeOptions, DecodeRunner, Sampling, generate_path, int4_plan
from patcher.ops import int4 as int4_ops


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
