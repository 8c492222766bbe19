"""The decode loop of a patched model: a static KV cache and one CUDA graph per decode step.

    prefill      the patched model's own forward (fused kernels, HF's SDPA/flash) on the prompt; its K/V are copied
                 into the static cache, and the first token is chosen from its last logits
    decode step  the embedding -> every layer (step.py) -> final add + norm -> lm_head -> logits processing and
                 sampling (processors.py) ->
                 next_token: the token chosen, written after the current one, the position counter advanced and
                 the new token's embedding looked up for the next step, in one kernel

On CUDA the step is captured once per batch size and cache size and replayed for every token: one host call per
token, no host sync (the loop checks for EOS every few steps). The cache position lives in a device tensor, so
the same graph serves every step. On the CPU (tests, reference backend) the same step runs eagerly.

The runner owns the capture and the token loop; the buffers are StepState's (state.py), the layers DecodeStep's
(step.py).
"""

from __future__ import annotations

import gc
import threading
from collections import OrderedDict
from contextlib import contextmanager

import torch

from ..layers.guard import weights_signature
from ..ops import REFERENCE
from ..ops.gguf import GEMV_MAX_ROWS
from .options import DecodeOptions
from .processors import Processors, Sampling
from .state import StepState, TokenFeed
from .step import DecodeStep

EOS_CHECK_EVERY = 16  # decode steps between host checks for "every row has finished"
MIN_CAPACITY = 256
MAX_BATCH = 64  # rows of a step: the next_token kernel's limit (kNextTokenMaxBatch)
KERNEL_MAX_ROWS = 8  # rows the GPTQ int4 kernels and the dense GEMV kernels take (below cublas_min_batch)


class CaptureError(RuntimeError):
    """The CUDA graph capture of a decode step failed after the step ran eagerly without error."""


_collection_lock = threading.Lock()
_collection_pauses = [0, False]  # captures under way, and whether the collector was on before the first


@contextmanager
def no_collection():
    """The cyclic garbage collector off while any thread captures, as it was before once none does."""
    with _collection_lock:
        if _collection_pauses[0] == 0:
            _collection_pauses[1] = gc.isenabled()
            gc.disable()
        _collection_pauses[0] += 1
    try:
        yield
    finally:
        with _collection_lock:
            _collection_pauses[0] -= 1
            if _collection_pauses[0] == 0 and _collection_pauses[1]:
                gc.enable()


class DecodeRunner:
    def __init__(self, model, options: DecodeOptions | None = None):
        options = DecodeOptions() if options is None else options
        if not isinstance(options, DecodeOptions):
            raise TypeError(f"DecodeRunner takes a DecodeOptions, got {type(options).__name__}")
        self.model, self.options = model, options
        state = getattr(model, "_patcher_state", None)
        if state is not None:  # plans rebuilt where the weights changed since they were built (and no forward ran)
            state.check_weights(model)
        # the plans, caches and graphs read these weights' memory (the check just took their signature)
        self.weights = state.weights if state is not None else weights_signature(model)
        self.decode_step = DecodeStep(model, options)
        self.device = self.decode_step.device
        self.use_graphs = options.use_graphs and self.device.type == "cuda"
        self.next_token_ops = None if options.fuse_next_token else REFERENCE
        # batch size -> buffers (and graph), least recently used first. Their KV caches together stay within the
        # largest one made so far, so memory is bounded by the largest call's shape, whatever the mix of shapes.
        self.states: OrderedDict[int, StepState] = OrderedDict()
        self.largest_cache = 0
        self.capture_error: str | None = None  # why the last generate's step ran without its graph (_capture)

    def step_rows(self) -> tuple[int | None, str]:
        """The most rows one pass of the model's part of a step takes (more run in chunks, StepState), and why:
        KERNEL_MAX_ROWS where the step has GPTQ int4 linears, GEMV_MAX_ROWS where it has GGUF ones, or (CUDA) where
        dense linears stay on the GEMV kernels past KERNEL_MAX_ROWS rows; None where any batch runs at once."""
        if self.decode_step.int4.linears:
            return KERNEL_MAX_ROWS, f"the GPTQ int4 decode kernels take 1 to {KERNEL_MAX_ROWS} rows"
        if self.decode_step.gguf:
            return GEMV_MAX_ROWS, f"the GGUF decode GEMV (gguf_gemv) takes 1 to {GEMV_MAX_ROWS} rows"
        if self.device.type == "cuda" and self.options.cublas_min_batch > KERNEL_MAX_ROWS + 1:
            return KERNEL_MAX_ROWS, (
                f"the dense GEMV kernels take 1 to {KERNEL_MAX_ROWS} rows (DecodeOptions.cublas_min_batch "
                f"{self.options.cublas_min_batch})"
            )
        return None, "every batch in one pass"

    def cache_bytes(self, batch: int, capacity: int) -> int:
        step = self.decode_step
        return 2 * step.num_layers * batch * step.num_kv_heads * capacity * step.head_dim * step.dtype.itemsize

    def state_for(self, batch: int, needed: int) -> StepState:
        state = self.states.get(batch)
        if state is not None and state.capacity >= needed:
            self.states.move_to_end(batch)
            return state
        self.states.pop(batch, None)  # a smaller cache for this batch size (and its graph) goes first
        capacity = max(MIN_CAPACITY, 1 << (needed - 1).bit_length())
        size = self.cache_bytes(batch, capacity)
        self.largest_cache = max(self.largest_cache, size)
        held = sum(self.cache_bytes(s.batch, s.capacity) for s in self.states.values())
        while self.states and held + size > self.largest_cache:
            _, dropped = self.states.popitem(last=False)
            held -= self.cache_bytes(dropped.batch, dropped.capacity)
        rows = self.step_rows()[0]
        step, segments = self.decode_step, self.decode_step.segments
        state = StepState(step, self.options, batch, capacity, rows, segment=segments[-1])
        state.parts = [StepState(step, self.options, batch, capacity, rows, segment=seg) for seg in segments[:-1]]
        width = 3 if step.parallel else 2  # the residual stream between segments: (residual, delta[, delta2])
        for k, part in enumerate(state.parts):  # each segment's stream out, and the next one's in
            part.stream_out = torch.zeros(width, batch, step.hidden, dtype=step.dtype, device=part.device)
            receiver = state.parts[k + 1] if k + 1 < len(state.parts) else state
            receiver.stream_in = torch.zeros(width, batch, step.hidden, dtype=step.dtype, device=receiver.device)
        self.states[batch] = state
        return state

    def layer_caches(self, st: StepState, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's K and V caches [B, Hkv, capacity, D], in the state of the segment that holds it."""
        for part in (*st.parts, st):
            _, first, end = part.segment
            if first <= i < end:
                return part.k[i - first], part.v[i - first]
        raise IndexError(f"layer {i} of {self.decode_step.num_layers}")

    def cache(self, batch: int, length: int):
        """The K/V of the first `length` positions of the last generate of this batch size, as the DynamicCache HF's
        generate returns (a copy)."""
        from transformers import DynamicCache

        st, cache = self.states[batch], DynamicCache(config=self.decode_step.config)
        for i in range(self.decode_step.num_layers):
            k, v = self.layer_caches(st, i)
            cache.update(k[:, :, :length].clone(), v[:, :, :length].clone(), i)
        return cache

    def memory_bytes(self) -> int:
        """The bytes of the static buffers held (KV caches, tokens, workspaces; the graphs' own pools not counted)."""
        return sum(s.nbytes for s in self.states.values())

    def release(self) -> None:
        """Drops every static cache and graph; the next generate makes what it needs again."""
        self.states.clear()
        self.largest_cache = 0

    def logits(self, st: StepState, x: torch.Tensor | None = None) -> torch.Tensor:
        if st.parts:  # a split model: this state's layers from the stream the segment before handed on, then the head
            step, (_, first, end) = self.decode_step, st.segment
            return step.head(step.layers_forward(self._stream(st.stream_in), st, first, end), st)
        if not st.chunks:
            return self.decode_step.logits(st, x)
        return torch.cat([self.decode_step.logits(c, None if x is None else c.x) for c in st.chunks])

    def processors(self, st: StepState, sampling: Sampling) -> Processors:
        """The state's logits processors for `sampling`, built (outside any capture) when it changes."""
        if st.processors is None or st.processors.sampling != sampling:
            st.processors = Processors(sampling, self.decode_step.vocab, st.device, self.decode_step.ops, st.batch)
        return st.processors

    def next_token(self, scores, st: StepState) -> None:
        """The token after the current one from `scores` (pad for finished rows; EOS ids finish a row) written at
        slot + 1, the slot advanced, and (plain embeddings) the new token's embedding in st.x: one kernel. `scores`:
        [B, V], or (scores [B, m], ids [B, m]) whose argmax is mapped through the ids (Processors.__call__)."""
        ops = self.next_token_ops or self.decode_step.ops
        embed_weight = self.decode_step.embed_weight
        scores, ids = scores if isinstance(scores, tuple) else (scores, None)
        ops.next_token(scores, st.tokens, st.slot, st.finished, st.eos, st.pad_token, embed_weight, st.x,
                       st.next_token_workspace, ids)  # fmt: skip

    def run_step(self, st: StepState, sampling: Sampling, keep: bool = False) -> None:
        """One decode step: logits, the token chosen, written and its embedding looked up (and with `keep`, the
        step's scores and logits in st.kept)."""
        x = st.x if self.decode_step.embed_weight is not None else None
        self.next_token(self.processors(st, sampling)(self.logits(st, x), st, st.kept if keep else None), st)
        self.mark_current(st)

    def model_step(self, st: StepState) -> None:
        """The model's part of a step alone, its logits into st.step_logits: where the caller's own logits
        processors run between graph replays."""
        x = st.x if self.decode_step.embed_weight is not None else None
        st.step_logits.copy_(self.logits(st, x))

    def choose(self, st: StepState, sampling: Sampling, logits, keep: bool, extra, length: int) -> None:
        """The token after the first `length` tokens from `logits`, through our processors and the caller's."""
        processors = self.processors(st, sampling)
        self.next_token(processors(logits, st, st.kept if keep else None, extra, st.tokens[:, :length]), st)
        self.mark_current(st)

    # ---- a model split over devices ----------------------------------------------------------------------------
    def _stream(self, stacked: torch.Tensor) -> tuple:
        """The residual stream (residual, delta, delta2) from its stacked form (delta2 None without a parallel
        residual)."""
        return (stacked[0], stacked[1], stacked[2] if stacked.shape[0] > 2 else None)

    def part_step(self, st: StepState, k: int) -> None:
        """Segment k (before the last) of a split model's step: its layers on the stream handed in (the first:
        on the current tokens' embeddings), the stream out into its stream_out; its slot then advances, as
        next_token advances the last segment's."""
        part, step = st.parts[k], self.decode_step
        _, first, end = part.segment
        if k == 0:
            stream = (step.embed_tokens(part.current), None, None)
        else:
            stream = self._stream(part.stream_in)
        stream = step.layers_forward(stream, part, first, end)
        for j in range(part.stream_out.shape[0]):
            if stream[j] is None:  # a delta not yet made (no layer before): zero, since x + 0 = x
                part.stream_out[j].zero_()
            else:
                part.stream_out[j].copy_(stream[j])
        part.slot.add_(1)

    def run_parts(self, st: StepState) -> None:
        """The segments before the last of a split model's step, each handed its input from the device before (the
        current tokens to the first), then the last segment's input; their graphs where captured."""
        for k, part in enumerate(st.parts):
            if k == 0:
                part.current.copy_(st.current)
            else:
                part.stream_in.copy_(st.parts[k - 1].stream_out)
            if part.graph is not None:
                part.graph.replay()
            else:
                self.part_step(st, k)
        st.stream_in.copy_(st.parts[-1].stream_out)

    def mark_current(self, st: StepState) -> None:
        """A split model: the current tokens (st.tokens[:, slot]) into st.current, for the first segment."""
        if st.parts:
            st.current.copy_(st.current_tokens())

    # ---- CUDA graph -----------------------------------------------------------------------------------------
    def _capture(self, st: StepState, mode: tuple) -> None:
        """Captures one step on the state's buffers, for mode (sampling, keep, split): with split only the model's
        part (model_step). A split model: each segment before the last as its own graph on its device (part_step).
        Runs before prefill: the warm-up's writes are overwritten.

        A capture that fails after its warm-up ran (the step itself works) leaves the state without graphs: this
        mode then decodes with the same step run eagerly, and st.capture_error says why. It is not tried again for
        this state and mode (release() drops the state; the next generate captures again)."""
        sampling, keep, split = mode

        def step():
            if split:
                self.model_step(st)
            else:
                self.run_step(st, sampling, keep)

        # graph_sampling names the mode only once it has its graphs or its capture error (a warm-up that raised
        # leaves it None, and the next generate tries again)
        st.graph, st.graph_sampling, st.capture_error = None, None, None
        try:
            for k, part in enumerate(st.parts):
                part.graph = self._graph(part.device, lambda k=k: self.part_step(st, k))
            st.graph = self._graph(st.device, step)
        except CaptureError as error:
            for part in st.parts:
                part.graph = None
            st.capture_error = str(error)
        st.graph_sampling = mode

    @staticmethod
    def _graph(device: torch.device, step) -> torch.cuda.CUDAGraph:
        """`step` captured on `device` after one warm-up run: allocator, lazy module state, and (tensor parallel)
        the communicator, which must be set up by an eager collective before a graph captures one; every rank
        captures the same collectives in the same order. An error in the warm-up is the step's own and propagates;
        one in the capture raises CaptureError.

        The cyclic garbage collector is off during the capture: it may free an unreachable CUDAGraph of an earlier
        model, whose destruction (cudaGraphExecDestroy) is not permitted while a stream captures and invalidates the
        capture. The capture mode is thread-local, so that another thread's CUDA calls neither fail nor break it."""
        with torch.cuda.device(device):
            rng = torch.cuda.get_rng_state(device)
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side), torch.no_grad():
                step()
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            current = torch.cuda.current_stream(device)
            try:
                # a capture stream of this device: torch.cuda.graph's default one is made once, on the first device
                capture = torch.cuda.graph(graph, stream=torch.cuda.Stream(device), capture_error_mode="thread_local")
                with no_collection(), torch.no_grad(), capture:
                    step()
            except RuntimeError as error:
                torch.cuda.set_stream(current)  # torch.cuda.graph leaves the capture stream current if its end raised
                raise CaptureError(f"{type(error).__name__}: {error}") from error
            finally:
                torch.cuda.set_rng_state(rng, device)
        return graph

    # ---- generate -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        new_tokens: int,
        sampling: Sampling,
        eos: list[int],
        pad_token_id: int,
        streamer=None,
        criteria=(),
        outputs: dict | None = None,
        extra=None,
        own_criteria=(),
    ) -> torch.Tensor | tuple[torch.Tensor, list, list]:
        """prompt [B, T] (left-padded) -> [B, T + n] with n <= new_tokens (fewer if every row finished).

        streamer: transformers' BaseStreamer; it gets the prompt, then each step's tokens as they are made.
        criteria: transformers' StoppingCriteria that read the tokens (stop strings, max_time); they finish rows.
        own_criteria: the caller's StoppingCriteria, given the tokens on the device as HF gives them (TokenFeed).
        outputs: {"scores": bool, "logits": bool}; where either is asked for, the result is (tokens, scores,
            logits) with each generated token's float32 [B, V] scores and logits, as HF's output_scores and
            output_logits report them.
        extra: the caller's own LogitsProcessorList; the graph then covers the model's part of each step, and the
            token's choice runs after each replay."""
        if weights_signature(self.model) != self.weights:
            raise RuntimeError(
                "the model's weights changed since this DecodeRunner was built (its plans and captured graphs read "
                "the old ones); build a new DecodeRunner (model.generate does so by itself)"
            )
        B, T = input_ids.shape
        if not 1 <= B <= MAX_BATCH:
            raise ValueError(f"batch {B}: the decode step takes 1 to {MAX_BATCH} rows (the next_token kernel)")
        lengths, sampling = (sampling.min_length, sampling.min_new_tokens), sampling.graph_key()
        keep = outputs is not None and (outputs.get("scores", False) or outputs.get("logits", False))
        st = self.state_for(B, T + new_tokens)
        has_eos = bool(eos)
        vocab = self.decode_step.embed.weight.shape[0]
        if has_eos and not 0 <= pad_token_id < vocab:
            raise ValueError(
                f"pad_token_id {pad_token_id} is outside the vocabulary (0 .. {vocab - 1}): finished rows continue "
                "with it"
            )
        self.processors(st, sampling)  # its constant masks, before any capture
        if keep and st.kept is None:
            vocab = self.decode_step.vocab
            st.kept = tuple(torch.empty(B, vocab, dtype=torch.float32, device=st.device) for _ in range(2))
        split = extra is not None
        if split and st.step_logits is None:
            st.step_logits = torch.empty(B, self.decode_step.vocab, dtype=self.decode_step.dtype,
                                         device=st.device)  # fmt: skip
        mode = (sampling, keep, split)
        if self.use_graphs and st.graph_sampling != mode:
            self._capture(st, mode)
        self.capture_error = st.capture_error if self.use_graphs else None
        kept = ([], [])
        # Each step leaves the int4 accumulators as the next one needs them; one cut short (an exception in an eager
        # step) may not have, so every generate starts from zeros.
        for part in st.chunks or [st]:
            for deferred in part.deferred.values():
                deferred.acc.zero_()
        st.eos.fill_(-1)
        if eos:
            st.eos[: len(eos)].copy_(torch.tensor(eos, dtype=torch.long))
        st.pad_token.fill_(pad_token_id)
        st.prompt_len.fill_(T)
        # HF suppresses begin_suppress_tokens at the prompt's length, one later where a forced BOS follows a
        # one-token prompt.
        st.begin_index.fill_(T + 1 if T == 1 and sampling.forced_bos_token_id is not None else T)
        st.max_length.fill_(T + new_tokens)
        st.min_length.fill_(lengths[0])
        st.min_new_tokens.fill_(lengths[1])
        st.finished.zero_()
        st.pad.copy_((attention_mask == 0).sum(-1))
        for part in st.parts:
            part.pad.copy_(st.pad)
        st.tokens[:, :T].copy_(input_ids)
        feed = None
        if streamer is not None or criteria or own_criteria:
            scores = kept[0] if outputs is not None and outputs.get("scores", False) else None
            feed = TokenFeed(st, input_ids, eos, pad_token_id, streamer, tuple(criteria), tuple(own_criteria), scores)

        # Prefill with the patched model (fused kernels + HF attention), then move its K/V into the static cache.
        position_ids = (attention_mask.long().cumsum(-1) - 1).masked_fill_(attention_mask == 0, 1)
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=True,
            logits_to_keep=1,
        )
        for i, layer in enumerate(out.past_key_values.layers):
            k, v = self.layer_caches(st, i)
            k[:, :, :T].copy_(layer.keys)
            v[:, :, :T].copy_(layer.values)
        last_logits = out.logits[:, -1].to(st.device)  # split: accelerate hands the logits back on the first device
        del out
        st.slot.fill_(T - 1)  # next_token writes the first new token at T and advances the slot to it
        self.processors(st, sampling).start(st, T)
        self.choose(st, sampling, last_logits, keep, extra, T)
        for part in st.parts:  # the segments before the last read the first new token's position next
            part.slot.fill_(T)
        if keep:
            kept[0].append(st.kept[0].clone())
            kept[1].append(st.kept[1].clone())
        if feed is not None:
            feed.queue()

        steps = new_tokens - 1
        for i in range(steps):
            if feed is not None and feed.done:  # the feed saw every row finish, a step behind
                steps = i
                break
            if st.parts:
                self.run_parts(st)
            if st.graph is not None:
                st.graph.replay()
            elif split:
                self.model_step(st)
            else:
                self.run_step(st, sampling, keep)
            if split:  # the step's input was the token at T + i
                self.choose(st, sampling, st.step_logits, keep, extra, T + i + 1)
            if keep:
                kept[0].append(st.kept[0].clone())
                kept[1].append(st.kept[1].clone())
            if feed is not None:
                feed.queue()
            elif has_eos and (i + 1) % EOS_CHECK_EVERY == 0 and bool(st.finished.all()):
                steps = i + 1
                break
        if feed is not None:
            feed.end()
        if feed is not None and feed.done:  # HF stops right after the step in which the last row finished
            tokens = st.tokens[:, : feed.length].clone()
        else:
            tokens = st.tokens[:, : T + 1 + steps].clone()
            if has_eos and bool(st.finished.all()):  # the same, read from the tokens
                generated = tokens[:, T:]
                is_eos = (generated[..., None] == st.eos).any(-1)
                first_eos = torch.where(is_eos.any(-1), is_eos.float().argmax(-1), generated.shape[1] - 1)
                tokens = tokens[:, : T + int(first_eos.max()) + 1]
        tokens = tokens.to(input_ids.device)  # split: from the last device to the prompt's, as HF returns them
        if not keep:
            return tokens
        n = tokens.shape[1] - T
        return tokens, kept[0][:n], kept[1][:n]
