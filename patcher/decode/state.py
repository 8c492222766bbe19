"""The decode loop's per-call state: the buffers one batch size's step reads and writes (StepState: the static KV
cache, the tokens, the workspaces, the CUDA graph), and the host's view of the tokens as they are made (TokenFeed:
streamers and stopping criteria, fed through asynchronous copies)."""

from __future__ import annotations

import torch

from ..ops import decode_attention_workspace, next_token_workspace
from .options import DecodeOptions
from .processors import Processors
from .step import DecodeStep

MAX_EOS_IDS = 8


class StepState:
    """The static buffers one (batch size, cache capacity) pair decodes in; a captured graph reads only these.

    Past `rows` rows (the GPTQ int4 and GGUF kernels take 8) the model's part of a step runs in chunks of at most
    `rows` rows, one after another: each chunk is a StepState over views of this one's cache, tokens and embeddings
    (its rows), with its own workspaces, and the logits are their rows joined. Each chunk reads the weights again,
    so a step of B rows costs about ceil(B / rows) steps of `rows` rows."""

    def __init__(self, step: DecodeStep, options: DecodeOptions, batch: int, capacity: int, rows: int | None = None,
                 whole: StepState | None = None, first: int = 0, segment: tuple | None = None):  # fmt: skip
        # segment: (device, first layer, end) of a model split over devices (DecodeStep.segments), whose layers'
        # caches this state holds (index 0: the first); default the whole step on its device
        self.segment = (step.device, 0, step.num_layers) if segment is None else segment
        dev = self.device = self.segment[0]
        self.batch, self.capacity = batch, capacity
        self.parts: list[StepState] = []  # a split model: the states of the segments before this (the last) one
        self.stream_in = self.stream_out = None  # a split model: the residual stream handed between segments
        if whole is None:
            kv_shape = (self.segment[2] - self.segment[1], batch, step.num_kv_heads, capacity, step.head_dim)
            self.k = torch.zeros(kv_shape, dtype=step.dtype, device=dev)
            self.v = torch.zeros(kv_shape, dtype=step.dtype, device=dev)
            self.tokens = torch.zeros(batch, capacity + 1, dtype=torch.long, device=dev)  # prompt + generated
            self.slot = torch.zeros(1, dtype=torch.long, device=dev)  # index of the current token (= its cache row)
            self.pad = torch.zeros(batch, dtype=torch.long, device=dev)  # leading pad tokens per row
            self.x = torch.zeros(batch, step.hidden, dtype=step.dtype, device=dev)  # the current tokens' embeddings
            self.current = torch.zeros(batch, dtype=torch.long, device=dev)  # a split model: the current tokens
            self.cos, self.sin = step.rope_tables(capacity, dev)
        else:  # a chunk: rows [first, first + batch) of `whole` (each layer's cache rows stay contiguous)
            rows_of = slice(first, first + batch)
            self.k, self.v = whole.k[:, rows_of], whole.v[:, rows_of]
            self.tokens, self.pad, self.x = whole.tokens[rows_of], whole.pad[rows_of], whole.x[rows_of]
            self.current = whole.current[rows_of]
            self.slot, self.cos, self.sin = whole.slot, whole.cos, whole.sin
        self.chunks: list[StepState] = []
        if rows is not None and batch > rows:
            self.chunks = [
                StepState(step, options, min(rows, batch - r), capacity, whole=self, first=r)
                for r in range(0, batch, rows)
            ]
        else:
            self._step_buffers(step, options, batch)
        if whole is not None:
            return
        self.finished = torch.zeros(batch, dtype=torch.bool, device=dev)
        self.eos = torch.full((MAX_EOS_IDS,), -1, dtype=torch.long, device=dev)  # EOS ids, -1 for unused entries
        self.pad_token = torch.zeros((), dtype=torch.long, device=dev)
        # The call's lengths the logits processors compare with the sequence's (processors.py).
        self.prompt_len = torch.zeros((), dtype=torch.long, device=dev)
        self.begin_index = torch.zeros((), dtype=torch.long, device=dev)
        self.max_length = torch.zeros((), dtype=torch.long, device=dev)
        self.min_length = torch.zeros((), dtype=torch.long, device=dev)
        self.min_new_tokens = torch.zeros((), dtype=torch.long, device=dev)
        self.next_token_workspace = next_token_workspace(batch, dev)
        self.graph: torch.cuda.CUDAGraph | None = None
        # the mode captured: (Sampling, keeps scores and logits, only the model's part); None before a capture ends
        self.graph_sampling: tuple | None = None
        self.capture_error: str | None = None  # why the capture for graph_sampling failed (the step then runs eagerly)
        self.step_logits: torch.Tensor | None = None  # the model's part's output, where the caller has processors
        self.kept: tuple | None = None  # float32 [B, V] scores and logits of the last step, where a call asks
        self.processors: Processors | None = None

    def _step_buffers(self, step: DecodeStep, options: DecodeOptions, batch: int) -> None:
        """What the model's part of a step of `batch` rows reads besides the cache: workspaces and per-batch
        choices."""
        dev = self.device
        cuda = dev.type == "cuda"
        # tensor parallel, an lm_head sharded by vocabulary: every rank's block of logits [ranks x B, V / ranks]
        self.gathered_logits = None
        if step.lm_group is not None:
            width = step.lm_weight.shape[0]
            self.gathered_logits = torch.empty(batch * step.vocab // width, width, dtype=step.dtype, device=dev)
        self.rank_sum = step.rank_sum(batch)  # tensor parallel on GPUs: the row-wise projections' sums
        self.cublas = cuda and batch >= options.cublas_min_batch
        # Norms inside the GEMVs' prologues (on the CPU always: the reference path is the same either way).
        widest = options.fused_norm_max_hidden if step.rms else options.fused_layer_norm_max_hidden
        self.fused_norms = not self.cublas and (not cuda or step.hidden <= widest)
        self.int4_separate_norm = batch >= options.int4_separate_norm_batch
        self.splits = step.attention_splits(batch)
        self.workspace = decode_attention_workspace(
            batch, step.num_heads, step.num_kv_heads, step.head_dim, self.splits, dev
        )
        # GPTQ int4 linears: K slices per linear for this batch size, and one workspace the kernels of one stream
        # share (each leaves its counters zero, and they run one after another); the branch stream has its own.
        plan = step.int4
        self.int4_splits = {key: plan.splits(batch, lin, head) for key, (lin, head) in plan.linears.items()}
        size = plan.workspace_numel(batch, self.int4_splits)
        self.int4_workspace = torch.zeros(size, dtype=torch.int32, device=dev)
        branch_size = size if step.branch_stream is not None else 0
        self.branch_int4_workspace = torch.zeros(branch_size, dtype=torch.int32, device=dev)
        self.deferred = plan.deferred_outputs(batch)

    def current_tokens(self) -> torch.Tensor:
        """The current tokens [B]: tokens[:, slot], read on the device (capturable)."""
        return self.tokens.index_select(1, self.slot).squeeze(1)

    @property
    def nbytes(self) -> int:
        buffers = (self.k, self.v, self.tokens, self.x)
        own = sum(t.numel() * t.element_size() for t in buffers) + self._step_nbytes()
        return own + sum(part.nbytes for part in self.parts)

    def _step_nbytes(self) -> int:
        if self.chunks:
            return sum(chunk._step_nbytes() for chunk in self.chunks)
        buffers = (self.workspace, self.int4_workspace, self.branch_int4_workspace)
        buffers += () if self.gathered_logits is None else (self.gathered_logits,)
        buffers += () if self.rank_sum is None else (self.rank_sum.inbox, self.rank_sum.epochs)
        buffers += tuple(t for d in self.deferred.values() for t in (d.acc, d.bias_rows) if t is not None)
        return sum(t.numel() * t.element_size() for t in buffers)


class TokenFeed:
    """The host's view of the tokens as they are made, for what needs them there: a streamer (transformers'
    BaseStreamer: put, end), the stopping criteria the config makes (stop strings, max_time) and the caller's own.

    The GPU never waits on Python: after each step is queued, its tokens are copied to pinned host memory
    asynchronously and an event marks the copy; the host takes them one step later, when the copy has long finished.
    As HF does, a streamer gets the prompt first, then one [B] tensor a step, pad for finished rows. A row the
    criteria stop is finished on the device too; the token the device already made for it in the step after (the
    one step of lag) becomes pad (where the call has EOS ids, as in HF), on the device and in what the streamer gets,
    so the output is HF's. The feed is done after the step in which the last row finished, where HF stops.

    Every criterion is called as HF calls it, (input_ids, scores), and may return a bool tensor [B] or one bool.
    The config's criteria (`criteria`) get the sequences so far as a CPU tensor, which needs no wait on the device.
    The caller's (`own_criteria`) get them on the model's device, as in HF (a fresh tensor each step); a result
    on the device is read at once, so the host waits there for the step queued after that token. `scores`: the
    list the runner appends each step's processed float32 scores to, where the call asks for output_scores; the
    criteria then get them as HF passes them, a tuple of one [B, V] tensor per token so far (else None)."""

    def __init__(self, st: StepState, input_ids: torch.Tensor, eos: list[int], pad_token_id: int, streamer=None,
                 criteria=(), own_criteria=(), scores: list | None = None):  # fmt: skip
        self.st, self.eos, self.pad, self.streamer, self.criteria = st, set(eos), pad_token_id, streamer, criteria
        self.own_criteria, self.scores, self.prompt_len = own_criteria, scores, input_ids.shape[1]
        self.cuda = st.tokens.is_cuda
        self.pending: list[tuple[torch.Tensor, torch.cuda.Event | None]] = []
        # the sequences so far on the host, filled a column a step (the criteria read a prefix of it)
        self.ids = torch.empty(st.batch, st.tokens.shape[1], dtype=torch.long)
        self.ids[:, : input_ids.shape[1]] = input_ids.cpu()
        self.length = input_ids.shape[1]  # tokens taken so far, prompt included
        self.finished = torch.zeros(st.batch, dtype=torch.bool)
        self.stopped = torch.zeros(st.batch, dtype=torch.bool)  # finished by a criterion, not by EOS
        self.done = False
        if streamer is not None:
            streamer.put(self.ids[:, : self.length].clone())

    def queue(self) -> None:
        """After a step (or the prefill's token) is queued: copy its tokens out, and take the step before."""
        tokens = self.st.current_tokens()
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=self.cuda)
        host.copy_(tokens, non_blocking=self.cuda)
        event = None
        if self.cuda:
            event = torch.cuda.Event()
            event.record()
        self.pending.append((host, event))
        self.take(keep=1)

    def take(self, keep: int = 0) -> None:
        while len(self.pending) > keep and not self.done:
            host, event = self.pending.pop(0)
            if event is not None:
                event.synchronize()
            host[self.stopped] = self.pad
            self.ids[:, self.length] = host
            self.length += 1
            if self.streamer is not None:
                self.streamer.put(host)
            if self.eos:
                self.finished |= torch.tensor([int(t) in self.eos for t in host.tolist()])
            if self.criteria or self.own_criteria:
                self.stop(self.criteria_hit() & ~self.finished)
            self.done = bool(self.finished.all())

    def criteria_hit(self) -> torch.Tensor:
        """The rows the criteria stop at the token just taken (bool [B] on the host)."""
        scores = None if self.scores is None else tuple(self.scores[: self.length - self.prompt_len])
        hit = torch.zeros_like(self.finished)
        if self.criteria:
            ids = self.ids[:, : self.length]
            for criterion in self.criteria:
                hit = hit | torch.as_tensor(criterion(ids, scores)).cpu()
        if self.own_criteria:
            ids = self.st.tokens[:, : self.length].clone()  # the device's tokens match self.ids (see stop)
            for criterion in self.own_criteria:
                hit = hit | torch.as_tensor(criterion(ids, scores)).cpu()
        return hit.bool().expand_as(self.finished)

    def stop(self, rows: torch.Tensor) -> None:
        """Finishes `rows`. Where the call has EOS ids, HF pads finished rows: then they finish on the device as
        well, and the token it made for them after this one becomes pad. Without EOS ids HF lets them run on."""
        if not rows.any():
            return
        self.finished |= rows
        if not self.eos:
            return
        self.stopped |= rows
        on_device = rows.to(self.st.finished.device, non_blocking=True)
        self.st.finished.logical_or_(on_device)
        after = self.st.tokens[:, self.length]
        after.copy_(torch.where(on_device, self.pad, after))

    def end(self) -> None:
        self.take()
        if self.streamer is not None:
            self.streamer.end()
