"""Each fused op against the unfused PyTorch sequence it replaces (GPU): `patcher-ops` or `python -m evals.ops`.

The unfused side is the HF modules' own code (LlamaRMSNorm after a residual add, two nn.LayerNorms after GPT-NeoX's
three-way sum, apply_rotary_pos_emb on the split projection, act(gate) * up, F.linear for a decode GEMV, SDPA over
HF's static cache, ...). For each op, architecture shape, dtype and token count (1 = decode, 4096 = prefill; the
decode-path ops at batch 1, 4 and 8) it reports the median GPU time of both, the fused op's achieved bandwidth (the
fewest bytes it must move: every input read once, every output written once) as GB/s and as a percentage of the HBM
read bandwidth measured in the same run, and the speedup.

Timing: prefill shapes with CUDA events around each call, the L2 cache flushed before each run. Decode shapes are
timed inside a CUDA graph of many calls (launch gaps as in the decode path, not Python overhead), cycling over
enough copies of the inputs that they come from HBM, not from the 50 MB L2.
"""

from __future__ import annotations

import argparse
import sys

import torch
from tqdm import tqdm

from . import common
from .decode_op_cases import DECODE_CASES
from .op_cases import CASES


def graph_time_us(calls: list, reps: int = 20) -> float:
    """GPU time per call (us) of `calls` run round-robin inside one CUDA graph (200 calls per replay)."""
    per_replay = 200
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in calls:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(per_replay):
            calls[i % len(calls)]()
    return common.gpu_time_ms(graph.replay, reps=reps, warmup=2) * 1e3 / per_replay


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog=common.prog("evals.ops"), description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ops", default=None, help=f"comma-separated subset of {','.join([*CASES, *DECODE_CASES])}")
    parser.add_argument("--dtypes", default="fp32,fp16,bf16")
    parser.add_argument("--tokens", default="1,4096")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--decode-batches", default="1,4,8", help="batch sizes for the decode-path ops")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    names = args.ops.split(",") if args.ops else [*CASES, *DECODE_CASES]
    unknown = set(names) - set(CASES) - set(DECODE_CASES)
    if unknown:
        parser.error(f"unknown ops {sorted(unknown)}; choose from {[*CASES, *DECODE_CASES]}")
    if not torch.cuda.is_available():
        sys.exit("error: evals.ops times CUDA kernels and needs a GPU")

    from patcher.ops import backend_for

    ops = backend_for(torch.device("cuda"), "kernels")
    dtypes = [common.DTYPES[d] for d in args.dtypes.split(",")]
    token_counts = [int(t) for t in args.tokens.split(",")]
    bandwidth = common.hbm_read_bandwidth_gbs(torch.device("cuda"))
    jobs = [
        (op, arch, dt, t, None)
        for op in names
        if op in CASES
        for arch in CASES[op][1]
        for dt in dtypes
        for t in token_counts
    ]
    batches = [int(b) for b in args.decode_batches.split(",")]
    jobs += [
        (op, arch, dt, b, v)
        for op in names
        if op in DECODE_CASES
        for arch in DECODE_CASES[op][1]
        for dt in dtypes
        if dt != torch.float32
        for b in batches
        for v in DECODE_CASES[op][2]
    ]
    rows = []
    for op, arch, dtype, tokens, variant in tqdm(jobs, desc="ops", file=sys.stderr):
        if op in CASES:
            case = CASES[op][0](tokens, arch, dtype, ops)
            if case is None:  # not measured at this token count
                continue
            fused, unfused, nbytes = case
            if tokens > 1:
                fused_us = common.gpu_time_ms(fused, reps=args.reps, flush=True) * 1e3
                unfused_us = common.gpu_time_ms(unfused, reps=args.reps, flush=True) * 1e3
            else:
                fused_us, unfused_us = graph_time_us([fused]), graph_time_us([unfused])
        else:
            case = DECODE_CASES[op][0](tokens, arch, dtype, ops, variant)
            if case is None:  # the variant does not apply to this architecture
                continue
            fused, unfused, nbytes = case
            fused_us, unfused_us = graph_time_us(fused), graph_time_us(unfused)
        gbs = nbytes / (fused_us * 1e-6) / 1e9
        rows.append(
            {
                "op": f"{op}[{variant}]" if variant else op,
                "arch": arch,
                "tokens": tokens,
                "dtype": str(dtype).replace("torch.", ""),
                "fused_us": fused_us,
                "unfused_us": unfused_us,
                "speedup": unfused_us / fused_us,
                "bytes": nbytes,
                "fused_gbs": gbs,
                "pct_hbm": 100 * gbs / bandwidth,
            }
        )
        del fused, unfused
        torch.cuda.empty_cache()
    print(
        common.table(
            rows,
            [
                ("op", "op", ""),
                ("arch", "shape", ""),
                ("tokens", "tokens/batch", "d"),
                ("dtype", "dtype", ""),
                ("fused_us", "fused us", ".1f"),
                ("unfused_us", "unfused us", ".1f"),
                ("speedup", "speedup", ".2f"),
                ("fused_gbs", "fused GB/s", ".0f"),
                ("pct_hbm", "% HBM", ".0f"),
            ],
        )
    )
    print(f"measured HBM read bandwidth: {bandwidth:.0f} GB/s")
    common.write_json(
        args.json,
        {
            "tool": "evals.ops",
            "hbm_read_bandwidth_gbs": bandwidth,
            "environment": common.environment(torch.device("cuda"), "evals.ops"),
            "results": rows,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
