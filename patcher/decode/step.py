"""The decode step of an int4 model as one persistent CUDA kernel (kernels/step.cuh).

Where every decoder linear of a model is GPTQ int4, the graph-captured decode step can run all layers in one
cooperative launch instead of five kernels a layer: the blocks meet at grid-wide barriers between the stages of a
layer, and each block streams its share of the weights through shared memory ahead of them. The embedding, the
final norm, the lm_head and the token choice stay as they are (runner.py).

Status: opt-in (`PATCHER_STEP_KERNEL=1`, or `DecodeRunner(model, use_step_kernel=True)`), because measured on the
H100 it is not yet faster than the per-op step: int4 TPOT Pythia-2.8B 1.80 against 1.64 ms, Llama-3.1-8B 3.80
against 3.42 ms (docs/int4_decode.md; `python -m evals.step_profile` shows where each stage's time goes).

`StepKernel(runner, state)` builds the plan for one StepState (its caches, tables and batch size) and raises
`StepKernelUnavailable` with the reason where the kernel cannot take the model; the runner then keeps the per-op
step and records the reason (`DecodeRunner.step_kernel_reason`).

The work split of the kernel is mirrored here (StageSplit) so that the CPU tests check its invariants: every unit
of a stage is taken by exactly one block, a block's units of a strip are contiguous, and the blocks that share a
strip are consecutive.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

# The stages of a layer (kernels/step.cuh), and the marks the timeline records in each (launchers.h: kStepMarks).
PARALLEL_STAGES = ("A: add + LayerNorms, QKV + MLP in", "B: attention", "C: attention out + MLP out")
SEQUENTIAL_STAGES = ("A: add + norm, QKV", "B: attention", "C: attention out", "D: add + norm, MLP in", "E: MLP out")
# stage start (after its barrier), attention done, inputs staged, linears done (arrival at the barrier); then the ns
# of the linears' phase spent waiting for weights and in the strips' meetings
MARKS = 6
GROUP_WHOLE = 1 << 30  # the group size passed for "one group over all of K" (GPTQ group_size -1)
UNIT_K = 256  # k per unit of work (32 qweight rows)
STRIP = 128  # output columns per strip (gate | up: 64 + 64)


class StepKernelUnavailable(RuntimeError):
    """The step kernel cannot run this model or batch; the message says why."""


def enabled() -> bool:
    """Whether the decode runner uses the step kernel unless told otherwise: PATCHER_STEP_KERNEL=1 (opt-in)."""
    return os.environ.get("PATCHER_STEP_KERNEL", "0") == "1"


# ---- the work split (kernels/step.cuh: StageSplit) -------------------------------------------------------------
@dataclass(frozen=True)
class StageSplit:
    """A linear stage's units (every strip of its first linear x its K units, strip-major, then its second's) in
    equal runs over the blocks; strips are numbered over both linears."""

    blocks: int
    strips0: int
    ku0: int
    strips1: int = 0
    ku1: int = 1

    @property
    def begin1(self) -> int:
        return self.strips0 * self.ku0

    @property
    def units(self) -> int:
        return self.begin1 + self.strips1 * self.ku1

    def run_start(self, block: int) -> int:
        """Block b's run is [run_start(b), run_start(b + 1)): units // blocks each, one more for the first
        units % blocks, so the blocks holding a strip's units are consecutive (the last hold none if units < blocks)."""
        q, r = divmod(self.units, self.blocks)
        return block * q + min(block, r)

    def owner(self, u: int) -> int:
        """The block whose run holds unit u."""
        q, r = divmod(self.units, self.blocks)
        return u // (q + 1) if u < r * (q + 1) else r + (u - r * (q + 1)) // q

    def strip_of(self, u: int) -> int:
        return u // self.ku0 if u < self.begin1 else self.strips0 + (u - self.begin1) // self.ku1

    def first_unit(self, strip: int) -> int:
        return strip * self.ku0 if strip < self.strips0 else self.begin1 + (strip - self.strips0) * self.ku1

    def last_unit(self, strip: int) -> int:
        return self.first_unit(strip + 1) - 1

    def pieces(self, u0: int, u1: int) -> list[tuple[int, int, int]]:
        """A block's run [u0, u1) as pieces (strip, first unit, units), each the run's units of one strip: the run's
        last strip first, then the rest in order, so that the two blocks sharing a strip both take it early."""
        s0, s1 = self.strip_of(u0), self.strip_of(u1 - 1)
        if s0 == s1:
            return [(s0, u0, u1 - u0)]
        out = [(s1, self.first_unit(s1), u1 - self.first_unit(s1))]
        for strip in range(s0, s1):
            first = max(u0, self.first_unit(strip))
            out.append((strip, first, self.last_unit(strip) + 1 - first))
        return out


# ---- eligibility ---------------------------------------------------------------------------------------------
def model_reason(runner) -> str | None:
    """Why the step kernel can never take this runner's model, or None (the C++ planner checks the rest)."""
    if runner.device.type != "cuda":
        return "not a CUDA model"
    if torch.cuda.get_device_capability(runner.device)[0] != 9:
        return "the step kernel needs a Hopper GPU (sm_90)"
    if runner.dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {runner.dtype} (the step kernel takes float16 and bfloat16)"
    linears = []
    for layer in runner.layers:
        a, m = layer.attention, layer.mlp
        group = (a.qkv_int4, a.out_int4, m.in_int4, m.out_int4)
        if any(lin is None for lin in group):
            return "not every decoder linear is GPTQ int4"
        linears.extend(group)
    if any(lin.act_order for lin in linears):
        return "act-order (g_idx) or a group size that is not a multiple of 8"
    if len({lin.zero_offset for lin in linears}) != 1:
        return "GPTQ v1 and v2 linears mixed"
    if group_size(linears) is None:
        return "linears quantized with different group sizes"
    eps = {norm[2] for layer in runner.layers for norm in layer.norms}
    if len(eps) != 1:
        return "norms with different eps"
    return None


def group_size(linears) -> int | None:
    """The one group size of all linears (GROUP_WHOLE for one group over K), or None where they differ."""
    sizes = {GROUP_WHOLE if lin.group_size >= lin.in_features else lin.group_size for lin in linears}
    return sizes.pop() if len(sizes) == 1 else None


class StepKernel:
    """The plan and buffers of the step kernel for one StepState (batch size, cache capacity). With `timeline`,
    each launch records when every block starts and ends each phase of each stage (timeline_summary)."""

    def __init__(self, runner, state, timeline: bool = False):
        reason = model_reason(runner)
        if reason is not None:
            raise StepKernelUnavailable(reason)
        B, H, dev, dtype = state.batch, runner.hidden, runner.device, runner.dtype
        first = runner.layers[0]
        inter = sum(first.mlp.in_int4.widths) // (2 if first.mlp_act == "silu_mul" else 1)
        hq, hkv, d = runner.num_heads, runner.num_kv_heads, runner.head_dim
        self.resid = torch.zeros(2, B, H, dtype=dtype, device=dev)
        self.delta = torch.zeros(2, B, H, dtype=dtype, device=dev)  # attention, MLP
        self.qkv = torch.zeros(B, (hq + 2 * hkv) * d, dtype=dtype, device=dev)
        self.attn = torch.zeros(B, hq * d, dtype=dtype, device=dev)
        self.act = torch.zeros(B, inter, dtype=dtype, device=dev)
        self.parallel = runner.parallel
        qweight, qzeros, scales, bias, segments, norm_w, norm_b = [], [], [], [], [], [], []
        linears = []
        for layer in runner.layers:
            a, m = layer.attention, layer.mlp
            for lin in (a.qkv_int4, a.out_int4, m.in_int4, m.out_int4):
                linears.append(lin)
                qweight += lin.qweight
                qzeros += lin.qzeros
                scales += lin.scales
                bias += lin.bias
                segments.append(len(lin.qweight))
            for w, b, _ in layer.norms:
                norm_w.append(w)
                norm_b.append(b)
        self._keep = (qweight, qzeros, scales, bias, norm_w, norm_b)  # the plan points into these
        self.stage_names = PARALLEL_STAGES if runner.parallel else SEQUENTIAL_STAGES
        self.stages = len(runner.layers) * len(self.stage_names)
        self.blocks = torch.cuda.get_device_properties(dev).multi_processor_count
        marks = self.blocks * self.stages * MARKS
        self.timeline = torch.zeros(marks, dtype=torch.long, device=dev) if timeline else None
        try:
            self.header, self.arrays, self.workspace, self.final = torch.ops.patcher.int4_step_plan(
                qweight, qzeros, scales, bias, segments, group_size(linears), linears[0].zero_offset,
                norm_w, norm_b, float(first.norms[0][2]), runner.rms, runner.parallel, first.mlp_act,
                hq, hkv, d, first.attention.interleaved, first.scale, state.splits,
                state.cos, state.sin, state.slot, state.pad, state.k, state.v,
                self.resid, self.delta, self.qkv, self.attn, self.act, self.timeline,
            )  # fmt: skip
        except RuntimeError as e:
            raise StepKernelUnavailable(str(e).split("\n")[0]) from e

    @property
    def nbytes(self) -> int:
        tensors = (self.resid, self.delta, self.qkv, self.attn, self.act, self.arrays, self.workspace)
        return sum(t.numel() * t.element_size() for t in tensors)

    def run(self, x: torch.Tensor) -> tuple:
        """Every layer on the embeddings x [B, H]: (residual, delta, delta2) for the final add + norm."""
        self.resid[0].copy_(x)
        torch.ops.patcher.int4_step(self.header, self.arrays, self.workspace)
        if self.parallel:
            return self.resid[self.final], self.delta[0], self.delta[1]
        return self.resid[self.final], self.delta[1], None


def timeline_summary(kernel: StepKernel) -> list[dict]:
    """Where the last launch's time went, per kind of stage (averaged over layers), in microseconds: the stage's
    span (start to the next stage's start, median over blocks), and its phases, medians over blocks: attention,
    staging the inputs (add + norm or a plain copy), the linears' units (compute, waiting for weights and the strip
    meetings), of which waiting for weights and the meetings, and the wait at the barrier; "slowest" is the most any
    block spent before arriving at the barrier."""
    if kernel.timeline is None:
        raise ValueError("the step kernel was built without a timeline (StepKernel(..., timeline=True))")
    t = kernel.timeline.view(kernel.blocks, kernel.stages, MARKS).double().cpu() / 1e3  # us
    ends = torch.cat([t[:, 1:, 0], t[:, -1:, 3]], dim=1)  # when each block starts the next stage
    kinds = len(kernel.stage_names)
    rows = []
    for k, name in enumerate(kernel.stage_names):
        s = t[:, k::kinds]
        e = ends[:, k::kinds]
        phases = {
            "span_us": e - s[..., 0],
            "attention_us": s[..., 1] - s[..., 0],
            "staging_us": s[..., 2] - s[..., 1],
            "units_us": s[..., 3] - s[..., 2],
            "weight_wait_us": s[..., 4],
            "meeting_us": s[..., 5],
            "barrier_us": e - s[..., 3],
        }
        row = {"stage": name, **{key: v.median(dim=0).values.mean().item() for key, v in phases.items()}}
        row["slowest_us"] = (s[..., 3] - s[..., 0]).max(dim=0).values.mean().item()
        rows.append(row)
    rows.append({"stage": "step", "span_us": (ends[:, -1] - t[:, 0, 0]).median().item()})
    return rows
