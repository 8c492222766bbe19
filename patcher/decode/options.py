"""Every tunable of the decode step, in one typed object.

The defaults are the fastest measured choices on an H100 (docs/decode-fp16.md and docs/decode-int4.md hold the
measurements and the alternatives). The other values exist to compare a choice against its alternative in one
process (`python -m evals.splits`, `evals.tpot --modes`); they all give the same tokens within float rounding.

    runner = DecodeRunner(model, DecodeOptions(use_graphs=False))
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass(frozen=True)
class DecodeOptions:
    # Capture each decode step once per (batch, cache size) as a CUDA graph and replay it (CUDA only).
    use_graphs: bool = True
    # next_token picks the token, writes it, advances the slot and looks up the next embedding in one kernel; off:
    # the same as torch ops, the embedding looked up at the next step's start.
    fuse_next_token: bool = True
    # GPT-NeoX int4: QKV and the MLP's input projection in one launch (int4_qkv_mlp_in), and both output projections
    # as one GEMV over [attention | MLP hidden] (int4_gemv_cat); off: five kernels and the MLP on a second stream.
    merge_int4: bool = True
    # int4 output projections add their K slices into a fixed-point accumulator that the next op's norm prologue
    # reads (int4_gemv_acc), instead of meeting through a workspace.
    defer_int4: bool = True
    # LLaMA/Qwen2 int4 QKV hands its sums to the attention, which rounds them, adds the bias, applies RoPE and
    # writes K/V (decode_attention_qkv_acc).
    defer_qkv: bool = True
    # From this batch size on, an int4 op's add + norm runs as its own kernel in front of it (int4_norm_prologue);
    # below it, inside the op, where every block recomputes the row statistics.
    int4_separate_norm_batch: int = 1
    # K slices per int4 linear role ("qkv", "out", "mlp_in", "mlp_out", "qkv_mlp", "out_pair") instead of the rule
    # in ops/int4.py (splits_for).
    int4_splits: dict = field(default_factory=dict)
    # From this batch size on, dense linears run on cuBLAS (tensor cores) instead of the GEMV kernels, whose FMAs
    # stop hiding behind the weight stream at 4-8 rows.
    cublas_min_batch: int = 4
    # Up to this hidden size dense GEMVs take the add + RMSNorm (LLaMA, Qwen2) as their prologue: every resident
    # block recomputes the row's norm after its wait, which pays only where the hidden size is small and launches
    # dominate (docs/decode-fp16.md, "How the step is built").
    fused_norm_max_hidden: int = 1024
    # The same for GPT-NeoX's LayerNorms, where one prologue replaces the three-way sum and both LayerNorms of the
    # parallel residual: it pays up to Pythia-2.8B's 2560 (the widest measured).
    fused_layer_norm_max_hidden: int = 2560
    # GPT-NeoX's parallel residual: the MLP on a second stream beside the attention path (dense, or merge_int4 off).
    parallel_branch: bool = True

    def __post_init__(self):
        for name in ("use_graphs", "fuse_next_token", "merge_int4", "defer_int4", "defer_qkv", "parallel_branch"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"DecodeOptions.{name} must be a bool, got {getattr(self, name)!r}")
        for name in (
            "int4_separate_norm_batch",
            "cublas_min_batch",
            "fused_norm_max_hidden",
            "fused_layer_norm_max_hidden",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"DecodeOptions.{name} must be a whole number >= 1, got {value!r}")
        if not isinstance(self.int4_splits, dict):
            raise TypeError(f"DecodeOptions.int4_splits must be a dict of role -> K slices, got {self.int4_splits!r}")
        for role, value in self.int4_splits.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"int4_splits[{role!r}] must be a whole number of K slices >= 1, got {value!r}")

    def replace(self, **changes) -> DecodeOptions:
        return dataclasses.replace(self, **changes)

    def changed(self) -> dict:
        """The fields that differ from the defaults."""
        default = DecodeOptions()
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {name: value for name, value in values.items() if value != getattr(default, name)}
