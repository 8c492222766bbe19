"""The decode loop of a patched model: a static KV cache and one CUDA graph per decode step.

    prefill      the patched model's own forward (fused kernels, HF's SDPA/flash) on the prompt; its K/V are copied
                 into the static cache, and the first token is chosen from its last logits
    decode step  embedding -> per layer: add+norm, QKV gemv with RoPE in its epilogue (K/V written into the cache),
                 decode_attention (only the filled part of the cache), output gemv, add+norm, MLP gemvs with the
                 activation fused -> final add+norm -> lm_head gemv -> (sampling warpers) -> next_token: the
                 argmax, written after the current token, the position counter advanced and the new token's
                 embedding looked up for the next step, in one kernel
On CUDA the step is captured once per batch size and cache size and replayed for every token: one host call per
token, no host sync (the loop checks for EOS every few steps). The cache position lives in a device tensor, so
the same graph serves every step. On the CPU (tests, reference backend) the same step runs eagerly.

Where every decoder linear is GPTQ int4 (on a Hopper GPU), all layers of the step can run as one persistent kernel
instead (step.py, kernels/step.cuh; opt-in, not yet faster); the runner keeps the per-op step where that kernel is
off or cannot take the model, and says why (`step_kernel_reason`).

GPT-NeoX's parallel residual makes the MLP independent of the attention (both read LayerNorms of the same sum), so
on CUDA its two GEMVs run on a second stream, beside QKV -> attention -> output projection (the graph captures the
two as parallel branches): HBM keeps streaming MLP weights while the attention, which reads little, runs. Where
its linears are GPTQ int4, a layer is three kernels instead, on one stream: the adds, both LayerNorms, QKV (RoPE,
K/V into the cache) and the MLP's input projection in one launch (int4_qkv_mlp_in); the attention; and both output
projections as one GEMV over [attention | MLP hidden] (int4_gemv_cat, patcher/layers/out_pair.py). At batch 1 an
int4 GEMV of a few MB is mostly fixed cost, so fewer, larger launches win. `DecodeRunner(model, merge_int4=False)`
keeps the five kernels and the second stream, for comparison.

An int4 output projection whose output goes straight into the next int4 op's add + norm prologue (LLaMA/Qwen2's
o_proj and down, GPT-NeoX's out pair) runs as int4_gemv_acc: its blocks add their K slices' sums into a fixed-point
accumulator and end, and the next op's prologue reads the accumulator as its delta (rounding it, then adding the
bias as delta2, as the op's own epilogue would have), so the K slices never meet through the workspace. Each
accumulator is zeroed, for the next step, by the following producer of its kind once that one's inputs are ready
(two kernels after the accumulator's reader at least). Measured on the H100 (fp16, batch 1, int4 g128): with the
meeting of those ops simply left out (wrong values, a bound), int4 TPOT Pythia-2.8B 1.462 -> 1.321 ms and
Llama-3.1-8B 3.250 -> 2.952; with the accumulators, 1.478 -> 1.414 and 3.250 -> 3.060 (docs/int4_decode.md).
`DecodeRunner(model, defer_int4=False)` (or PATCHER_INT4_DEFER=0) keeps the meetings.

LLaMA/Qwen2's int4 QKV projection hands its sums on the same way (int4_norm_gemv_acc, its add + norm prologue kept),
and the attention finishes them for the heads it takes (decode_attention_qkv_acc: rounding, bias, RoPE, the current
token's K/V into the cache), so no K slices meet in that op either. `DecodeRunner(model, defer_qkv=False)` (or
PATCHER_INT4_DEFER_QKV=0) keeps its meeting. Measured on the H100 (int4 TPOT, fp16, batch 1, g128, the meeting
against this, two rounds in one call, twice): Qwen2-1.5B 1.300 / 1.256 -> 1.182 / 1.196 ms and 1.246 / 1.247 ->
1.185 / 1.177; Llama-3.1-8B 2.572 / 2.578 -> 2.574 / 2.577 and 2.622 / 2.618 -> 2.601 / 2.604 (within 1%: the QKV op
is ~3.8 us faster a launch, the attention ~3.9 us slower, not for reading the sums; docs/int4_decode.md).
"""

from __future__ import annotations

import math
import os
from collections import Counter
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..ops import REFERENCE, decode_attention_workspace, int4, next_token_workspace
from ..registry import REGISTRY
from .step import StepKernel, StepKernelUnavailable
from .step import enabled as step_enabled

EOS_CHECK_EVERY = 16  # decode steps between host checks for "every row has finished"
# From this batch size on, the step's linears use cuBLAS (tensor cores) instead of our GEMV: measured on an H100,
# our GEMV streams weights at 85-98% of HBM bandwidth for one or two rows, but at 8 rows its fp32 FMAs take as
# long as the bytes (20-40%), while cuBLAS stays flat from 1 to 8 rows.
CUBLAS_MIN_BATCH = 4
# Up to this hidden size the dense GEMVs take the add + norm as their prologue (norm_gemv, norm_gemv_rope_cache).
# Every block recomputes the row's norm, so the prologue costs time in proportion to blocks x hidden: measured on
# an H100 (fp16, batch 1) it made SmolLM2-135M (hidden 576) decode 0.655 -> 0.596 ms a token, fewer kernels
# mattering most there, but Qwen2-1.5B (1536) 1.85 -> 2.06 ms and Llama-3.1-8B (4096) 5.95 -> 6.21 ms, where the
# separate norm kernel is cheaper than the prologue's extra latency in each block.
FUSED_NORM_MAX_HIDDEN = 1024
# From this batch size on (every batch size, as measured), an int4 op's add + norm prologue runs as its own kernel in
# front of it (int4_norm_prologue) and the op reads the normalized rows. In the op every block computes its rows'
# statistics over all of K from L2, and the op has more blocks the more rows it takes (a block's x stage holds batch x
# K / splits), so those reads grow with the square of the rows: measured on the H100 (fp16, g128, prompt 128), the
# prologue in the op made Llama-3.1-8B's norm + gate/up and norm + QKV take 75 us a launch at batch 8 against 21 at
# batch 1, and int4 decode slower than fp16 (6.70 against 6.33 ms a token). In front, one call (int4 TPOT, in front
# against inside): Llama-3.1-8B 2.679 / 2.796 ms at batch 2, 3.282 / 3.796 at 4, 4.666 / 6.650 at 8; Pythia-2.8B
# 1.342 / 1.359, 1.587 / 1.734, 2.104 / 2.518. At batch 1 too, in another call, two rounds: Llama-3.1-8B 2.540 / 2.537
# against 2.600 / 2.604, Pythia-2.8B 1.161 / 1.184 against 1.170 / 1.217, Qwen2-1.5B 1.162 / 1.160 against 1.179 /
# 1.185 (evals/results/int4_batch_4f6b97f.txt): the op without the prologue runs its loop in whole rounds, and the
# extra launch overlaps the op's weight loads. PATCHER_INT4_SEPARATE_NORM_BATCH=2 (or more) keeps the prologue in
# the ops below that batch size, for comparison.
INT4_SEPARATE_NORM_MIN_BATCH = 1
NO_PROLOGUE = (None,) * 6 + (0.0, False)  # the prologue arguments of an op that takes no add + norm
MIN_CAPACITY = 256
MAX_EOS_IDS = 8
MAX_SPLITS = 16  # decode_attention merges at most this many partial softmaxes per (row, kv head)
# From this many blocks (query heads x rows) the decode attention that finishes the int4 QKV sums is held to 128
# registers, half an SM, as its form that reads q always is (kernels/decode_attention.cu: kAttnTwoPerSmHeads).
ATTENTION_HALF_SM_BLOCKS = 32
# GPT-NeoX parallel residual: the MLP on a branch stream, concurrent with the attention (module docstring).
# Measured on an H100 (fp16, batch 1, one process): Pythia-2.8B 2.51 -> 2.22 ms a token, Pythia-6.9B 5.30 -> 4.73,
# int4 Pythia-2.8B 2.12 -> 1.92.
# Both branches at the same stream priority: giving either one's blocks precedence (PyTorch instantiates graphs
# with cudaGraphInstantiateFlagUseNodePriority, so nodes keep their capture stream's priority) measured slower,
# Pythia-2.8B 2.22 -> 2.33 ms with the attention path first, 2.48 ms with the MLP first.
PARALLEL_BRANCH = True


@dataclass
class Sampling:
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0


@dataclass
class LayerStep:
    """What one layer's decode step reads: the patch plans of its modules and its norms' parameters."""

    attention: object  # AttentionPlan
    mlp: object  # MlpPlan
    scale: float
    mlp_act: str  # the activation fused into the MLP's first linear: "silu_mul", "gelu" or "gelu_tanh"
    norms: tuple  # ((weight, bias, eps) of the input norm, (weight, bias, eps) of the post-attention norm)
    separate_norms: tuple  # the same two norms as separate kernels: (x, delta, delta2) -> (h, sum, h2)
    out_pair: object = None  # GPT-NeoX int4: both output projections as one Int4Linear over [attn | h], when used
    qkv_mlp: object = None  # GPT-NeoX int4: QKV and the MLP's input projection side by side (int4_qkv_mlp_in)


def separate_norm(norm, add_norm):
    """A norm of the patch plans (patcher/layers/norm.py) as (x, delta, delta2) -> (h, sum, h2): the decode step's
    add + norm as its own kernel, where it is not a GEMV's prologue. sum is x without a delta; no h2."""
    return lambda x, d, d2: (norm(x), x, None) if d is None else (*add_norm(x, d, d2), None)


def separate_dual_norm(plan):
    """GPT-NeoX's junction (both LayerNorms of one sum) from a layer's plan, as separate_norm returns it."""

    def run(x, d, d2):
        if d is None:
            h, h2 = plan.dual_norm(x)
            return h, x, h2
        h, h2, total = plan.add_dual_norm(x, d, d2)
        return h, total, h2

    return run


@dataclass
class DeferredOut:
    """The accumulator of one int4_gemv_acc producer in a StepState (module docstring): acc [B, N] int64, the
    producer's bias as rows [B, N] in the model's dtype (the reader's delta2) or None, and the accumulator it zeroes."""

    acc: torch.Tensor
    bias_rows: torch.Tensor | None
    clear: torch.Tensor | None = None


def defer_enabled() -> bool:
    """Whether int4 output projections hand their sums on unmet (module docstring): PATCHER_INT4_DEFER, default 1."""
    return os.environ.get("PATCHER_INT4_DEFER", "1") != "0"


def defer_qkv_enabled() -> bool:
    """Whether LLaMA/Qwen2's int4 QKV hands its sums on to the attention (module docstring): PATCHER_INT4_DEFER_QKV,
    default 1."""
    return os.environ.get("PATCHER_INT4_DEFER_QKV", "1") != "0"


INT4_ROLES = ("qkv", "out", "mlp_in", "mlp_out", "qkv_mlp", "out_pair")
# The roles launched just before (True) or just after (False) the attention: their K slices leave room for its blocks
# (DecodeRunner.attention_beside).
NEXT_TO_ATTENTION = {"qkv": True, "qkv_mlp": True, "out": False, "out_pair": False}


def int4_roles(layer) -> dict:
    """The int4 linears a layer's decode step launches, by role (None where it launches none of that role), as
    evals.ops names the ops: qkv, out, mlp_in (gate/up), mlp_out (down); in GPT-NeoX's step qkv_mlp (QKV beside the
    MLP's input projection, in place of qkv and mlp_in) and out_pair (both output projections, in place of out and
    mlp_out)."""
    a, m = layer.attention, layer.mlp
    roles = dict.fromkeys(INT4_ROLES)
    roles.update(qkv=a.qkv_int4, out=a.out_int4, mlp_in=m.in_int4, mlp_out=m.out_int4)
    if layer.qkv_mlp is not None:
        roles.update(qkv=None, mlp_in=None, qkv_mlp=layer.qkv_mlp)
    if layer.out_pair is not None:
        roles.update(out=None, mlp_out=None, out_pair=layer.out_pair)
    return roles


def check_int4_splits(splits: dict, roles: set) -> dict:
    """DecodeRunner's int4_splits, checked: roles this model's decode step runs, whole numbers of at least 1."""
    for role, value in splits.items():
        if role not in roles:
            raise ValueError(
                f"int4_splits: no int4 linear of role {role!r} in this model's decode step (it has: "
                f"{', '.join(r for r in INT4_ROLES if r in roles) or 'none'})"
            )
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"int4_splits[{role!r}] must be a whole number of K slices >= 1, got {value!r}")
    return dict(splits)


def int4_separate_norm_min_batch() -> int:
    """The batch size from which int4 ops take their add + norm as a kernel in front (INT4_SEPARATE_NORM_MIN_BATCH):
    PATCHER_INT4_SEPARATE_NORM_BATCH, else that constant."""
    value = os.environ.get("PATCHER_INT4_SEPARATE_NORM_BATCH")
    if value is None:
        return INT4_SEPARATE_NORM_MIN_BATCH
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"PATCHER_INT4_SEPARATE_NORM_BATCH must be a batch size >= 1, got {value!r}")
    return int(value)


class StepState:
    """The static buffers one (batch size, cache capacity) pair decodes in; a captured graph reads only these."""

    def __init__(self, runner: DecodeRunner, batch: int, capacity: int):
        dev = runner.device
        self.batch, self.capacity = batch, capacity
        kv_shape = (runner.num_layers, batch, runner.num_kv_heads, capacity, runner.head_dim)
        self.k = torch.zeros(kv_shape, dtype=runner.dtype, device=dev)
        self.v = torch.zeros(kv_shape, dtype=runner.dtype, device=dev)
        self.tokens = torch.zeros(batch, capacity + 1, dtype=torch.long, device=dev)  # prompt + generated
        self.slot = torch.zeros(1, dtype=torch.long, device=dev)  # index of the current token (= its cache row)
        self.pad = torch.zeros(batch, dtype=torch.long, device=dev)  # leading pad tokens per row
        self.finished = torch.zeros(batch, dtype=torch.bool, device=dev)
        self.eos = torch.full((MAX_EOS_IDS,), -1, dtype=torch.long, device=dev)  # EOS ids, -1 for unused entries
        self.pad_token = torch.zeros((), dtype=torch.long, device=dev)
        self.x = torch.zeros(batch, runner.hidden, dtype=runner.dtype, device=dev)  # the current tokens' embeddings
        self.next_token_workspace = next_token_workspace(batch, dev)
        self.cublas = runner.device.type == "cuda" and batch >= CUBLAS_MIN_BATCH
        # Norms inside the GEMVs' prologues (on the CPU always: the reference path is the same either way).
        self.fused_norms = not self.cublas and (runner.device.type != "cuda" or runner.hidden <= FUSED_NORM_MAX_HIDDEN)
        # int4 ops: their add + norm as int4_norm_prologue in front of them (INT4_SEPARATE_NORM_MIN_BATCH).
        self.int4_separate_norm = batch >= runner.int4_separate_norm_batch
        self.splits = runner.attention_splits(batch)
        self.workspace = decode_attention_workspace(
            batch, runner.num_heads, runner.num_kv_heads, runner.head_dim, self.splits, dev
        )
        self.cos, self.sin = runner.rope_tables(capacity)
        # GPTQ int4 linears: K splits per linear for this batch size, and one workspace the kernels of one stream
        # share (each leaves its counters zero, and they run one after another); the branch stream has its own.
        self.int4_splits = {key: runner.int4_splits(batch, lin, head) for key, (lin, head) in runner.int4.items()}
        sizes = [
            int4.workspace_numel(batch, lin, self.int4_splits[key], head) for key, (lin, head) in runner.int4.items()
        ]
        self.int4_workspace = torch.zeros(max(sizes, default=0), dtype=torch.int32, device=dev)
        branch_size = max(sizes, default=0) if runner.branch_stream is not None else 0
        self.branch_int4_workspace = torch.zeros(branch_size, dtype=torch.int32, device=dev)
        self.deferred = self._deferred_outputs(runner, batch)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.graph_sampling: Sampling | None = None
        # Every layer in one persistent kernel (int4 models on Hopper), or the reason it is not used.
        self.step_kernel: StepKernel | None = None
        self.step_kernel_reason: str | None = None
        if runner.use_step_kernel:
            try:
                self.step_kernel = StepKernel(runner, self, timeline=runner.step_timeline)
            except StepKernelUnavailable as e:
                self.step_kernel_reason = str(e)
        else:
            self.step_kernel_reason = "off (opt-in: PATCHER_STEP_KERNEL=1 or DecodeRunner(use_step_kernel=True))"

    @staticmethod
    def _deferred_outputs(runner: DecodeRunner, batch: int) -> dict:
        """(kind, layer) -> DeferredOut for runner.deferred: each producer zeroes the accumulator of the producer of
        its kind before it (cyclically, the first one the last one's, which the step before filled)."""
        out = {}
        for (kind, i), lin in runner.deferred.items():
            n = sum(lin.widths)
            rows = None
            if any(b is not None for b in lin.bias):  # the reader adds round(round(acc) + bias), as finish_values
                bias = [torch.zeros(w, device=runner.device) if b is None else b for b, w in zip(lin.bias, lin.widths)]
                rows = torch.cat([b.to(runner.dtype) for b in bias]).expand(batch, n).contiguous()
            out[(kind, i)] = DeferredOut(torch.zeros(batch, n, dtype=torch.int64, device=runner.device), rows)
        for kind in {k for k, _ in out}:
            keys = sorted(key for key in out if key[0] == kind)
            for prev, key in zip(keys[-1:] + keys[:-1], keys):
                out[key].clear = out[prev].acc
        return out

    @property
    def nbytes(self) -> int:
        buffers = (self.k, self.v, self.tokens, self.x, self.workspace, self.int4_workspace, self.branch_int4_workspace)
        buffers += tuple(t for d in self.deferred.values() for t in (d.acc, d.bias_rows) if t is not None)
        step = self.step_kernel.nbytes if self.step_kernel is not None else 0
        return sum(t.numel() * t.element_size() for t in buffers) + step


class DecodeRunner:
    def __init__(
        self,
        model,
        use_graphs: bool = True,
        use_step_kernel: bool | None = None,
        step_timeline: bool = False,
        merge_int4: bool = True,
        fuse_next_token: bool = True,
        defer_int4: bool | None = None,
        defer_qkv: bool | None = None,
        int4_separate_norm_batch: int | None = None,
        int4_splits: dict[str, int] | None = None,
    ):
        config = model.config
        entry = REGISTRY[config.model_type]
        spec = entry.spec
        base = getattr(model, spec.base_model, model)
        self.model, self.config, self.spec = model, config, spec
        self.embed = model.get_input_embeddings()
        # next_token writes the next step's input itself where the embedding is a plain table lookup; otherwise
        # (a subclass with its own forward, max_norm) the step runs the module on the tokens. fuse_next_token=False:
        # the step's end as torch ops instead (next_token's reference: argmax, the token write and the slot add; the
        # embedding looked up at the next step's start), for comparison.
        plain = type(self.embed).forward is torch.nn.Embedding.forward and self.embed.max_norm is None
        fused = fuse_next_token and plain and self.embed.weight.is_contiguous()
        self.embed_weight = self.embed.weight if fused else None
        self.next_token_ops = None if fuse_next_token else REFERENCE
        lm_head = model.get_output_embeddings()
        self.lm_weight, self.lm_bias = lm_head.weight, getattr(lm_head, "bias", None)
        self.rotary = base.rotary_emb

        def norm_params(norm) -> tuple:
            return norm.weight, getattr(norm, "bias", None), float(getattr(norm, spec.eps_attr))

        final_norm = getattr(base, spec.final_norm)
        self.final_norm = norm_params(final_norm)
        self.final_separate_norm = separate_norm(final_norm._patcher.norm, final_norm._patcher.add_norm)
        self.parallel = spec.flag(config, spec.parallel_residual)
        self.layers = []
        for layer in getattr(base, spec.layers):
            attention, mlp = getattr(layer, spec.attention), getattr(layer, spec.mlp)
            if spec.mlp_gated:
                mlp_act = "silu_mul"
            else:
                mlp_act = "gelu_tanh" if getattr(mlp._patcher, "tanh", False) else "gelu"
            norms = (norm_params(getattr(layer, spec.input_norm)), norm_params(getattr(layer, spec.post_norm)))
            plan = layer._patcher
            if self.parallel:
                separate = (separate_dual_norm(plan), None)
            else:
                separate = (separate_norm(plan.norm, plan.add_norm), separate_norm(None, plan.post_add_norm))
            step = LayerStep(attention._patcher, mlp._patcher, float(attention.scaling), mlp_act, norms, separate)
            if merge_int4 and self.parallel and mlp_act != "silu_mul":  # GPT-NeoX int4 (module docstring)
                step.out_pair = plan.out_pair  # (stacked by patch_model where it could: patcher/layers/out_pair.py)
                a, m = attention._patcher, mlp._patcher
                if a.qkv_int4 is not None and m.in_int4 is not None:
                    step.qkv_mlp = int4.side_by_side(a.qkv_int4, m.in_int4)
            self.layers.append(step)
        self.ops = self.layers[0].attention.ops
        self.num_layers = len(self.layers)
        self.num_heads, self.num_kv_heads = spec.num_heads(config), spec.num_kv_heads(config)
        self.head_dim = spec.head_dim(config)
        self.hidden = self.lm_weight.shape[1]
        self.device, self.dtype = self.lm_weight.device, self.lm_weight.dtype
        self.use_graphs = use_graphs and self.device.type == "cuda"
        # The persistent int4 step kernel (step.py): None takes PATCHER_STEP_KERNEL (off unless it is 1).
        use_step_kernel = step_enabled() if use_step_kernel is None else use_step_kernel
        self.use_step_kernel = use_step_kernel and self.device.type == "cuda"
        self.step_timeline = step_timeline  # the step kernel records its timeline (step.timeline_summary)
        self.rms = spec.norm == "rms"
        # From this batch size on, int4 ops take their add + norm as a kernel in front (INT4_SEPARATE_NORM_MIN_BATCH).
        if int4_separate_norm_batch is None:
            int4_separate_norm_batch = int4_separate_norm_min_batch()
        self.int4_separate_norm_batch = int4_separate_norm_batch
        # Every GPTQ int4 linear of the step: id -> (Int4Linear, head_dim when its epilogue is RoPE, else None).
        self.int4 = {}
        for layer in self.layers:
            a, m = layer.attention, layer.mlp
            linears = (a.qkv_int4, self.head_dim), (a.out_int4, None), (m.in_int4, None), (m.out_int4, None)
            for lin, head in (*linears, (layer.out_pair, None), (layer.qkv_mlp, self.head_dim)):
                if lin is not None:
                    self.int4[id(lin)] = (lin, head)
        # GPT-NeoX's MLP stream (module docstring); none where every layer runs int4_qkv_mlp_in on one stream.
        merged = all(layer.qkv_mlp is not None for layer in self.layers)
        concurrent = self.device.type == "cuda" and self.parallel and not merged
        self.branch_stream = torch.cuda.Stream(self.device) if concurrent else None
        # int4 output projections that run as int4_gemv_acc (module docstring); None takes PATCHER_INT4_DEFER.
        # And the QKV projections, finished by the attention; None takes PATCHER_INT4_DEFER_QKV.
        self.defer_qkv = defer_qkv_enabled() if defer_qkv is None else defer_qkv
        self.deferred = self._deferred_linears() if (defer_enabled() if defer_int4 is None else defer_int4) else {}
        for (kind, _), lin in self.deferred.items():
            if kind == "qkv":  # a plain int4 op now (the attention applies RoPE): its K slices for plain tiles
                self.int4[id(lin)] = (lin, None)
        # The role of each int4 linear the step launches: the split rule's view of it (attention_beside), and
        # int4_splits, K slices by role instead of the rule's, for comparisons (evals.splits) and tuning.
        self.int4_roles = {
            id(lin): role for layer in self.layers for role, lin in int4_roles(layer).items() if lin is not None
        }
        self.int4_splits_override = check_int4_splits(int4_splits or {}, set(self.int4_roles.values()))
        self.states: dict[int, StepState] = {}  # batch size -> buffers (and graph), grown on demand

    # ---- setup ------------------------------------------------------------------------------------------------
    def _deferred_linears(self) -> dict:
        """(kind, layer) -> Int4Linear of every int4 output projection whose output the next op's int4 norm prologue
        reads: LLaMA/Qwen2's o_proj ("attn_out", read by the MLP's int4_gemv) and down ("mlp_out", by the next
        layer's QKV op), GPT-NeoX's out pair ("out", by the next layer's int4_qkv_mlp_in), the last layer's by the
        final norm (as int4_norm_prologue, in logits()); and with defer_qkv LLaMA/Qwen2's QKV ("qkv",
        int4_norm_gemv_acc, read by decode_attention_qkv_acc). A kind with a single producer keeps its meeting: that
        producer would zero its own accumulator."""
        found = {}
        for i, layer in enumerate(self.layers):
            a, m = layer.attention, layer.mlp
            following = self.layers[i + 1] if i + 1 < len(self.layers) else None
            if self.parallel:
                if layer.out_pair is not None and (following is None or following.qkv_mlp is not None):
                    found[("out", i)] = layer.out_pair
                continue
            if self.defer_qkv and a.qkv_int4 is not None:
                found[("qkv", i)] = a.qkv_int4
            if a.out_int4 is not None and m.in_int4 is not None:
                found[("attn_out", i)] = a.out_int4
            if m.out_int4 is not None and (following is None or following.attention.qkv_int4 is not None):
                found[("mlp_out", i)] = m.out_int4
        kinds = Counter(kind for kind, _ in found)
        return {key: lin for key, lin in found.items() if kinds[key[0]] > 1}

    def _accumulate(self, kind: str, i: int, x, x2, lin, st: StepState, early: bool = False) -> tuple:
        """x (and x2 beside it along k) through the deferred linear (kind, i) into its accumulator: (delta, delta2)
        for the reader's prologue."""
        d = st.deferred[(kind, i)]
        args = lin.args(bias=False)
        self.ops.int4_gemv_acc(x, x2, *args, st.int4_splits[id(lin)], st.int4_workspace, d.acc, d.clear, early)
        return d.acc, d.bias_rows

    def attention_splits(self, batch: int) -> int:
        """Key splits per (row, kv head): enough blocks to cover the GPU twice."""
        if self.device.type != "cuda":
            return 1
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        return max(1, min(MAX_SPLITS, math.ceil(2 * sms / (batch * self.num_kv_heads))))

    def int4_splits(self, batch: int, linear, head_dim) -> int:
        role = self.int4_roles.get(id(linear))
        if role in self.int4_splits_override:
            splits = self.int4_splits_override[role]
            limit = int4.splits_limit(batch, linear, self.dtype, head_dim)
            if not limit[0] <= splits <= limit[1]:
                raise ValueError(
                    f"int4_splits[{role!r}] = {splits}: the int4 kernels take {limit[0]} to {limit[1]} K slices for "
                    f"this linear at batch {batch} (K = {linear.in_features}; fewer make a slice too large for the "
                    "kernel's shared-memory stage, more leave slices with no rows)"
                )
            return splits
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count if self.device.type == "cuda" else 1
        return int4.splits_for(batch, linear, sms, head_dim, self.dtype, self.attention_beside(batch, linear))

    def attention_beside(self, batch: int, linear) -> int4.Beside | None:
        """The decode attention's blocks at a short context (one a query head and row) as the split rule sees them
        from `linear`, or None where it is not the linear just before or just after the attention: each takes half
        an SM, but below ATTENTION_HALF_SM_BLOCKS the form that finishes the QKV sums (~150 registers a thread)
        takes a whole one."""
        before = NEXT_TO_ATTENTION.get(self.int4_roles.get(id(linear)))
        if before is None:
            return None
        blocks = self.num_heads * batch
        from_acc = any(kind == "qkv" for kind, _ in self.deferred)
        whole = from_acc and blocks < ATTENTION_HALF_SM_BLOCKS
        return int4.Beside(blocks, 512 if whole else int4.ATTENTION_THREADS, before)

    def rope_tables(self, capacity: int):
        """cos/sin [capacity, rotary_dim] for positions 0..capacity-1, from the model's own rotary embedding."""
        positions = torch.arange(capacity, device=self.device)[None]
        probe = torch.empty(1, device=self.device, dtype=self.dtype)
        with torch.no_grad():
            cos, sin = self.rotary(probe, position_ids=positions)
        return cos[0].contiguous(), sin[0].contiguous()

    def state_for(self, batch: int, needed: int) -> StepState:
        state = self.states.get(batch)
        if state is None or state.capacity < needed:
            self.states.pop(batch, None)  # free the smaller cache (and its graph) first
            capacity = max(MIN_CAPACITY, 1 << (needed - 1).bit_length())
            state = self.states[batch] = StepState(self, batch, capacity)
        return state

    def memory_bytes(self) -> int:
        return sum(s.nbytes for s in self.states.values())

    def step_kernel_reason(self, batch: int) -> str | None:
        """None where the decode step of this batch size runs as one persistent kernel, else why not."""
        state = self.states.get(batch)
        return "no decode step of this batch size yet" if state is None else state.step_kernel_reason

    # ---- one decode step ------------------------------------------------------------------------------------
    # Every linear that reads a norm's output can take that add + norm as its prologue (norm_gemv,
    # norm_gemv_rope_cache, int4_gemv, int4_qkv_rope_cache): the op gets the residual stream, the delta(s) to add
    # and the norm's parameters, and returns (out, sum, h2). Dense linears at 4-8 rows are cuBLAS, and on GPUs
    # for hidden sizes above FUSED_NORM_MAX_HIDDEN the norm runs as its own kernel in front (the patch plans' norm
    # closures, LayerStep.separate_norms), with the same results. int4 linears (from INT4_SEPARATE_NORM_MIN_BATCH
    # rows: every batch size by default) take it as int4_norm_prologue in front: the same prologue code, so the same
    # values but for the last bit of the row statistics, which the two sum in blocks of different sizes.
    def _prologue(self, delta, delta2, norm, norm2=None) -> tuple:
        (w, b, eps), (w2, b2) = norm, (norm2[:2] if norm2 else (None, None))
        return (delta, delta2, w, b, w2, b2, eps, self.rms)

    def _norm_linear(self, x, pro, separate, weight, bias, act: str, st: StepState, int4_linear=None, fuse=True):
        """act(norm(x [+ deltas]) @ W^T + b) with its prologue fused where the kernels allow (and `fuse`), else the
        norm in front: int4_norm_prologue for an int4 linear, `separate` (a LayerStep.separate_norms entry) for a
        dense one. Returns (out, sum, h2)."""
        if int4_linear is not None:
            if not st.int4_separate_norm:
                return self.ops.int4_gemv(x, *pro, *int4_linear.args(), act, st.int4_splits[id(int4_linear)],
                                          st.int4_workspace)  # fmt: skip
            h, total, h2 = self.ops.int4_norm_prologue(x, *pro)
        elif st.fused_norms and fuse:
            return self.ops.norm_gemv(x, *pro, weight, bias, act)
        else:
            h, total, h2 = separate(x, pro[0], pro[1])
        return self._linear(h, weight, bias, act, st, int4_linear), total, h2

    def _linear(self, h, weight, bias, act: str, st: StepState, int4_linear=None, workspace=None):
        """x @ W^T (+ b) with the MLP activation: our GEMV (epilogue fused), or cuBLAS then the activation.
        `workspace`: the int4 workspace of the stream it runs on (default: the main stream's)."""
        if int4_linear is not None:
            workspace = st.int4_workspace if workspace is None else workspace
            return self.ops.int4_gemv(h, *NO_PROLOGUE, *int4_linear.args(), act, st.int4_splits[id(int4_linear)],
                                      workspace)[0]  # fmt: skip
        if not st.cublas:
            return self.ops.gemv(h, weight, bias, act)
        y = F.linear(h, weight, bias)
        if act == "silu_mul":
            return self.ops.silu_and_mul(y)
        if act != "none":
            return F.gelu(y, approximate="tanh" if act == "gelu_tanh" else "none")
        return y

    @staticmethod
    def _qkv_takes_norm(layer: LayerStep, st: StepState) -> bool:
        """Whether the QKV op computes the input norm in its prologue (int4, or dense with fused norms)."""
        return layer.attention.qkv_int4 is not None or st.fused_norms

    def _qkv(self, layer: LayerStep, index: int, x, pro, st: StepState):
        """The attention prologue: [add +] norm -> QKV -> RoPE -> K/V into the cache slot; returns (q, sum, h2).
        One kernel for int4 and for dense at 1-3 rows; cuBLAS between the norm and rope_qkv_cache at 4-8."""
        a, ops = layer.attention, self.ops
        if a.qkv_int4 is not None and st.int4_separate_norm:  # the norm in front, then the op from its output
            h, total, h2 = ops.int4_norm_prologue(x, *pro)
            return self._qkv_rope(layer, index, h, st), total, h2
        if not self._qkv_takes_norm(layer, st):
            h, total, h2 = layer.separate_norms[0](x, pro[0], pro[1])
            return self._qkv_rope(layer, index, h, st), total, h2
        rope = self._rope_args(layer, index, st)
        if a.qkv_int4 is not None:
            lin = a.qkv_int4
            return ops.int4_qkv_rope_cache(x, *pro, *lin.args(), *rope, a.interleaved, st.int4_splits[id(lin)],
                                           st.int4_workspace)  # fmt: skip
        return ops.norm_gemv_rope_cache(x, *pro, a.qkv_weight, a.qkv_bias, *rope, a.interleaved)

    def _qkv_acc(self, layer: LayerStep, index: int, x, pro, st: StepState) -> tuple:
        """The int4 QKV projection behind its add + norm into its accumulator (module docstring), for the attention
        to finish: (the DeferredOut to pass as _attention's q, sum)."""
        lin, d = layer.attention.qkv_int4, st.deferred[("qkv", index)]
        args = (*lin.args(bias=False), st.int4_splits[id(lin)], st.int4_workspace, d.acc, d.clear)
        if st.int4_separate_norm:
            h, total, _ = self.ops.int4_norm_prologue(x, *pro)
            self.ops.int4_gemv_acc(h, None, *args)
            return d, total
        total, _ = self.ops.int4_norm_gemv_acc(x, *pro, *args)
        return d, total

    def _qkv_rope(self, layer: LayerStep, index: int, h, st: StepState):
        """QKV -> RoPE -> K/V into the cache slot from the norm's output h; returns q."""
        a, ops = layer.attention, self.ops
        rope = self._rope_args(layer, index, st)
        if a.qkv_int4 is not None:  # the int4 op with RoPE and the cache writes in its epilogue, no prologue
            lin = a.qkv_int4
            return ops.int4_qkv_rope_cache(h, *NO_PROLOGUE, *lin.args(), *rope, a.interleaved, st.int4_splits[id(lin)],
                                           st.int4_workspace)[0]  # fmt: skip
        if not st.cublas:  # the GEMV with RoPE and the cache writes in its epilogue, no prologue
            return ops.norm_gemv_rope_cache(h, *NO_PROLOGUE, a.qkv_weight, a.qkv_bias, *rope, a.interleaved)[0]
        qkv = self._linear(h, a.qkv_weight, a.qkv_bias, "none", st)
        return ops.rope_qkv_cache(qkv, *rope, a.interleaved)

    def _qkv_mlp(self, layer: LayerStep, index: int, x, delta, delta2, st: StepState):
        """GPT-NeoX int4 in one op: [add +] both LayerNorms, QKV -> RoPE -> K/V into the cache from the first, the
        MLP's input projection and activation from the second; returns (q, MLP hidden, sum)."""
        a, lin = layer.attention, layer.qkv_mlp
        norm, post_norm = layer.norms
        pro = self._prologue(delta, delta2, norm, post_norm)
        rope = self._rope_args(layer, index, st)
        qkv_segments = len(a.qkv_int4.widths)
        args = (*lin.args(), *rope, a.interleaved, qkv_segments, layer.mlp_act, st.int4_splits[id(lin)],
                st.int4_workspace)  # fmt: skip
        if st.int4_separate_norm:  # both LayerNorms in front; the op's QKV tiles read h, its MLP tiles h2
            h, total, h2 = self.ops.int4_norm_prologue(x, *pro)
            q, hidden, _ = self.ops.int4_qkv_mlp_in(h, *NO_PROLOGUE, *args, h2)
            return q, hidden, total
        return self.ops.int4_qkv_mlp_in(x, *pro, *args)

    @staticmethod
    def _rope_args(layer: LayerStep, index: int, st: StepState) -> tuple:
        a = layer.attention
        return st.cos, st.sin, st.slot, st.pad, st.k[index], st.v[index], a.num_heads, a.num_kv_heads, a.head_dim

    def _parallel_mlp(self, layer: LayerStep, h, st: StepState, stream):
        """GPT-NeoX's MLP on h = ln2(x), queued on `stream` unless it is None: it then runs beside the attention
        path, and logits() joins the stream before the MLP's output is read. h and the output stay referenced until
        after that join, so neither stream reuses their memory while the other may still use it. With the layer's
        out pair, only the first linear (its output projection is the out pair's second half)."""
        m = layer.mlp
        workspace = st.int4_workspace
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))  # after the work queued so far
            workspace = st.branch_int4_workspace
        with torch.cuda.stream(stream):  # None: a no-op, the work stays on the current stream
            inner = self._linear(h, m.in_weight, m.in_bias, layer.mlp_act, st, m.in_int4, workspace)
            if layer.out_pair is not None:
                return inner
            return self._linear(inner, m.out_weight, m.out_bias, "none", st, m.out_int4, workspace)

    def _join(self, stream) -> None:
        if stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(stream)

    def _attention(self, layer: LayerStep, q, st: StepState, index: int, project: bool = True):
        """Attention over the cache and (with `project`) the output projection. q: the query [B, Hq, D], or the
        QKV projection's DeferredOut (q and the current token's K/V still in its accumulator: _qkv_acc)."""
        a = layer.attention
        if isinstance(q, DeferredOut):
            out = self.ops.decode_attention_qkv_acc(q.acc, q.bias_rows, st.cos, st.sin, st.slot, st.pad, st.k[index],
                                                    st.v[index], a.num_heads, a.interleaved, layer.scale, st.splits,
                                                    st.workspace)  # fmt: skip
        else:
            out = self.ops.decode_attention(q, st.k[index], st.v[index], st.slot, st.pad, layer.scale, st.splits,
                                            st.workspace)  # fmt: skip
        return self._linear(out, a.out_weight, a.out_bias, "none", st, a.out_int4) if project else out

    def _layers(self, x, st: StepState) -> tuple:
        """Every layer of the step, op by op: (residual, delta, delta2) for the final add + norm."""
        residual, delta, delta2 = x, None, None
        branch = self.branch_stream if PARALLEL_BRANCH else None
        for i, layer in enumerate(self.layers):
            m = layer.mlp
            norm, post_norm = layer.norms
            if self.parallel:  # GPT-NeoX: x + attn(ln1(x)) + mlp(ln2(x)), the MLP beside the attention path
                # (Each branch's first GEMV taking the adds and its own LayerNorm as prologue, so that both start at
                # once without the norm kernel, measured slower on the H100: Pythia-2.8B 2.22 -> 2.33 ms.)
                if layer.qkv_mlp is not None:  # int4: QKV and the MLP's input in one launch, on this stream
                    q, mlp_out, total = self._qkv_mlp(layer, i, residual, delta, delta2, st)
                elif self._qkv_takes_norm(layer, st):  # ln2(x) comes out of the QKV op as h2
                    pro = self._prologue(delta, delta2, norm, post_norm)
                    q, total, h_mlp = self._qkv(layer, i, residual, pro, st)
                    mlp_out = self._parallel_mlp(layer, h_mlp, st, branch)
                else:  # the norm kernel first, so that the MLP starts beside the QKV GEMV (forking it after the
                    # QKV GEMV instead, beside the attention, measured slower: Pythia-2.8B 2.19 -> 2.25 ms)
                    h, total, h_mlp = layer.separate_norms[0](residual, delta, delta2)
                    mlp_out = self._parallel_mlp(layer, h_mlp, st, branch)
                    q = self._qkv_rope(layer, i, h, st)
                residual = residual if delta is None else total
                pair = layer.out_pair
                attn = self._attention(layer, q, st, i, project=pair is None)
                if layer.qkv_mlp is None:
                    self._join(branch)
                elif pair is None:
                    mlp_out = self._linear(mlp_out, m.out_weight, m.out_bias, "none", st, m.out_int4)
                if pair is None:
                    delta, delta2 = attn, mlp_out
                else:  # both output projections in one GEMV over [attention | MLP hidden] (layers/out_pair.py)
                    splits = st.int4_splits[id(pair)]
                    # With int4_qkv_mlp_in the MLP hidden was written before the attention began: the op's MLP part
                    # streams its weights while the attention runs (H100, Pythia-2.8B int4: 1.50 -> 1.46 ms a token).
                    early = layer.qkv_mlp is not None
                    if ("out", i) in st.deferred:
                        delta, delta2 = self._accumulate("out", i, attn, mlp_out, pair, st, early)
                    else:
                        delta = self.ops.int4_gemv_cat(attn, mlp_out, *pair.args(), splits, st.int4_workspace, early)
                        delta2 = None
            else:
                pro = self._prologue(delta, delta2, norm)
                if ("qkv", i) in st.deferred:
                    q, total = self._qkv_acc(layer, i, residual, pro, st)
                else:
                    q, total, _ = self._qkv(layer, i, residual, pro, st)
                residual = residual if delta is None else total
                if ("attn_out", i) in st.deferred:
                    out = self._attention(layer, q, st, i, project=False)
                    attn, attn2 = self._accumulate("attn_out", i, out, None, layer.attention.out_int4, st)
                else:
                    attn, attn2 = self._attention(layer, q, st, i), None
                pro = self._prologue(attn, attn2, post_norm)
                inner, residual, _ = self._norm_linear(
                    residual, pro, layer.separate_norms[1], m.in_weight, m.in_bias, layer.mlp_act, st, m.in_int4
                )
                if ("mlp_out", i) in st.deferred:
                    delta, delta2 = self._accumulate("mlp_out", i, inner, None, m.out_int4, st)
                else:
                    delta, delta2 = self._linear(inner, m.out_weight, m.out_bias, "none", st, m.out_int4), None
        return residual, delta, delta2

    def logits(self, st: StepState, x: torch.Tensor | None = None) -> torch.Tensor:
        """The next-token logits [B, V] of the current tokens (st.tokens[:, slot]); K/V land in the cache.
        x: their embeddings [B, H] where already looked up (st.x, by next_token), else they are looked up here.

        The stream is carried as (residual, delta, delta2): each layer's first op adds the previous layer's
        output(s) into the residual as part of its norm prologue, and the final norm's add is the lm_head's."""
        if x is None:
            x = self.embed(st.tokens.index_select(1, st.slot).squeeze(1))
        if st.step_kernel is not None:
            residual, delta, delta2 = st.step_kernel.run(x)
        else:
            residual, delta, delta2 = self._layers(x, st)
        pro = self._prologue(delta, delta2, self.final_norm)
        if delta is not None and delta.dtype == torch.int64:  # the last layer's int4 projection left its sums unmet
            # The final norm reads them as the layers' norms do. Against the projection's meeting and the dense norm
            # kernel after it, in one process on the H100 (int4 g128, fp16, batch 1), us a step: Llama-3.1-8B -2 .. -9,
            # Qwen2-1.5B -9 .. -15, Pythia-2.8B within its noise (docs/int4_decode.md, "The last layer's sums read by
            # the final norm; the levers measured and not taken (session 34)").
            h = self.ops.int4_norm_prologue(residual, *pro)[0]
            return self._linear(h, self.lm_weight, self.lm_bias, "none", st)
        # The lm_head never takes the final norm as its prologue on a GPU: its vocab / 8 blocks would each
        # recompute the norm (H100, SmolLM2-135M: 42.8 us for the fused op, ~2 + 19 us for the two kernels).
        fuse = self.device.type != "cuda"
        return self._norm_linear(
            residual, pro, self.final_separate_norm, self.lm_weight, self.lm_bias, "none", st, fuse=fuse
        )[0]

    @staticmethod
    def scores(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
        """What next_token takes the argmax of: the logits (greedy), or for sampling, after HF's warpers in HF's
        order (temperature, top-k, top-p), probs / E with E ~ Exp(1), whose argmax is a draw from probs (no host
        sync, a graph-capturable RNG)."""
        if not sampling.do_sample:
            return logits
        scores = logits.float()
        if sampling.temperature != 1.0:
            scores = scores / sampling.temperature
        if 0 < sampling.top_k < scores.shape[-1]:
            kth = torch.topk(scores, sampling.top_k, dim=-1).values[..., -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if sampling.top_p < 1.0:
            sorted_scores, order = torch.sort(scores, descending=False)
            remove = sorted_scores.softmax(dim=-1).cumsum(dim=-1) <= (1 - sampling.top_p)
            remove[..., -1:] = False
            scores = scores.masked_fill(remove.scatter(1, order, remove), float("-inf"))
        probs = scores.softmax(dim=-1)
        return probs / torch.empty_like(probs).exponential_(1.0)

    def next_token(self, scores: torch.Tensor, st: StepState) -> None:
        """The token after the current one from `scores` (pad for finished rows; EOS ids finish a row) written at
        slot + 1, the slot advanced, and (plain embeddings) the new token's embedding in st.x: one kernel."""
        ops = self.next_token_ops or self.ops
        ops.next_token(scores, st.tokens, st.slot, st.finished, st.eos, st.pad_token, self.embed_weight, st.x,
                       st.next_token_workspace)  # fmt: skip

    def step(self, st: StepState, sampling: Sampling) -> None:
        x = st.x if self.embed_weight is not None else None
        self.next_token(self.scores(self.logits(st, x), sampling), st)

    # ---- CUDA graph -----------------------------------------------------------------------------------------
    def _capture(self, st: StepState, sampling: Sampling) -> None:
        """Captures one step on the state's buffers. Runs before prefill: the warm-up's writes are overwritten."""
        rng = torch.cuda.get_rng_state(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side), torch.no_grad():
            self.step(st, sampling)  # warm-up: allocator, lazy module state
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph), torch.no_grad():
            self.step(st, sampling)
        torch.cuda.set_rng_state(rng, self.device)
        st.graph, st.graph_sampling = graph, sampling

    # ---- generate -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        new_tokens: int,
        sampling: Sampling,
        eos: list[int],
        pad_token_id: int,
    ) -> torch.Tensor:
        """prompt [B, T] (left-padded) -> [B, T + n] with n <= new_tokens (fewer if every row hit EOS)."""
        B, T = input_ids.shape
        st = self.state_for(B, T + new_tokens)
        has_eos = bool(eos)
        if has_eos and self.embed_weight is not None and not 0 <= pad_token_id < self.embed_weight.shape[0]:
            raise ValueError(
                f"pad_token_id {pad_token_id} is outside the vocabulary (0 .. {self.embed_weight.shape[0] - 1}): "
                "finished rows continue with it"
            )
        if self.use_graphs and (st.graph is None or st.graph_sampling != sampling):
            st.graph = None
            self._capture(st, sampling)
        # Each step leaves the int4 accumulators as the next one needs them; one cut short (an exception in an eager
        # step) may not have, so every generate starts from zeros.
        for deferred in st.deferred.values():
            deferred.acc.zero_()
        st.eos.fill_(-1)
        if eos:
            st.eos[: len(eos)].copy_(torch.tensor(eos, dtype=torch.long))
        st.pad_token.fill_(pad_token_id)
        st.finished.zero_()
        st.pad.copy_((attention_mask == 0).sum(-1))
        st.tokens[:, :T].copy_(input_ids)

        # Prefill with the patched model (fused kernels + HF attention), then move its K/V into the static cache.
        position_ids = (attention_mask.long().cumsum(-1) - 1).masked_fill_(attention_mask == 0, 1)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=1,
        )
        for i, layer in enumerate(out.past_key_values.layers):
            st.k[i, :, :, :T].copy_(layer.keys)
            st.v[i, :, :, :T].copy_(layer.values)
        last_logits = out.logits[:, -1]
        del out
        st.slot.fill_(T - 1)  # next_token writes the first new token at T and advances the slot to it
        self.next_token(self.scores(last_logits, sampling), st)

        steps = new_tokens - 1
        for i in range(steps):
            if st.graph is not None:
                st.graph.replay()
            else:
                self.step(st, sampling)
            if has_eos and (i + 1) % EOS_CHECK_EVERY == 0 and bool(st.finished.all()):
                steps = i + 1
                break
        length = T + 1 + steps
        tokens = st.tokens[:, :length].clone()
        if has_eos and bool(st.finished.all()):
            # HF stops right after the step in which the last row finished.
            generated = tokens[:, T:]
            is_eos = (generated[..., None] == st.eos).any(-1)
            first_eos = torch.where(is_eos.any(-1), is_eos.float().argmax(-1), generated.shape[1] - 1)
            tokens = tokens[:, : T + int(first_eos.max()) + 1]
        return tokens
