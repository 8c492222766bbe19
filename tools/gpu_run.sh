#!/usr/bin/env bash
# The GPU-machine session script: build, test and benchmark in a few long calls. Run from the repo root on the
# GPU machine (python3 there has torch, transformers, pytest); logs and JSON go to $OUT (default /tmp/patcher-out).
#   tools/gpu_run.sh tests       build, then every test (kernels, models, decode path)
#   tools/gpu_run.sh verify      + the real-size logit tests, bad inputs, compute-sanitizer, SmolLM2 on the GPU
#                                (needs the SmolLM2 GGUF at $PATCHER_SMOLLM2_GGUF), the patched+compiled mode
#   tools/gpu_run.sh quick-tpot  the default generate path on every real-size shape, and the decode ops
#   tools/gpu_run.sh measure     the README's TPOT table, Pythia at batch 4/8, context 2048 and bf16, the per-op benchmark
#   tools/gpu_run.sh int4        GPTQ int4 kernel tests, per-op benchmark, whole-model int4 TPOT against fp16
#   tools/gpu_run.sh smollm2     SmolLM2 GPU tests, int4 g128 perplexity, fp32/bf16 perplexity
#   tools/gpu_run.sh multi-gpu   a model split over two GPUs (accelerate device_map), patched
#   tools/gpu_run.sh step        the int4 decode-step kernel: its tests, timelines, int4 TPOT against the per-op step
#   tools/gpu_run.sh step-bounds the step kernel's timelines with its arithmetic and/or weight copies switched off
#   tools/gpu_run.sh int4-check  int4 kernel, GPTQ, decode and step-kernel tests; int4 and fp16 TPOT side by side
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-/tmp/patcher-out}
mkdir -p "$OUT"
step() { echo; echo "=== $* ($(date +%T))"; }

case "${1:-}" in
  tests)  # every test, GPU included
    step environment
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader
    step build
    /usr/bin/time -f "build wall %e s" python3 -c "from patcher.ops import extension; extension.load()" 2>&1 | tee "$OUT/build.log"
    step kernel tests
    timeout 240 python3 -m pytest -q -rf --maxfail=30 tests/test_kernels.py 2>&1 | tee "$OUT/test_kernels.log" | tail -25
    step model, decode and GPTQ tests
    timeout 240 python3 -m pytest -q -rf tests/test_models.py tests/test_decode.py tests/test_ops_reference.py \
      tests/test_gptq.py -s 2>&1 | tee "$OUT/test_models.log" | grep -v "it/s" | tail -25
    ;;
  verify)
    step "real-size logits (fp16, bf16)"
    PATCHER_REAL_SIZE=1 timeout 300 python3 -m pytest -q -rf -s tests/test_models.py -k real_size 2>&1 | tail -12
    step "SmolLM2 on the GPU"
    timeout 480 python3 -m pytest -q -rf -s tests/test_smollm2.py tests/test_decode.py -k "smollm2 or cuda_logits" \
      2>&1 | grep -E "SmolLM2 fp16|passed|failed|FAILED|^E " | head -12
    step compute-sanitizer memcheck
    timeout 200 compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest -q tests/test_kernels.py \
      -k "(test_norms and shape1 and dtype0) or (test_gemv and shape3) or (test_decode_attention and 129 and heads3)" \
      2>&1 | tail -6
    step "patched + HF static cache + compile (with and without programmatic dependent launch)"
    for pdl in 0 1; do
      PATCHER_DISABLE_PDL=$pdl TORCH_LOGS=recompiles timeout 240 python3 -m evals.tpot --random-config qwen2-1.5b \
        --modes patched-static-compiled --new-tokens 16 --repeats 1 --no-profile 2>&1 | grep -v "it/s" | tail -6
    done
    ;;
  quick-tpot)  # the default generate path on every real-size shape, and the decode ops
    for m in pythia-2.8b qwen2-1.5b llama-3.1-8b smollm2-135m; do
      step "TPOT $m"
      timeout 100 python3 -m evals.tpot --random-config $m --modes patched-eager,patched --new-tokens 64 \
        --repeats 2 --json "$OUT/tpot_$m.json" 2>&1 | grep -v "it/s" | tail -5
    done
    step decode-path op benchmark
    timeout 100 python3 -m evals.ops --ops gemv,decode_attention --dtypes fp16 --decode-batches 1 \
      --json "$OUT/ops_decode.json" 2>&1 | grep -v "it/s" | tail -25
    ;;
  measure)  # the README's TPOT table (patched-static-compiled compiles for minutes: see verify) and Pythia's variants
    mkdir -p "$OUT/r"
    for m in pythia-2.8b qwen2-1.5b llama-3.1-8b smollm2-135m; do
      step "TPOT $m, every mode"
      timeout 190 python3 -m evals.tpot --random-config $m --modes hf-eager,hf-static-compiled,patched-eager,patched \
        --repeats 2 --json "$OUT/r/tpot_$m.json" 2>&1 | grep -v "it/s" | tail -7
    done
    step "TPOT pythia-2.8b: batch 4 and 8, context 2048, bf16"
    for args in "--batch 4" "--batch 8" "--prompt-len 2048" "--dtype bf16"; do
      timeout 130 python3 -m evals.tpot --random-config pythia-2.8b --modes hf-static-compiled,patched $args \
        --repeats 2 --json "$OUT/r/tpot_pythia-2.8b_$(echo $args | tr -d ' -').json" 2>&1 | grep -v "it/s" | tail -4
    done
    step per-op benchmark
    timeout 300 python3 -m evals.ops --json "$OUT/r/ops.json" 2>&1 | grep -v "it/s" | tail -40
    tar -C "$OUT" -czf "$OUT/results.tar.gz" r && rm -rf "$OUT/r"
    ;;
  multi-gpu)  # on a machine with two or more GPUs
    step build
    python3 -c "from patcher.ops import extension; extension.load()" 2>&1 | tail -1
    step "a model split over two GPUs"
    timeout 150 python3 -m pytest -q -rf tests/test_models.py -k two_gpus 2>&1 | tail -4
    ;;
  int4)  # GPTQ int4: kernel tests, the per-op benchmark, whole-model TPOT against fp16 patched
    step build
    python3 -c "from patcher.ops import extension; extension.load()" 2>&1 | tail -2
    step int4 kernel tests
    timeout 200 python3 -m pytest -q -x tests/test_int4_kernels.py 2>&1 | tail -4
    step int4 per-op benchmark
    timeout 100 python3 -m evals.ops --ops int4 --dtypes fp16 --decode-batches 1,4 --json "$OUT/ops_int4.json" 2>&1 \
      | grep -v "it/s" | tail -28
    for m in pythia-2.8b llama-3.1-8b; do
      step "TPOT $m: int4 g128 and fp16"
      timeout 150 python3 -m evals.tpot --random-config $m --int4-random 128 --modes patched-eager,patched \
        --new-tokens 64 --repeats 2 --json "$OUT/tpot_${m}_int4.json" 2>&1 | grep -v "it/s" | tail -5
      timeout 100 python3 -m evals.tpot --random-config $m --modes patched --new-tokens 64 --repeats 2 \
        --json "$OUT/tpot_${m}_fp16.json" 2>&1 | grep -v "it/s" | tail -4
    done
    ;;
  smollm2)  # needs $PATCHER_SMOLLM2_GGUF and $PATCHER_WIKITEXT
    step "SmolLM2 tests on the GPU"
    # (the greedy agreement with HF eager alone takes about 250 s on the H100)
    timeout 540 python3 -m pytest -q -rf tests/test_smollm2.py tests/test_decode.py tests/test_gptq.py -k smollm2 \
      2>&1 | grep -v "it/s" | tail -4
    step "SmolLM2 int4 g128: perplexity, int4 kernels against the dequantize-then-matmul reference"
    python3 -m patcher.gptq.pack "$PATCHER_SMOLLM2_GGUF" /tmp/smol-int4 --group-size 128 2>&1 | tail -1
    timeout 200 python3 -m evals.perplexity --gptq /tmp/smol-int4 --text-file "$PATCHER_WIKITEXT" \
      --json "$OUT/perplexity_smollm2_int4.json" 2>&1 | grep -v "it/s\|Converting\|Loading" | tail -6
    for dt in fp32 bf16; do
      step "perplexity SmolLM2 $dt"
      timeout 150 python3 -m evals.perplexity --gguf-file "$PATCHER_SMOLLM2_GGUF" --text-file "$PATCHER_WIKITEXT" \
        --dtype $dt --json "$OUT/perplexity_smollm2_$dt.json" 2>&1 | grep -v "it/s\|Converting\|Loading" | tail -5
    done
    ;;
  step-bounds)  # the step kernel's timeline with its arithmetic and/or weight copies switched off (wrong results)
    python3 -c "from patcher.ops import extension; extension.load()" 2>&1 | tail -1
    for m in pythia-2.8b llama-3.1-8b; do
      for b in 0 1 2 3; do
        step "timeline $m, PATCHER_STEP_BOUNDS=$b"
        PATCHER_STEP_BOUNDS=$b timeout 120 python3 -m evals.step_profile --random-config $m --int4-random 128 \
          --json "$OUT/step_bounds_${m}_$b.json" 2>&1 | grep -v "it/s" | tail -8
      done
    done
    ;;
  int4-check)  # the int4 kernel, GPTQ, decode and step-kernel tests; int4 TPOT (per-op, step kernel) and fp16 TPOT
    step build
    python3 -c "from patcher.ops import extension; extension.load()" 2>&1 | tail -1
    step "int4 kernel, GPTQ, decode and step-kernel tests"
    timeout 240 python3 -m pytest -q -x tests/test_int4_kernels.py 2>&1 | tail -2
    timeout 150 python3 -m pytest -q -rf tests/test_gptq.py tests/test_decode.py tests/test_step.py 2>&1 \
      | grep -E "^E  |passed|failed" | tail -8
    for m in pythia-2.8b llama-3.1-8b; do
      step "TPOT $m: int4 g128 (per-op, step kernel), fp16"
      timeout 150 python3 -m evals.tpot --random-config $m --int4-random 128 --modes patched,patched-step-kernel \
        --new-tokens 64 --repeats 3 --json "$OUT/tpot_${m}_int4.json" 2>&1 | grep -E "tpot:|roofline"
      timeout 100 python3 -m evals.tpot --random-config $m --modes patched --new-tokens 64 --repeats 3 \
        --json "$OUT/tpot_${m}_fp16.json" 2>&1 | grep -E "tpot:|roofline"
    done
    ;;
  step)  # the persistent int4 decode-step kernel (kernels/step.cuh)
    step build
    /usr/bin/time -f "build wall %e s" python3 -c "from patcher.ops import extension; extension.load()" 2>&1 | tail -2
    step "step kernel tests"
    timeout 300 python3 -m pytest -q -rf tests/test_step.py 2>&1 | tee "$OUT/test_step.log" | grep -E "^E  |passed|failed" | tail -15
    for m in pythia-2.8b llama-3.1-8b; do
      step "step kernel timeline $m int4 g128"
      timeout 120 python3 -m evals.step_profile --random-config $m --int4-random 128 \
        --json "$OUT/step_profile_$m.json" 2>&1 | grep -v "it/s" | tail -12
    done
    [ -n "${STEP_TPOT:-}" ] || exit 0
    for m in pythia-2.8b llama-3.1-8b; do
      step "TPOT $m int4 g128: the step kernel and the per-op step"
      timeout 200 python3 -m evals.tpot --random-config $m --int4-random 128 --modes patched,patched-step-kernel \
        --new-tokens 64 --repeats 3 --kernel-table --json "$OUT/tpot_${m}_int4_step.json" 2>&1 | grep -v "it/s" | tail -24
    done
    ;;
  *)
    echo "usage: tools/gpu_run.sh tests|verify|quick-tpot|measure|int4|smollm2|multi-gpu|step|step-bounds|int4-check" >&2
    exit 2
    ;;
esac
