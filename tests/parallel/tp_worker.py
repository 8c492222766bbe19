"""One rank of a tensor-parallel check, run by test_tensor_parallel.py under torch.distributed.run: on the CPU
(gloo) or on the GPU of its local rank (NCCL).

    python -m torch.distributed.run --nproc-per-node 2 tests/parallel/tp_worker.py cpu|cuda OUT_DIR NAME=MODEL_DIR:PLAN ...

PLAN is "auto" (the config's own tensor-parallel plan) or the name of a plan in PLANS. For each job, each rank loads
the model twice from MODEL_DIR (whole, and sharded by the plan), runs the checks below and saves what the test
asserts on to OUT_DIR/NAME/rank<r>.pt: logits of the whole model, of the sharded model unpatched, patched, and
unpatched again; greedy tokens of `generate` (the decode runner on the patched model: the graph one on CUDA, the
eager one on the CPU, where the placement check alone is waived) and of the eager runner itself; the report; how
many row-wise projections ran through the fused forward's all-reduce. On GPUs it also checks the rank_sum kernel
against NCCL's all_reduce (rank_sum_checks, saved to OUT_DIR/rank_sum/rank<r>.pt). One launch runs every job:
starting the processes costs more than a tiny model's checks.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

import patcher
import patcher.decode.reasons as reasons_module
import patcher.layers.weights as weights_module
from evals.distributed import load_sharded
from patcher.decode import DecodeOptions, DecodeRunner, generate_path
from patcher.parallel import RankSum, sharded

_LAYERS = "model.layers.*"
PLANS = {
    # the MLP gathers its column-wise output and splits it again inside the row-wise projection: transformers runs
    # it correctly, the fused MLP does not read this layout, so those layers stay as they were
    "gathered-mlp": {
        f"{_LAYERS}.self_attn.q_proj": "colwise",
        f"{_LAYERS}.self_attn.k_proj": "colwise",
        f"{_LAYERS}.self_attn.v_proj": "colwise",
        f"{_LAYERS}.self_attn.o_proj": "rowwise",
        f"{_LAYERS}.mlp.gate_proj": "colwise_gather_output",
        f"{_LAYERS}.mlp.up_proj": "colwise_gather_output",
        f"{_LAYERS}.mlp.down_proj": "rowwise_split_input",
    },
    # only the MLPs sharded (a plan given to from_pretrained updates the config's): the attention runs whole on
    # every rank, the MLP on its shards
    "mlp-only": {
        f"{_LAYERS}.self_attn.q_proj": "replicate",
        f"{_LAYERS}.self_attn.k_proj": "replicate",
        f"{_LAYERS}.self_attn.v_proj": "replicate",
        f"{_LAYERS}.self_attn.o_proj": "replicate",
        f"{_LAYERS}.mlp.gate_proj": "colwise",
        f"{_LAYERS}.mlp.up_proj": "colwise",
        f"{_LAYERS}.mlp.down_proj": "rowwise",
    },
}
PROMPT = [[1, 5, 9, 33, 7, 100, 42, 17]]
NEW_TOKENS = 8


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.detach().cpu()


def greedy(model, ids: torch.Tensor, **kwargs) -> list[int]:
    out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS, **kwargs)
    return out[0, ids.shape[1] :].tolist()


def runner_tokens(model, ids: torch.Tensor) -> list[int] | None:
    """The eager decode runner's greedy tokens for greedy()'s arguments (None where it can't serve the model)."""
    if reasons_module.model_reason(model) is not None:
        return None
    reason, prepared = reasons_module.call_reason(model, None, {
        "input_ids": ids, "max_new_tokens": NEW_TOKENS, "do_sample": False, "min_new_tokens": NEW_TOKENS})  # fmt: skip
    assert reason is None, reason
    with torch.no_grad():
        out = DecodeRunner(model, DecodeOptions(use_graphs=False)).generate(**prepared)
    return out[0, ids.shape[1] :].tolist()


def check(model_dir: str, plan_name: str, device: torch.device) -> dict:
    ids = torch.tensor(PROMPT, device=device)
    whole = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    result = {"whole": logits(whole, ids), "whole_tokens": greedy(whole, ids)}
    del whole

    plan = "auto" if plan_name == "auto" else PLANS[plan_name]
    model = load_sharded(model_dir, torch.float32, plan=plan).eval()
    result["sharded"] = logits(model, ids)

    rowwise_calls = [0]
    rowwise_linear = weights_module.rowwise_linear

    def counted(*args):
        rowwise_calls[0] += 1
        return rowwise_linear(*args)

    weights_module.rowwise_linear = counted
    report = patcher.patch_model(model)
    result["report"] = str(report)
    result["unpatched"] = [(r.name, r.detail) for r in report.unpatched]
    result["replaced"] = [(r.name, r.detail) for r in report.replaced]
    result["launches"] = dict(report.launches_per_layer)
    result["patched"] = logits(model, ids)
    result["rowwise_calls"] = rowwise_calls[0]
    with torch.enable_grad():  # grad mode: every module runs HF's forward (on the fused buffers' views)
        result["patched_grad_mode"] = model(ids).logits.detach().cpu()
    result["runner_tokens"] = runner_tokens(model, ids)
    result["patched_tokens"] = greedy(model, ids)  # the decode runner (HF's loop where a reason says so)
    result["generate_path"] = generate_path(model)
    step = getattr(model._patcher_state.runner, "decode_step", None)
    if step is not None:  # what the step runs on this rank: local heads, tables sharded by vocabulary or whole
        result["step"] = {
            "heads": (step.num_heads, step.num_kv_heads),
            "lm_head_gathered": step.lm_group is not None,
            "embedding_sharded": step.embed_group is not None,
            "embedding_table_sharded": sharded(model.get_input_embeddings().weight),
            "branch_stream": step.branch_stream is not None,
            "rank_sum": step.reduce_group is not None,
        }
    result["patched_static_tokens"] = greedy(model, ids, cache_implementation="static")  # HF's loop, local kv heads
    result["static_path"] = generate_path(model)
    torch.manual_seed(0)  # (HF's loop: every rank draws the same tokens and runs its 2 steps)
    model.generate(ids, max_new_tokens=2, min_new_tokens=2, do_sample=True, top_k=4)
    result["sampling_path"] = generate_path(model)
    weights_module.rowwise_linear = rowwise_linear

    patcher.unpatch_model(model)
    result["unpatched_again"] = logits(model, ids)
    result["state_dict_types"] = sorted({type(t).__name__ for t in model.state_dict().values()})
    return result


def rank_sum_checks(device: torch.device) -> dict:
    """patcher::rank_sum against dist.all_reduce of the same partials (each rank its own), through one RankSum a dtype
    for every shape: eagerly, three sums a shape, and as one CUDA graph of one sum a shape replayed five times with new
    partials (the inbox halves alternate between consecutive sums of any size). {(dtype, shape, how): (equal, max |difference|)}.
    Shapes: a decode row, odd sizes (a padded last word), 8 rows of a wide model (every block busy)."""
    group = dist.group.WORLD
    ops = patcher.ops.backend_for(device)  # (the CUDA kernels, built where the extension cache lacks them)
    generator = torch.Generator(device).manual_seed(dist.get_rank())
    shapes = ((1, 4096), (3, 1001), (8, 8192))
    results = {}

    def record(dtype, shape, how, got, want):
        got, want = torch.stack(got), torch.stack(want)
        results[(str(dtype), shape, how)] = (torch.equal(got, want), (got.double() - want.double()).abs().max().item())

    def reference(x):
        expected = x.clone()
        dist.all_reduce(expected, group=group)
        return expected

    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        summer = RankSum(group, 8 * 8192, dtype, device, ops)
        xs = [torch.empty(shape, dtype=dtype, device=device) for shape in shapes]
        for shape, x in zip(shapes, xs):
            got, want = [], []
            for _ in range(3):
                x.normal_(generator=generator)
                want.append(reference(x))
                got.append(summer(x).clone())
            record(dtype, shape, "eager", got, want)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = [summer(x) for x in xs]
        got, want = {s: [] for s in shapes}, {s: [] for s in shapes}
        for _ in range(5):
            for shape, x in zip(shapes, xs):
                x.normal_(generator=generator)
                want[shape].append(reference(x))
            graph.replay()
            for shape, out in zip(shapes, outs):
                got[shape].append(out.clone())
        torch.cuda.synchronize()
        for shape in shapes:
            record(dtype, shape, "graph", got[shape], want[shape])
    return results


def main(device_type: str, out_dir: str, jobs: list[str]) -> None:
    if device_type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    if device_type == "cpu":  # the decode runner runs eagerly on the CPU's reference ops; every other check stays
        reasons_module.placement_reason = lambda model: None
    if device_type == "cuda":
        (Path(out_dir) / "rank_sum").mkdir(parents=True, exist_ok=True)
        torch.save(rank_sum_checks(device), Path(out_dir) / "rank_sum" / f"rank{rank}.pt")
    for job in jobs:
        name, _, rest = job.partition("=")
        model_dir, _, plan_name = rest.rpartition(":")
        result = check(model_dir, plan_name, device)
        (Path(out_dir) / name).mkdir(parents=True, exist_ok=True)
        torch.save(result, Path(out_dir) / name / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
