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
  round4)  # tests of the changed kernels, the main TPOT table rows, the Pythia context sweep
    mkdir -p /tmp/m && cp .carry/smolA/* /tmp/m/ 2>/dev/null
    step build
    /usr/bin/time -f "build wall %e s" python3 -c "from patcher.ops import extension; extension.load()" 2>&1 | tail -2
    step kernel and decode tests
    timeout 150 python3 -m pytest -q -rf --maxfail=20 tests/test_kernels.py -k "not bad_inputs" 2>&1 | tail -4
    timeout 150 python3 -m pytest -q -rf tests/test_decode.py tests/test_models.py -k "cuda or graph or ten_thousand" 2>&1 | tail -4
    step "exception repro (one process, then each case alone)"
    timeout 60 python3 tools/exception_repro.py 2>&1 | tail -6
    timeout 90 cuda-gdb -batch -ex run -ex "bt 12" --args python3 tools/exception_repro.py 2>&1 \
      | grep -E "^#|caught|signal" | cut -c1-220 | head -16
    mkdir -p "$OUT/r"
    step "TPOT pythia-2.8b, every mode"
    timeout 300 python3 -m evals.tpot --random-config pythia-2.8b --repeats 3 --json "$OUT/r/tpot_pythia-2.8b.json" 2>&1 \
      | grep -v "it/s" | tail -9
    step "TPOT sweep pythia-2.8b"
    timeout 240 python3 -m evals.tpot --random-config pythia-2.8b --modes hf-eager,hf-static-compiled,patched \
      --sweep-context 128,512,1024,2048,4096 --new-tokens 32 --repeats 2 --no-profile \
      --json "$OUT/r/tpot_sweep_pythia-2.8b.json" 2>&1 | grep -v "it/s" | tail -18
    tar -C "$OUT" -czf "$OUT/results4.tar.gz" r && rm -rf "$OUT/r"
    ;;
  round5)  # SmolLM2 (the second half of the GGUF), perplexity, and the remaining TPOT rows
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      && export PYTHONPATH="$PYTHONPATH:/tmp/site"
    cat /tmp/m/*.part0 .carry/smolB/*.part1 > /tmp/m/SmolLM2-135M-Instruct.Q4_1.gguf && ls -la /tmp/m
    export PATCHER_SMOLLM2_GGUF=/tmp/m/SmolLM2-135M-Instruct.Q4_1.gguf PATCHER_WIKITEXT=$PWD/.carry/data/wikitext-2-raw-test.txt
    mkdir -p "$OUT/r"
    step SmolLM2 tests
    timeout 150 python3 -m pytest -q -rf -s tests/test_smollm2.py tests/test_decode.py -k "smollm2 or cuda_logits" 2>&1 \
      | grep -v "it/s" | tail -8
    step "perplexity SmolLM2 fp16, full WikiText-2"
    timeout 200 python3 -m evals.perplexity --gguf-file "$PATCHER_SMOLLM2_GGUF" --text-file "$PATCHER_WIKITEXT" \
      --dtype fp16 --json "$OUT/r/ppl_smollm2_fp16.json" 2>&1 | grep -v "it/s\|Converting\|Loading" | tail -6
    step "TPOT SmolLM2 (trained)"
    timeout 150 python3 -m evals.tpot --gguf-file "$PATCHER_SMOLLM2_GGUF" --modes hf-eager,hf-static-compiled,patched \
      --repeats 3 --json "$OUT/r/tpot_smollm2.json" 2>&1 | grep -v "it/s\|Converting\|Loading" | tail -6
    for m in qwen2-1.5b llama-3.1-8b; do
      step "TPOT $m"
      timeout 200 python3 -m evals.tpot --random-config $m --modes hf-eager,hf-static-compiled,patched-eager,patched \
        --new-tokens 64 --repeats 2 --json "$OUT/r/tpot_$m.json" 2>&1 | grep -v "it/s" | tail -7
    done
    tar -C "$OUT" -czf "$OUT/results5.tar.gz" r && rm -rf "$OUT/r"
    ;;
  *)
    echo "usage: tools/gpu_run.sh check|decode|tests|quick-tpot|round4|round5" >&2
    exit 2
    ;;
esac
