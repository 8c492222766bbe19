"""`model.generate` of a patched model: the graph-captured decode path where it applies, HF's loop otherwise.

patch_model sets this as the instance's `generate`. It decides per call, from the arguments alone (no trial run;
reasons.py), whether the request is one the decode runner reproduces exactly: greedy or sampling (temperature, top-k,
top-p, min-p) with the logits processors of processors.py (repetition_penalty, no_repeat_ngram_size, bad_words_ids,
min_length, min_new_tokens, suppress_tokens, begin_suppress_tokens, forced BOS/EOS), a streamer, stop_strings and
max_time, the caller's own stopping criteria (run on the host a step behind, state.TokenFeed), the dict output with
scores and logits, the caller's own logits processors (run between graph replays), batch 1 to 64 (a model with GPTQ
int4 or GGUF linears, whose kernels take at most 8 rows, decodes in chunks of 8 rows), token ids with a left-padded (or
absent) attention mask, every layer patched on CUDA devices (one; each rank's under tensor parallelism, greedy calls
only, every rank making the same tokens; or a device_map split's, one graph a GPU). Anything else (beam search,
attentions in the output, sequence_bias, prefix_allowed_tokens_fn, a caller's MaxLengthCriteria or EosTokenCriteria,
...) goes to transformers' own `generate` (our fused kernels still run inside its forward, except with HF's static
cache, static_cache_fallback, where HF's own forwards run as in the unpatched model), and the reason is recorded
(`generate_path(model)`) and warned about once. Each call first checks the weights (PatchState.check_weights): where
they changed since the last call, the runner with its caches and captured graphs is dropped and rebuilt from the current
plans; modules with hooks keep the call on HF's loop.
"""

from __future__ import annotations

import dataclasses
import threading

from transformers.generation.utils import GenerateDecoderOnlyOutput

from .reasons import HF_ONLY_ARGUMENTS, call_reason, model_reason, tensor_parallel_call_reason
from .runner import DecodeRunner

# The output's cache field: `past_key_values` in earlier 5.x releases (5.17), `cache` in later ones (5.24).
CACHE_FIELD = (
    "cache" if "cache" in {f.name for f in dataclasses.fields(GenerateDecoderOnlyOutput)} else "past_key_values"
)


def generate_path(model) -> dict:
    """What the last `generate` call did: {"path": "graph" | "eager-runner" | "hf-static" | "hf", "reason": ...}
    ("eager-runner" with a reason: the step's CUDA graph capture failed and the step ran without it);
    "hf-static" is HF's loop with its static cache (static_cache_fallback)."""
    return getattr(model._patcher_state, "last_generate", {})


def static_cache_fallback(model, generation_config, kwargs) -> bool:
    """Whether a call that goes to HF's loop takes HF's static cache, which transformers compiles on CUDA: what the
    unpatched model does fastest with the same arguments (`cache_implementation="static"`). Only where that is HF's
    own supported path: one CUDA device, no tensor parallelism, one beam, no assistant or prompt lookup, and no cache
    of the caller's nor a cache choice other than "static" (a caller's cache_implementation="static" asks for that
    loop, and runs it as the unpatched model does); not with the fast path turned off (set_fast_generate), which asks
    for HF's loop as it is."""
    state = model._patcher_state
    devices = state.report.devices
    if not state.fast_generate or state.planner.tensor_parallel or len(devices) != 1:
        return False
    if not devices[0].startswith("cuda") or not getattr(model, "_can_compile_fullgraph", False):
        return False
    config = generation_config if generation_config is not None else model.generation_config

    def option(name):
        return kwargs[name] if name in kwargs else getattr(config, name, None)

    if any(kwargs.get(name) is not None for name in ("past_key_values", *HF_ONLY_ARGUMENTS)):
        return False
    return (
        option("cache_implementation") in (None, "static")
        and option("use_cache") is not False
        and (option("num_beams") or 1) == 1
        and option("prompt_lookup_num_tokens") is None
    )


_LOCK_CREATION = threading.Lock()


def _generate_lock(state) -> threading.Lock:
    """One lock a patched model: its decode runner's buffers serve one generate at a time."""
    with _LOCK_CREATION:
        if getattr(state, "generate_lock", None) is None:
            state.generate_lock = threading.Lock()
        return state.generate_lock


def decode_memory(model) -> dict:
    """What the decode path of a patched model holds: {"bytes": ..., "states": [{"batch", "capacity", "bytes"}]}."""
    runner = model._patcher_state.runner
    states = [] if runner is None else list(runner.states.values())
    rows = [{"batch": s.batch, "capacity": s.capacity, "bytes": s.nbytes} for s in states]
    return {"bytes": sum(r["bytes"] for r in rows), "states": rows}


def release_decode_memory(model) -> None:
    """Frees the static caches and CUDA graphs of a patched model's decode path (the next generate makes them
    again)."""
    state = model._patcher_state
    with _generate_lock(state):
        if state.runner is not None:
            state.runner.release()


def fast_generate(self, inputs=None, generation_config=None, **kwargs):
    """Replaces `generate` on a patched model instance (see the module docstring). One call at a time a model: the
    weights check and the decode runner's buffers serve one caller."""
    with _generate_lock(self._patcher_state):
        return _generate(self, inputs, generation_config, **kwargs)


def _generate(self, inputs, generation_config, **kwargs):
    state = self._patcher_state
    if inputs is not None:
        kwargs["input_ids"] = inputs
    reason = None if state.fast_generate else "the fast path is turned off (set_fast_generate)"
    if reason is None:
        # Weights replaced, moved, cast or updated since the last call: the plans are rebuilt and the runner (its
        # caches and captured graphs, which read the old weights' memory) is dropped before anything reads them.
        state.check_weights(self)
    reason = reason or model_reason(self)
    prepared = {}
    if reason is None:
        reason, prepared = call_reason(self, generation_config, kwargs)
    if reason is None and state.planner.tensor_parallel:
        reason = tensor_parallel_call_reason(prepared)
    if reason is not None:
        static = static_cache_fallback(self, generation_config, kwargs)
        state.last_generate = {"path": "hf-static" if static else "hf", "reason": reason}
        if state.fast_generate:
            runs = "fused kernels" if "kernels" in state.report.backend.split("+") else "the pure-torch reference ops"
            runs = "transformers' own forwards" if static else runs
            loop = "its static cache, compiled" if static else "no CUDA graph"
            message = f"patcher: generate uses transformers' loop ({runs}, {loop}): {reason}"
            state.warn_once(reason, message, stacklevel=3)
        original = state.original_generate or type(self).generate.__get__(self)
        if not static:
            return original(generation_config=generation_config, **kwargs)
        # The unpatched model's fastest loop, run as the unpatched model runs it: transformers compiles HF's own
        # forwards faster than the fused ones for most shapes (docs/architecture.md, "The decode step").
        with state.original_forwards():
            return original(generation_config=generation_config, **{**kwargs, "cache_implementation": "static"})
    if state.runner is None:
        state.runner = DecodeRunner(self)
    outputs = prepared["outputs"]
    result = state.runner.generate(**prepared)
    tokens, scores, logits = result if isinstance(result, tuple) else (result, None, None)
    error = state.runner.capture_error
    if error is None:
        state.last_generate = {"path": "graph" if state.runner.use_graphs else "eager-runner", "reason": None}
    else:
        reason = f"the CUDA graph capture of the decode step failed ({error}); the step ran without a graph"
        state.last_generate = {"path": "eager-runner", "reason": reason}
        state.warn_once(reason, f"patcher: {reason}", stacklevel=3)
    if outputs is None:
        return tokens
    cache = state.runner.cache(tokens.shape[0], tokens.shape[1] - 1)  # every position but the last token's
    return GenerateDecoderOnlyOutput(
        sequences=tokens,
        scores=tuple(scores) if outputs["scores"] else None,
        logits=tuple(logits) if outputs["logits"] else None,
        **{CACHE_FIELD: cache},
    )
