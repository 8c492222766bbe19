"""patch_model on models transformers shards for tensor parallelism (`tp_plan`): two gloo processes on the CPU, and
two NCCL processes on two GPUs (the kernels) where a machine has them.

tp_worker.py runs every check on both ranks in one `torch.distributed.run` launch; the tests here assert on what
each rank saved. The fused forwards read each rank's shards and sum the row-wise outputs by all_reduce; a layout
they do not read stays as it was, named in the report. fp32 logits: patched against the same sharded model
unpatched and against the whole model in one process, within FP32_LOGIT_ATOL relative to the logits' scale.
"""

from __future__ import annotations

import pytest
import torch
from conftest import FP32_LOGIT_ATOL, REPO
from launch import RANKS, torchrun
from transformers.integrations.tensor_parallel import ALL_PARALLEL_STYLES

from patcher import random_models

pytestmark = pytest.mark.slow  # (one launch of two processes for every job below: about 20 s on two cores)

# job name -> (random model, plan: "auto" is the config's own, others are tp_worker.PLANS)
JOBS = {
    "llama": ("tiny-llama", "auto"),
    "qwen2": ("tiny-qwen2", "auto"),
    "pythia": ("tiny-pythia", "auto"),
    "neox-sequential": ("tiny-neox-sequential", "auto"),
    "llama-gathered-mlp": ("tiny-llama", "gathered-mlp"),
    "llama-mlp-only": ("tiny-llama", "mlp-only"),
}
if "replicate" not in ALL_PARALLEL_STYLES:  # a style name of later 5.x releases (5.24; not 5.17)
    del JOBS["llama-mlp-only"]
AUTO = [name for name, (_, plan) in JOBS.items() if plan == "auto"]


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def results(request, tmp_path_factory):
    device = request.param
    if device == "cuda" and torch.cuda.device_count() < RANKS:
        pytest.skip(f"tensor parallelism over NCCL needs {RANKS} GPUs, this machine has {torch.cuda.device_count()}")
    root = tmp_path_factory.mktemp("tp")
    for model in {model for model, _ in JOBS.values()}:
        random_models.build(model).save_pretrained(root / model)
    jobs = [f"{name}={root / model}:{plan}" for name, (model, plan) in JOBS.items()]
    worker = str(REPO / "tests" / "parallel" / "tp_worker.py")
    run = torchrun([worker, device, str(root / "out"), *jobs], timeout=600, cuda=device == "cuda")
    assert run.returncode == 0, f"tp_worker failed:\n{run.stdout[-4000:]}\n{run.stderr[-8000:]}"
    names = [*JOBS, "rank_sum"] if device == "cuda" else list(JOBS)
    return {
        name: [torch.load(root / "out" / name / f"rank{r}.pt", weights_only=False) for r in range(RANKS)]
        for name in names
    }


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    scale = max(expected.abs().max().item(), 1.0)
    err = (actual.double() - expected.double()).abs().max().item()
    assert err <= FP32_LOGIT_ATOL * scale, f"{what}: max |difference| {err:.3g} > {FP32_LOGIT_ATOL} x {scale:.3g}"


@pytest.mark.parametrize("name", AUTO)
def test_every_layer_patched_on_its_shards(results, name):
    for rank, r in enumerate(results[name]):
        assert r["unpatched"] == [], f"rank {rank}: {r['unpatched']}"
        attention_details = [d for n, d in r["replaced"] if n.endswith(("self_attn", "attention"))]
        assert attention_details and all("summed over 2 ranks" in d for d in attention_details), r["report"]
        layers = len([n for n, _ in r["replaced"] if n.endswith("mlp")])
        # each layer's output projections ran through the fused forward's all-reduce (two per layer)
        assert r["rowwise_calls"] == 2 * layers, r["rowwise_calls"]
        assert r["launches"]["all_reduce"] == 2, r["launches"]


@pytest.mark.parametrize("name", list(JOBS))
def test_logits_match_unpatched_and_whole_model(results, name):
    for rank, r in enumerate(results[name]):
        assert_close(r["patched"], r["sharded"], f"{name} rank {rank}: patched against sharded unpatched")
        assert_close(r["patched"], r["whole"], f"{name} rank {rank}: patched against the whole model")
        assert_close(r["patched_grad_mode"], r["sharded"], f"{name} rank {rank}: grad mode (HF's forwards)")
    assert torch.equal(results[name][0]["patched"], results[name][1]["patched"]), "the ranks' logits differ"


@pytest.mark.parametrize("name", list(JOBS))
def test_greedy_tokens_match_whole_model(results, name):
    for r in results[name]:
        assert r["patched_tokens"] == r["whole_tokens"]
        assert r["patched_static_tokens"] == r["whole_tokens"]  # HF's static cache, sized for the local kv heads
        assert r["static_path"]["path"] == "hf"
        if r["unpatched"]:  # a layer the fused forward does not read: HF's loop, with the reason
            assert r["generate_path"]["path"] == "hf" and "not patched" in r["generate_path"]["reason"]
        else:
            assert "cache_implementation" in r["static_path"]["reason"], r["static_path"]


@pytest.mark.parametrize("name", [name for name in JOBS if name != "llama-gathered-mlp"])
def test_decode_runner_serves_tensor_parallel(results, name, request):
    """The decode step on each rank's shards (local heads, row-wise all-reduce, the embedding and lm_head by
    vocabulary) makes the whole model's greedy tokens on every rank: the eager runner, and `generate` itself through
    the runner (the CUDA graph on GPUs, the eager runner on the CPU); sampling keeps HF's loop, with the reason."""
    device = request.node.callspec.params.get("results", "cpu")
    for r in results[name]:
        assert r["runner_tokens"] == r["whole_tokens"]
        assert r["patched_tokens"] == r["whole_tokens"]
        expected = "graph" if device == "cuda" else "eager-runner"
        assert r["generate_path"] == {"path": expected, "reason": None}, r["generate_path"]
        assert r["sampling_path"]["path"] == "hf" and "sampling on a tensor-parallel" in r["sampling_path"]["reason"]
        step = r["step"]
        assert step["lm_head_gathered"] and not step["branch_stream"], step  # (every plan shards the lm_head)
        assert step["rank_sum"] == (device == "cuda"), step  # the row-wise sums: rank_sum on GPUs, else all_reduce
        assert step["embedding_sharded"] == step["embedding_table_sharded"], step
        if name in AUTO:  # half the heads on each rank
            whole = random_models.build(JOBS[name][0]).config
            kv = getattr(whole, "num_key_value_heads", whole.num_attention_heads)
            assert step["heads"] == (whole.num_attention_heads // 2, kv // 2), step


@pytest.mark.parametrize("name", list(JOBS))
def test_unpatch_restores_exact_outputs(results, name):
    for r in results[name]:
        assert torch.equal(r["unpatched_again"], r["sharded"])
        assert "DTensor" in r["state_dict_types"]  # the parameters are still transformers' sharded ones


def test_unsupported_layout_left_as_it_was(results):
    for r in results["llama-gathered-mlp"]:
        layers = [(n, reason) for n, reason in r["unpatched"] if n.startswith("model.layers.")]
        assert len(layers) == 3, r["report"]
        for name, reason in layers:
            assert "tensor-parallel (DTensor) weights" in reason and "colwise_gather_output" in reason, reason
        assert r["rowwise_calls"] == 0


@pytest.mark.skipif("llama-mlp-only" not in JOBS, reason="this transformers release has no 'replicate' TP style")
def test_partly_sharded_layers_patched(results):
    for r in results["llama-mlp-only"]:
        assert r["unpatched"] == [], r["report"]
        details = dict(r["replaced"])
        assert "summed over 2 ranks" in details["model.layers.0.mlp"]
        assert "tensor parallel" not in details["model.layers.0.self_attn"]
        assert r["rowwise_calls"] == 3  # one down_proj per layer
        assert r["launches"]["all_reduce"] == 1, r["launches"]


def test_rank_sum_equals_all_reduce(results, request):
    """The rank_sum kernel sums two ranks' partials as NCCL's all_reduce does, bit for bit (two addends round the
    same in any order and accumulator), eagerly and replayed in a CUDA graph with new partials."""
    if request.node.callspec.params.get("results") != "cuda":
        pytest.skip("rank_sum runs on GPUs (the CPU keeps dist.all_reduce)")
    for rank, checks in enumerate(results["rank_sum"]):
        assert len(checks) == 18, checks
        for case, (equal, err) in checks.items():
            assert equal, f"rank {rank}, {case}: max |difference| {err:.3g}"


def test_rank_sum_only_within_one_machine(monkeypatch):
    """rank_sum maps every rank's memory, so it serves a group of ranks on one machine (torchrun's LOCAL_WORLD_SIZE);
    a group over several machines keeps NCCL's all-reduce, and so does any group on the CPU or over gloo."""
    from patcher.parallel import rank_sum

    monkeypatch.setattr(rank_sum.dist, "get_backend", lambda group: group)
    monkeypatch.setattr(rank_sum.dist, "get_world_size", lambda group: 4)
    cuda = torch.device("cuda", 0)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert rank_sum.rank_sum_reason("nccl", cuda, torch.float16) is None
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert rank_sum.rank_sum_reason("nccl", cuda, torch.float16) == "4 ranks over several machines (2 on this one)"
    assert "not nccl" in rank_sum.rank_sum_reason("gloo", cuda, torch.float16)
    assert rank_sum.rank_sum_reason("nccl", torch.device("cpu"), torch.float16) == "not on a GPU"
    monkeypatch.delenv("LOCAL_WORLD_SIZE")  # (outside torchrun: every rank of the group is taken to be here)
    assert rank_sum.rank_sum_reason("nccl", cuda, torch.float16) is None
