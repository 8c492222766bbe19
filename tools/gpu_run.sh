#!/usr/bin/env bash
# The GPU-machine session script: build, test and benchmark in a few long calls. Run from the repo root on the
# GPU machine (python3 there has torch, transformers, pytest); logs and JSON go to $OUT (default /tmp/patcher-out).
#   tools/gpu_run.sh check      build the kernels, kernel + model tests, a quick eager TPOT, the per-op benchmark
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-/tmp/patcher-out}
mkdir -p "$OUT"
step() { echo; echo "=== $* ($(date +%T))"; }

case "${1:-}" in
  check)
    step environment
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
    step build
    /usr/bin/time -f "build wall %e s" python3 -c "from patcher.ops import extension; extension.load()" 2>&1 | tee "$OUT/build.log"
    step kernel tests
    timeout 200 python3 -m pytest -q -rf --maxfail=25 tests/test_kernels.py 2>&1 | tee "$OUT/test_kernels.log" | tail -40
    step model tests
    timeout 200 python3 -m pytest -q -rf --maxfail=25 tests/test_models.py tests/test_ops_reference.py 2>&1 \
      | tee "$OUT/test_models.log" | tail -30
    step quick eager TPOT, Pythia-2.8B shape
    timeout 150 python3 -m evals.tpot --random-config pythia-2.8b --modes hf-eager,patched-eager --new-tokens 32 \
      --repeats 2 --json "$OUT/tpot_quick.json" 2>&1 | grep -v "it/s" | tail -12
    step per-op benchmark
    timeout 120 python3 -m evals.ops --reps 20 --json "$OUT/ops.json" 2>&1 | grep -v "it/s" | tail -80
    ;;
  *)
    echo "usage: tools/gpu_run.sh check" >&2
    exit 2
    ;;
esac
