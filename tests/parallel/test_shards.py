"""The layout checks of patcher.parallel in one process: a one-rank gloo group, the model sharded by transformers'
own `apply_tensor_parallelism` (a one-rank mesh holds the whole tensor as its shard, so the fused forward's
all-reduce is a no-op and the logits must match the unsharded model's)."""

from __future__ import annotations

import inspect
import re

import pytest
import torch
import torch.distributed as dist
from conftest import FP32_LOGIT_ATOL
from torch.distributed.tensor import Shard, distribute_tensor

from patcher import patch_model, random_models, unpatch_model
from patcher.parallel import shard, sharding_reason, tp_styles

tensor_parallel = pytest.importorskip("transformers.distributed.tensor_parallel")
if "tp_plan" not in inspect.signature(tensor_parallel.apply_tensor_parallelism).parameters:
    pytest.skip("apply_tensor_parallelism takes no plan in this transformers release (5.17)", allow_module_level=True)
IDS = torch.tensor([[1, 5, 9, 33, 7, 100]])


@pytest.fixture
def mesh():
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.device_mesh.init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def sharded_model(name: str, mesh):
    model = random_models.build(name)
    plan = model._tp_plan  # (its keys write layer numbers as `*`; apply_tensor_parallelism takes module names)
    expanded = {}  # each parameter is sharded by its name, each forward wrapped by its module's name
    for n, module in model.named_modules():
        style = plan.get(_wildcard(n))
        if style is not None:
            expanded.update({f"{n}.{p}": style for p, _ in module.named_parameters(recurse=False)})
            expanded[n] = style
    assert expanded
    tensor_parallel.apply_tensor_parallelism(model, mesh, expanded)
    return model


def _wildcard(name: str) -> str:
    return re.sub(r"\.\d+(\.|$)", lambda m: ".*" + m.group(1), name)


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def test_no_styles_without_sharded_weights():
    model = random_models.build("tiny-llama")
    assert model._tp_plan  # transformers resolves the config's plan for every model
    assert tp_styles(model) == {}
    report = patch_model(model)
    assert not any("tensor parallel" in r.detail for r in report.replaced)
    assert not model._patcher_state.planner.tensor_parallel


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-pythia"])
def test_one_rank_mesh_patched_on_shards(mesh, name):
    model = sharded_model(name, mesh)
    expected = logits(model)
    report = patch_model(model)
    assert report.unpatched == [], str(report)
    assert any("summed over 1 ranks" in r.detail for r in report.replaced), str(report)
    got = logits(model)
    assert (got - expected).abs().max().item() <= FP32_LOGIT_ATOL * max(expected.abs().max().item(), 1.0)
    unpatch_model(model)
    assert torch.equal(logits(model), expected)


def test_unexpected_placement_named(mesh):
    model = sharded_model("tiny-llama", mesh)
    attention = model.model.layers[1].self_attn
    # the whole q_proj weight re-laid out by columns, as if a plan had called it row-wise
    local = attention.q_proj.weight.full_tensor().detach()
    attention.q_proj.weight = torch.nn.Parameter(distribute_tensor(local, mesh, [Shard(1)]), requires_grad=False)
    reason = sharding_reason("layer", model.model.layers[1], _spec(model), model.config, tp_styles(model))
    assert reason is not None and "q_proj.weight has placements" in reason, reason
    expected = logits(model)
    report = patch_model(model)
    assert [r.name for r in report.unpatched] == ["model.layers.1"], str(report)
    assert "tensor-parallel (DTensor) weights" in report.unpatched[0].detail
    got = logits(model)
    assert (got - expected).abs().max().item() <= FP32_LOGIT_ATOL * max(expected.abs().max().item(), 1.0)


def _spec(model):
    from patcher.registry import REGISTRY

    return REGISTRY[model.config.model_type].spec


def test_repointed_shard_rebuilds_plan(mesh):
    model = sharded_model("tiny-llama", mesh)
    before = logits(model)
    patch_model(model)
    weight = model.model.layers[0].self_attn.k_proj.weight
    # new memory under the same DTensor (its own data_ptr stays 0: the guard watches the local shard's)
    shard(weight).data = shard(weight).detach().clone() * 0.5
    fused = logits(model)
    with torch.enable_grad():  # HF's forwards, on the same parameters
        hf = model(IDS).logits.detach()
    assert (fused - before).abs().max().item() > 1e-3  # the new weights are read
    assert (fused - hf).abs().max().item() <= FP32_LOGIT_ATOL * max(hf.abs().max().item(), 1.0)
    assert any("weights changed after patching" in m for m in model._patcher_state.report.messages)
