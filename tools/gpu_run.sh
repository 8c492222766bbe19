#!/usr/bin/env bash
# The GPU-machine session script: build, test and benchmark in a few long calls. Run from the repo root on the
# GPU machine (python3 there has torch, transformers, pytest); logs and JSON go to $OUT (default /tmp/patcher-out).
#   tools/gpu_run.sh check      build the kernels, kernel + model tests, a quick eager TPOT, the per-op benchmark
#   tools/gpu_run.sh decode     + decode-path kernels and graph tests, compute-sanitizer, TPOT with the graph path
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
  decode)
    step environment
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader
    step build
    /usr/bin/time -f "build wall %e s" python3 -c "from patcher.ops import extension; extension.load()" 2>&1 | tee "$OUT/build.log"
    step kernel tests
    timeout 240 python3 -m pytest -q -rf --maxfail=30 tests/test_kernels.py -k "not bad_inputs" 2>&1 \
      | tee "$OUT/test_kernels.log" | tail -30
    step bad inputs
    timeout 60 python3 -m pytest -v -p no:randomly tests/test_kernels.py -k bad_inputs > "$OUT/bad_inputs.log" 2>&1
    tail -14 "$OUT/bad_inputs.log"
    if grep -q "Fatal Python error" "$OUT/bad_inputs.log"; then
      crashed=$(grep -o "test_bad_inputs_get_clear_errors\[[^]]*\]" "$OUT/bad_inputs.log" | tail -1)
      step "backtrace of $crashed"
      timeout 150 cuda-gdb -batch -ex run -ex bt --args python3 -m pytest -q "tests/test_kernels.py::$crashed" \
        2>&1 | grep -v "^\[New Thread\|^\[Thread" | tail -40
    fi
    step model and decode tests
    timeout 240 python3 -m pytest -q -rf tests/test_models.py tests/test_decode.py -s 2>&1 \
      | tee "$OUT/test_models.log" | grep -v "it/s" | tail -30
    step compute-sanitizer memcheck
    timeout 200 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q \
      "tests/test_kernels.py::test_norms[add_dual_layer_norm-misaligned-shape1-dtype0]" \
      "tests/test_kernels.py::test_norms[add_rms_norm-row-strided-shape5-dtype0]" \
      "tests/test_kernels.py::test_norms[layer_norm-contiguous-shape0-dtype2]" \
      "tests/test_kernels.py::test_rope_qkv[row-strided-pythia-2.8b-batch_tokens1-dtype0]" \
      "tests/test_kernels.py::test_silu_and_mul[misaligned-769-7-dtype0]" \
      "tests/test_kernels.py::test_bias_gelu[False-misaligned-769-7-dtype0]" \
      "tests/test_kernels.py::test_gemv[silu_mul-shape3-3-dtype0]" \
      "tests/test_kernels.py::test_gemv[none-shape4-5-dtype1]" \
      "tests/test_kernels.py::test_rope_qkv_cache[4-pythia-2.8b-dtype0]" \
      "tests/test_kernels.py::test_decode_attention[3-7-129-heads3-80-dtype0]" \
      "tests/test_kernels.py::test_decode_attention[8-64-1000-heads1-128-dtype1]" 2>&1 | tail -12
    echo "compute-sanitizer exit: ${PIPESTATUS[0]}"
    for m in pythia-2.8b qwen2-1.5b llama-3.1-8b; do
      step "TPOT $m"
      timeout 150 python3 -m evals.tpot --random-config $m --modes hf-eager,patched-eager,patched --new-tokens 64 \
        --repeats 2 --json "$OUT/tpot_$m.json" 2>&1 | grep -v "it/s" | tail -8
    done
    step decode-path op benchmark
    timeout 120 python3 -m evals.ops --ops gemv,decode_attention --dtypes fp16 --decode-batches 1,8 \
      --json "$OUT/ops_decode.json" 2>&1 | grep -v "it/s" | tail -40
    ;;
  tests)  # every test, GPU included
    step environment
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader
    step build
    /usr/bin/time -f "build wall %e s" python3 -c "from patcher.ops import extension; extension.load()" 2>&1 | tee "$OUT/build.log"
    step kernel tests
    timeout 240 python3 -m pytest -q -rf --maxfail=30 tests/test_kernels.py -k "not bad_inputs" 2>&1 \
      | tee "$OUT/test_kernels.log" | tail -25
    step bad inputs
    timeout 60 python3 -m pytest -v tests/test_kernels.py -k bad_inputs 2>&1 | tail -12
    step model and decode tests
    timeout 240 python3 -m pytest -q -rf tests/test_models.py tests/test_decode.py tests/test_ops_reference.py -s 2>&1 \
      | tee "$OUT/test_models.log" | grep -v "it/s" | tail -25
    ;;
  quick-tpot)  # the default generate path (graph) on every real-size shape, and the decode ops
    for m in pythia-2.8b qwen2-1.5b llama-3.1-8b smollm2-135m; do
      step "TPOT $m"
      timeout 100 python3 -m evals.tpot --random-config $m --modes patched-eager,patched --new-tokens 64 \
        --repeats 2 --json "$OUT/tpot_$m.json" 2>&1 | grep -v "it/s" | tail -5
    done
    step decode-path op benchmark
    timeout 100 python3 -m evals.ops --ops gemv,decode_attention --dtypes fp16 --decode-batches 1 \
      --json "$OUT/ops_decode.json" 2>&1 | grep -v "it/s" | tail -25
    ;;
  *)
    echo "usage: tools/gpu_run.sh check|decode|tests|quick-tpot" >&2
    exit 2
    ;;
esac
