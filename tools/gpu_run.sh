#!/usr/bin/env bash
# The checks a change to the kernels or the decode path must pass on a CUDA machine, run from the repository root
# (python3 there has the project installed, with pytest):
#   tools/gpu_run.sh tests   build the CUDA kernels, then run the whole test suite (GPU tests included)
#   tools/gpu_run.sh tpot    decode TPOT of the four model shapes the README reports, fp16 and GPTQ int4 (group size
#                            128), random weights, one JSON file each
# Logs and JSON files go to $OUT (default /tmp/patcher-out).
set -euo pipefail
OUT=${OUT:-/tmp/patcher-out}
mkdir -p "$OUT"

case "${1:-}" in
  tests)
    python3 -c "from patcher.ops import build; build.load()"
    python3 -m pytest -q -rf tests 2>&1 | tee "$OUT/tests.log"
    ;;
  tpot)
    for model in pythia-2.8b llama-3.1-8b qwen2-1.5b smollm2-135m; do
      python3 -m evals.tpot --random-config "$model" --modes patched --json "$OUT/tpot_${model}_fp16.json"
      python3 -m evals.tpot --random-config "$model" --int4-random 128 --modes patched \
        --json "$OUT/tpot_${model}_int4.json"
    done
    ;;
  *)
    echo "usage: tools/gpu_run.sh tests|tpot" >&2
    exit 2
    ;;
esac
