"""Which models and calls the decode path serves, each "no" with its reason (generate.py records and warns it).

A model: every layer patched, the kernels backend on CUDA devices (one; each rank's under tensor parallelism; or
several that accelerate's device_map split the layers over), head_dim 64, 80 or 128, a rope type fixed in the sequence
length, no sliding-window layers. A call: greedy or sampling with the logits processors the runner reproduces
(processors.py), the stopping criteria it runs (EOS ids, stop strings, max_time, the caller's own a step behind),
batch 1 to 64, token ids with a left-padded (or absent) attention mask; call_reason also prepares what the runner
takes (the ids, the mask, the Sampling, the criteria)."""

from __future__ import annotations

import copy

import torch
from transformers.generation.logits_process import NoBadWordsLogitsProcessor
from transformers.generation.stopping_criteria import (
    EosTokenCriteria,
    MaxLengthCriteria,
    MaxTimeCriteria,
    StopStringCriteria,
)

from ..layers.guard import user_hooks
from ..layers.weights import head_device, head_rows
from ..parallel import vocab_reason
from .processors import Sampling
from .runner import MAX_BATCH
from .state import MAX_EOS_IDS

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
    "min_p",
    "repetition_penalty",
    "min_length",
    "min_new_tokens",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "suppress_tokens",
    "begin_suppress_tokens",
    "no_repeat_ngram_size",
    "bad_words_ids",
    "stop_strings",
    "max_time",
    "num_return_sequences",
    "return_dict_in_generate",
    "output_scores",
    "output_logits",
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
    "prefix_allowed_tokens_fn",
    "synced_gpus",
    "assistant_model",
    "negative_prompt_ids",
    "negative_prompt_attention_mask",
    "custom_generate",
)
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


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
    if state.planner.tensor_parallel:
        reason = tensor_parallel_reason(model)
        if reason is not None:
            return reason
    reason = placement_reason(model)
    if reason is not None:
        return reason
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
    if not {p.device for p in model.parameters()} <= {torch.device(d) for d in report.devices}:
        return "parameters outside the patched layers are on another device"
    return None


def placement_reason(model) -> str | None:
    """Why the decode runner can't run where the model is (it runs on CUDA devices with the kernels backend: one,
    each rank's under tensor parallelism, or several that accelerate's device_map split the layers over), or None.
    The CPU's tests pass by this check alone: there the runner runs eagerly on the reference ops."""
    report = model._patcher_state.report
    if report.backend != "kernels" or not report.devices or not all(d.startswith("cuda") for d in report.devices):
        return (
            f"the decode path runs on CUDA devices with the kernels backend (have {report.backend} on "
            f"{', '.join(report.devices) or '-'})"
        )
    return split_reason(model) if len(report.devices) > 1 else None


def split_reason(model) -> str | None:
    """Why the decode step can't run a model split over devices as one segment of layers per device (runner.py:
    each its own graph, the residual stream copied from one device to the next), or None: it runs dense projections,
    without tensor parallelism, with the final norm beside the lm_head."""
    state = model._patcher_state
    if state.planner.tensor_parallel:
        return "tensor parallel with a rank's layers over several devices"
    for name, module in model.named_modules():
        plan = getattr(module, "_patcher", None)
        if any(getattr(plan, f, None) is not None for f in ("qkv_int4", "qkv_gguf", "out_int4", "out_gguf", "in_int4",
                                                              "in_gguf")):  # fmt: skip
            return f"GPTQ int4 or GGUF projections over several devices ({name})"
    norm = getattr(getattr(model, state.spec.base_model, model), state.spec.final_norm)
    if next(norm.parameters()).device != head_device(model.get_output_embeddings()):
        return "the final norm and the lm_head on different devices"
    return None


def tensor_parallel_reason(model) -> str | None:
    """Why the decode step can't run a tensor-parallel model's shards, or None: it serves dense (fp16/bf16/fp32)
    sharded projections, and an embedding and lm_head whole or sharded by vocabulary (parallel/vocab.py). Every
    rank answers the same: the layout is the same on every rank."""
    state = model._patcher_state
    reason = vocab_reason(model.get_input_embeddings(), model.get_output_embeddings(), state.planner.styles)
    if reason is not None:
        return f"tensor parallel: {reason}"
    for name, module in model.named_modules():
        plan = getattr(module, "_patcher", None)
        quantized = any(
            getattr(plan, f, None) is not None
            for f in ("qkv_int4", "qkv_gguf", "out_int4", "out_gguf", "in_int4", "in_gguf")
        )
        if getattr(plan, "group", None) is not None and quantized:
            return f"tensor parallel with GPTQ int4 or GGUF projections ({name})"
    return None


def tensor_parallel_call_reason(prepared: dict) -> str | None:
    """Why a call on a tensor-parallel model goes to HF's loop although the runner could serve it, or None. Every
    rank must make the same tokens and stop at the same step (their collectives pair up step by step): sampling
    draws from each rank's own generator, and max_time reads each rank's own clock."""
    if prepared["sampling"].do_sample:
        return "sampling on a tensor-parallel model (each rank would draw from its own generator)"
    if any(isinstance(c, MaxTimeCriteria) for c in (*prepared["criteria"], *prepared["own_criteria"])):
        return "max_time on a tensor-parallel model (each rank's clock could stop it at another step)"
    return None


def call_reason(model, generation_config, kwargs) -> tuple[str | None, dict]:
    """Why this call goes to HF's loop (or None), and the prepared arguments for the runner."""
    for name in HF_ONLY_ARGUMENTS:
        if kwargs.get(name) is not None:
            return f"argument {name}", {}
    kwargs = dict(kwargs)
    own_processors = kwargs.pop("logits_processor", None) or None
    own_criteria = kwargs.pop("stopping_criteria", None)
    if own_criteria is not None and not isinstance(own_criteria, (list, tuple)):
        return f"stopping_criteria is a {type(own_criteria).__name__}, not a list (StoppingCriteriaList)", {}
    own_criteria = list(own_criteria or ())
    streamer = kwargs.pop("streamer", None)
    tokenizer = kwargs.pop("tokenizer", None)
    if streamer is not None and not all(callable(getattr(streamer, name, None)) for name in ("put", "end")):
        return "a streamer without put() and end()", {}
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
    outputs = None  # what a dict output holds besides the sequences and the cache
    if config.return_dict_in_generate:
        if config.output_attentions or config.output_hidden_states:
            return "attentions or hidden states in the output", {}
        outputs = {"scores": bool(config.output_scores), "logits": bool(config.output_logits)}
    copies = int(config.num_return_sequences or 1)
    if copies > 1:  # HF's _expand_inputs_for_generation: each prompt repeated in place
        input_ids = input_ids.repeat_interleave(copies, dim=0)
        if attention_mask is not None:
            attention_mask = attention_mask.repeat_interleave(copies, dim=0)
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
    eos = list(_ids(config.eos_token_id))
    if len(eos) > MAX_EOS_IDS:
        return f"more than {MAX_EOS_IDS} EOS ids", {}
    if own_processors is not None:
        # HF puts a caller's processor of a type the config also makes in that one's place; here the caller's run
        # after ours (as HF runs the others: after its own, before the warpers), so such a call goes to HF's loop.
        greedy = copy.copy(config)
        greedy.do_sample = False  # the processors without the warpers, which HF adds after the caller's
        greedy._eos_token_tensor = torch.tensor(eos, dtype=torch.long) if eos else None
        try:
            made = model._get_logits_processor(greedy, input_ids_seq_length=T, device=input_ids.device,
                                               model_kwargs={"attention_mask": attention_mask})  # fmt: skip
        except ValueError as e:  # an argument HF's processors refuse: its loop raises the same error
            return f"logits processing: {e}", {}
        both = sorted({type(p).__name__ for p in made} & {type(p).__name__ for p in own_processors})
        if both:
            return f"logits_processor of a type the generation config also makes ({', '.join(both)})", {}
    pad = config.pad_token_id if config.pad_token_id is not None else (eos[0] if eos else 0)
    reason = criteria_reason(own_criteria)
    if reason is not None:
        return reason, {}
    # the stopping criteria the config makes, which read the tokens on the host (runner.TokenFeed); as in HF's
    # _merge_criteria_processor_list, a caller's criterion of the same type takes the place of the config's
    replaced = {type(c) for c in own_criteria}
    criteria = []
    if config.max_time is not None and MaxTimeCriteria not in replaced:
        criteria.append(MaxTimeCriteria(max_time=config.max_time))
    if config.stop_strings is not None:
        if tokenizer is None:
            return "stop_strings without a tokenizer", {}
        if StopStringCriteria not in replaced:
            criteria.append(stop_string_criteria(model._patcher_state, tokenizer, config.stop_strings))
    try:
        sampling = sampling_for(config, eos, head_rows(model.get_output_embeddings()))
    except ValueError as e:
        return str(e), {}
    return None, {
        "input_ids": input_ids,
        "attention_mask": attention_mask.to(input_ids.device),
        "new_tokens": new_tokens,
        "sampling": sampling,
        "eos": eos,
        "pad_token_id": int(pad),
        "streamer": streamer,
        "criteria": criteria,
        "own_criteria": own_criteria,
        "outputs": outputs,
        "extra": own_processors,
    }


def criteria_reason(own: list) -> str | None:
    """Why the caller's stopping criteria send the call to HF's loop, or None. HF merges them with those it makes
    (_get_stopping_criteria), a caller's of a type it makes taking that one's place: a caller's MaxTimeCriteria or
    StopStringCriteria the runner runs in place of the config's as well; MaxLengthCriteria (always made) and
    EosTokenCriteria decide the length and the padding, which the runner fixes before the first step, and HF pads
    finished rows wherever a criterion has an `eos_token_id`."""
    for criterion in own:
        if not callable(criterion):
            return f"a stopping criterion that is not callable ({type(criterion).__name__})"
        if isinstance(criterion, (MaxLengthCriteria, EosTokenCriteria)):
            return f"stopping_criteria with a {type(criterion).__name__} (it sets the length or the padding)"
        if hasattr(criterion, "eos_token_id"):
            return f"stopping_criteria with eos_token_id ({type(criterion).__name__}: HF then pads finished rows)"
    return None


STOP_STRING_CRITERIA_KEPT = 4


def stop_string_criteria(state, tokenizer, stop_strings) -> StopStringCriteria:
    """The StopStringCriteria for a tokenizer and stop strings, built once and kept (the last few): building one
    reads the whole vocabulary (about 0.25 s for 150k tokens), which HF's generate pays on every call. It holds no
    state between calls. The tokenizer is kept with it, so its id can't be reused by another one; a tokenizer that
    gained tokens since is a new key."""
    strings = (stop_strings,) if isinstance(stop_strings, str) else tuple(stop_strings)
    key = (id(tokenizer), len(tokenizer), strings)
    kept = state.stop_string_criteria
    if key in kept:
        kept[key] = kept.pop(key)  # the most recently used last
        return kept[key][1]
    criterion = StopStringCriteria(tokenizer=tokenizer, stop_strings=list(strings))
    kept[key] = (tokenizer, criterion)
    while len(kept) > STOP_STRING_CRITERIA_KEPT:
        del kept[next(iter(kept))]
    return criterion


def _ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return (int(value),) if isinstance(value, int) else tuple(int(v) for v in value)


def sampling_for(config, eos: list[int], vocab: int) -> Sampling:
    """The call's logits processing as the runner takes it, from a prepared GenerationConfig; ValueError with the
    reason where the runner does not reproduce it (HF's loop then runs it, or rejects it as HF does)."""
    do_sample = bool(config.do_sample)
    temperature = float(config.temperature if config.temperature is not None else 1.0)
    if do_sample and temperature <= 0:
        raise ValueError("temperature <= 0")
    penalty = float(config.repetition_penalty if config.repetition_penalty is not None else 1.0)
    if penalty <= 0:
        raise ValueError(f"repetition_penalty {penalty} (must be > 0)")
    if config.min_p is not None and not 0 <= config.min_p <= 1:
        raise ValueError(f"min_p {config.min_p} (must be in [0, 1])")
    token_ids = {
        "suppress_tokens": _ids(config.suppress_tokens),
        "begin_suppress_tokens": _ids(config.begin_suppress_tokens),
        "forced_bos_token_id": _ids(config.forced_bos_token_id),
        "forced_eos_token_id": _ids(config.forced_eos_token_id),
    }
    for name, ids in token_ids.items():
        if any(not 0 <= i < vocab for i in ids):
            raise ValueError(f"{name} {list(ids)} outside the vocabulary (0 .. {vocab - 1})")
    ngram = config.no_repeat_ngram_size
    if ngram is not None and not isinstance(ngram, int):
        raise ValueError(f"no_repeat_ngram_size {ngram!r} is not an int")
    ngram = int(ngram) if ngram is not None and ngram > 0 else 0  # HF adds no processor for 0 or less
    bad_words = ()
    if config.bad_words_ids is not None:
        # HF's own processor validates the words and drops those equal to one EOS id; its error is HF's error
        try:
            words = NoBadWordsLogitsProcessor(config.bad_words_ids, eos or None).sequence_bias
        except (TypeError, ValueError) as e:
            raise ValueError(f"bad_words_ids: {e}") from e
        if not all(words):  # transformers 5.24 skips an empty word, 5.17 fails on it: its own loop decides
            raise ValueError("bad_words_ids holds an empty word")
        bad_words = tuple(tuple(int(i) for i in word) for word in words)
        outside = sorted({i for word in bad_words for i in word if i >= vocab})
        if outside:  # HF raises this at the first step
            raise ValueError(f"bad_words_ids {outside} outside the vocabulary (0 .. {vocab - 1})")
    sampled = {}
    if do_sample:  # HF applies the warpers only when sampling
        sampled = {
            "temperature": temperature,
            "top_k": int(config.top_k or 0),
            "top_p": float(config.top_p if config.top_p is not None else 1.0),
            "min_p": None if config.min_p is None else float(config.min_p),
        }
    return Sampling(
        do_sample=do_sample,
        repetition_penalty=penalty,
        min_length=int(config.min_length or 0),
        min_new_tokens=int(config.min_new_tokens or 0),
        eos=tuple(eos),
        forced_bos_token_id=token_ids["forced_bos_token_id"][0] if token_ids["forced_bos_token_id"] else None,
        forced_eos_token_ids=token_ids["forced_eos_token_id"],
        suppress_tokens=token_ids["suppress_tokens"],
        begin_suppress_tokens=token_ids["begin_suppress_tokens"],
        no_repeat_ngram_size=ngram,
        bad_words_ids=bad_words,
        **sampled,
    )
