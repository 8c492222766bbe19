"""`model.generate` of a patched model: the graph-captured decode path where it applies, HF's loop otherwise.

patch_model sets this as the instance's `generate`. It decides per call, from the arguments alone (no trial
run), whether the request is one the decode runner reproduces exactly: greedy or plain sampling (temperature,
top-k, top-p), batch 1 to 8, token ids with a left-padded (or absent) attention mask, the model on one CUDA
device with every layer patched and planned, no hooks on its modules. Anything else, beam search, a streamer,
logits processors, scores in the output, repetition penalties and so on, goes to transformers' own `generate`
unchanged (our fused kernels still run inside its forward), and the reason is recorded (`generate_path(model)`)
and warned about once. Each call first checks the weights (PatchState.check_weights): where they changed since
the last call, the runner with its caches and captured graphs is dropped and rebuilt from the current plans.
"""

from __future__ import annotations

import warnings

import torch

from ..layers.guard import user_hooks
from .runner import MAX_EOS_IDS, DecodeRunner, Sampling

MAX_BATCH = 8
HEAD_DIMS = (64, 80, 128)
# Generation options the decode runner implements; any other option that differs from transformers' defaults
# (repetition_penalty, min_new_tokens, num_beams, output_scores, ...) sends the call to HF's loop.
HANDLED = {
    "max_length",
    "max_new_tokens",
    "do_sample",
    "temperature",
    "top_k",
    "top_p",
    "eos_token_id",
    "pad_token_id",
    "bos_token_id",
    "use_cache",
    "output_attentions",
    "output_hidden_states",
    "transformers_version",
    "_from_model_config",
    "decoder_start_token_id",
}
HF_ONLY_ARGUMENTS = (
    "logits_processor",
    "stopping_criteria",
    "prefix_allowed_tokens_fn",
    "synced_gpus",
    "assistant_model",
    "streamer",
    "negative_prompt_ids",
    "negative_prompt_attention_mask",
    "custom_generate",
    "tokenizer",
)
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def generate_path(model) -> dict:
    """What the last `generate` call did: {"path": "graph" | "eager-runner" | "hf", "reason": ...}."""
    return getattr(model._patcher_state, "last_generate", {})


def model_reason(model) -> str | None:
    """Why the decode runner can never serve this patched model (placement, shapes), or None."""
    state = model._patcher_state
    report = state.report
    if report.unpatched:
        return f"{len(report.unpatched)} module(s) are not patched ({report.unpatched[0].name})"
    unplanned = state.unplanned()
    if unplanned:
        name, reason = next(iter(unplanned.items()))
        return f"{len(unplanned)} patched module(s) run HF's forward now ({name}: {reason})"
    hooked = next((name for name, m in model.named_modules() if user_hooks(m)), None)
    if hooked is not None:
        return f"a forward hook or pre-hook on {hooked or 'the model'} (the decode graph calls no modules)"
    if model.training and state.planner.dropout:
        return "training mode with dropout (the decode step has no dropout)"
    if report.backend != "kernels" or len(report.devices) != 1 or not report.devices[0].startswith("cuda"):
        return (
            f"the decode path runs on one CUDA device with the kernels backend (have {report.backend} on "
            f"{', '.join(report.devices)})"
        )
    config, spec = model.config, state.spec
    if spec.head_dim(config) not in HEAD_DIMS:
        return f"head_dim {spec.head_dim(config)} (the decode attention kernel supports {HEAD_DIMS})"
    if spec.num_heads(config) // spec.num_kv_heads(config) > 8:
        return "more than 8 query heads per kv head"
    rope_type = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        return f"rope_type {rope_type!r} changes with the sequence length"
    if any(getattr(config, "layer_types", None) or []) and "sliding_attention" in config.layer_types:
        return "sliding-window attention layers"
    if {p.device for p in model.parameters()} != {torch.device(report.devices[0])}:
        return "parameters outside the patched layers are on another device"
    return None


def call_reason(model, generation_config, kwargs) -> tuple[str | None, dict]:
    """Why this call goes to HF's loop (or None), and the prepared arguments for the runner."""
    for name in HF_ONLY_ARGUMENTS:
        if kwargs.get(name) is not None:
            return f"argument {name}", {}
    try:
        config, model_kwargs = model._prepare_generation_config(generation_config, **kwargs)
        defaults = config._get_default_generation_params()
    except Exception as e:  # noqa: BLE001  (an unexpected transformers version: HF's own loop reports it properly)
        return f"could not read the generation config ({type(e).__name__}: {e})", {}
    for key, value in config.to_diff_dict().items():
        if key not in HANDLED and value is not None and defaults.get(key, None) != value:
            return f"generation option {key}={value!r}", {}
    if config.use_cache is False:
        return "use_cache=False", {}
    input_ids = model_kwargs.pop("input_ids", None)
    attention_mask = model_kwargs.pop("attention_mask", None)
    extra = [
        k for k, v in model_kwargs.items() if v is not None and k not in ("output_attentions", "output_hidden_states")
    ]
    if extra:
        return f"model arguments {extra}", {}
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
        return "inputs must be a 2-D tensor of token ids", {}
    B, T = input_ids.shape
    if not 1 <= B <= MAX_BATCH:
        return f"batch {B} (the decode path takes 1 to {MAX_BATCH})", {}
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    elif attention_mask.shape != input_ids.shape or not bool(
        (attention_mask[:, -1] == 1).all() & (attention_mask.diff(dim=-1) >= 0).all()
    ):
        return "the attention mask is not left padding", {}
    new_tokens = config.max_new_tokens if config.max_new_tokens is not None else config.max_length - T
    if new_tokens is None or new_tokens < 1:
        return "no new tokens requested", {}
    eos = config.eos_token_id
    eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    if len(eos) > MAX_EOS_IDS:
        return f"more than {MAX_EOS_IDS} EOS ids", {}
    pad = config.pad_token_id if config.pad_token_id is not None else (eos[0] if eos else 0)
    sampling = Sampling(
        do_sample=bool(config.do_sample),
        temperature=float(config.temperature if config.temperature is not None else 1.0),
        top_k=int(config.top_k or 0),
        top_p=float(config.top_p if config.top_p is not None else 1.0),
    )
    if sampling.do_sample and sampling.temperature <= 0:
        return "temperature <= 0", {}
    return None, {
        "input_ids": input_ids,
        "attention_mask": attention_mask.to(input_ids.device),
        "new_tokens": new_tokens,
        "sampling": sampling,
        "eos": eos,
        "pad_token_id": int(pad),
    }


def fast_generate(self, inputs=None, generation_config=None, **kwargs):
    """Replaces `generate` on a patched model instance (see the module docstring)."""
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
    if reason is not None:
        state.last_generate = {"path": "hf", "reason": reason}
        if reason not in state.warned and state.fast_generate:
            state.warned.add(reason)
            warnings.warn(
                f"patcher: generate uses transformers' loop (fused kernels, no CUDA graph): {reason}", stacklevel=2
            )
        original = state.original_generate or type(self).generate.__get__(self)
        return original(generation_config=generation_config, **kwargs)
    if state.runner is None:
        state.runner = DecodeRunner(self)
    tokens = state.runner.generate(**prepared)
    state.last_generate = {"path": "graph" if state.runner.use_graphs else "eager-runner", "reason": None}
    return tokens
