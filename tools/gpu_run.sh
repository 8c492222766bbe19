#!/usr/bin/env bash
# The checks a change to the kernels or the decode path must pass on a CUDA machine, run from the repository root
# (python3 there has the project installed, with pytest and pytest-xdist):
#   tools/gpu_run.sh tests [ARGS]  build the CUDA kernels, then run the test suite (GPU tests included), or the
#                                  pytest selection ARGS; JOBS workers (default 15); with PATCHER_REAL_SIZE=1
#                                  the real-size model tests follow in one process (tests_real_size.log)
#   tools/gpu_run.sh tpot    decode TPOT of the four model shapes the README reports, fp16 and GPTQ int4 (group size
#                            128), random weights, one JSON file each
#   tools/gpu_run.sh presets [MODEL...]  TPOT of every generate-argument preset (evals/presets.py), patched against
#                            HF's static cache + compile, fp16, batch 1, one JSON file a model (default: the four)
#   tools/gpu_run.sh anchor  the Llama-3.2-1B shape in bf16, prompt 32, 128 new tokens (context 32-160), HF's static
#                            cache + compile against patched: the setting of published Llama-3.2-1B decode figures
#   tools/gpu_run.sh tp [N]  tensor parallelism over N GPUs of this machine (default 2): the Llama-3.1-8B shape and
#                            Llama-3.1-70B's layers at 16 of its 80 (llama-3.1-70b-16l), HF's static cache + compile
#                            against patched under torchrun, then patched on one GPU; JSON with each rank 0's kernel
#                            table (the all-reduces' critical time)
#   tools/gpu_run.sh gguf    the GGUF goals: decode TPOT and 2048-token prefill (TTFT) of the Llama-3.1-8B shape in
#                            fp16, GPTQ int4 g128, GGUF Q4_0 and the Q4_K_M mix (W4A8), one process each (and the
#                            eight in gguf_llama-3.1-8b_decode-prefill.json); the GGUF ops alone (evals.ops: the
#                            decode GEMV per type and projection, the prefill linear); then, with
#                            PATCHER_SMOLLM2_GGUF and PATCHER_WIKITEXT set, the trained SmolLM2's perplexity
#                            dequantized (fp16), W4A16 and W4A8
# Logs and JSON files go to $OUT (default /tmp/patcher-out).
set -euo pipefail
OUT=${OUT:-/tmp/patcher-out}
mkdir -p "$OUT"

case "${1:-}" in
  tests)
    shift
    python3 -c "from patcher.ops import build; build.load()"   # once, before the workers start
    # One CPU thread a worker: fifteen workers with a thread a core each would contend for the cores.
    export OMP_NUM_THREADS=1
    # One line a test (-v), so that a run cut short still names what failed; pytest-xdist spreads the tests over
    # the CPU cores (the GPU tests are small); extra arguments select a subset, e.g. tests/decode -m gpu.
    # The real-size tests (PATCHER_REAL_SIZE=1) hold up to 40 GB each: they run after the others, one at a time.
    env -u PATCHER_REAL_SIZE python3 -m pytest -v -rfE --durations=20 -p no:randomly -n "${JOBS:-15}" "${@:-tests}" \
      > "$OUT/tests.log" 2>&1 || status=$?
    grep -E "FAILED|ERROR" "$OUT/tests.log" || true
    tail -3 "$OUT/tests.log"
    if [[ -n "${PATCHER_REAL_SIZE:-}" ]]; then
      python3 -m pytest -v -rfE -p no:randomly -k real_size "${@:-tests}" > "$OUT/tests_real_size.log" 2>&1 || status=$?
      grep -E "FAILED|ERROR" "$OUT/tests_real_size.log" || true
      tail -1 "$OUT/tests_real_size.log"
    fi
    exit "${status:-0}"
    ;;
  tpot)
    for model in pythia-2.8b llama-3.1-8b qwen2-1.5b smollm2-135m; do
      python3 -m evals.tpot --random-config "$model" --modes patched --json "$OUT/tpot_${model}_fp16.json"
      python3 -m evals.tpot --random-config "$model" --int4-random 128 --modes patched \
        --json "$OUT/tpot_${model}_int4.json"
    done
    ;;
  presets)
    shift
    presets=greedy,sampling,qwen-instruct,llama-instruct,streamer,min-new-tokens,stop-strings
    models=("$@")
    [[ ${#models[@]} -gt 0 ]] || models=(pythia-2.8b llama-3.1-8b qwen2-1.5b smollm2-135m)
    for model in "${models[@]}"; do
      python3 -m evals.tpot --random-config "$model" --generate-args "$presets" \
        --json "$OUT/tpot_presets_${model}.json" 2>&1 | tee "$OUT/tpot_presets_${model}.log" | grep -v "it/s" || true
    done
    ;;
  anchor)
    python3 -m evals.tpot --random-config llama-3.2-1b --dtype bf16 --prompt-len 32 --new-tokens 128 --repeats 5 \
      --modes hf-static-compiled,patched --json "$OUT/tpot_llama-3.2-1b_bf16.json" 2>&1 | grep -v "it/s" || true
    ;;
  tp)
    ranks=${2:-2}
    for model in llama-3.1-8b llama-3.1-70b-16l; do
      torchrun --nproc-per-node "$ranks" -m evals.tpot --random-config "$model" --tp "$ranks" \
        --modes hf-static-compiled,patched --repeats 3 --json "$OUT/tpot_tp${ranks}_${model}.json" 2>&1 \
        | grep -v "it/s" || true
      python3 -m evals.tpot --random-config "$model" --modes patched --repeats 3 \
        --json "$OUT/tpot_tp1_${model}.json" 2>&1 | grep -v "it/s" || true
    done
    ;;
  gguf)
    for weights in fp16 int4 q4_0 q4_k_m; do
      case "$weights" in
        fp16) flags=() ;;
        int4) flags=(--int4-random 128) ;;
        *) flags=(--gguf-random "${weights^^}") ;;
      esac
      python3 -m evals.tpot --random-config llama-3.1-8b "${flags[@]}" --modes patched --new-tokens 64 --repeats 3 \
        --no-profile --json "$OUT/tpot_llama-3.1-8b_${weights}.json" 2>&1 | grep -E "^(patched|roofline)" || true
      python3 -m evals.tpot --random-config llama-3.1-8b "${flags[@]}" --modes patched --prompt-len 2048 \
        --new-tokens 8 --repeats 3 --no-profile --json "$OUT/prefill_llama-3.1-8b_${weights}.json" 2>&1 \
        | grep -E "^patched" || true
    done
    # The eight runs in one file, as evals/results keeps them
    python3 - "$OUT" <<'EOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
runs = {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("*_llama-3.1-8b_*.json"))
        if p.stem.startswith(("tpot_", "prefill_"))}
combined = {"tool": "tools/gpu_run.sh gguf", "runs": runs}
(out / "gguf_llama-3.1-8b_decode-prefill.json").write_text(json.dumps(combined, indent=1))
EOF
    python3 -m evals.ops --ops gguf,gguf_linear --dtypes fp16 --decode-batches 1 --tokens 4096 \
      --json "$OUT/ops_gguf.json" 2>&1 | grep -v "it/s" || true
    if [[ -n "${PATCHER_SMOLLM2_GGUF:-}" && -n "${PATCHER_WIKITEXT:-}" ]]; then
      for mode in "" "--keep-quantized --w4a16" "--keep-quantized"; do
        tag=$(echo "${mode:---dequantized}" | sed 's/--keep-quantized --w4a16/w4a16/; s/--keep-quantized/w4a8/; s/--//')
        # shellcheck disable=SC2086  # (the mode's flags are separate words)
        python3 -m evals.perplexity --gguf-file "$PATCHER_SMOLLM2_GGUF" $mode --text-file "$PATCHER_WIKITEXT" \
          --dtype fp16 --json "$OUT/perplexity_smollm2_gguf_${tag}.json" 2>&1 | tail -3
      done
    fi
    ;;
  *)
    echo "usage: tools/gpu_run.sh tests|tpot|presets|anchor|tp|gguf" >&2
    exit 2
    ;;
esac
