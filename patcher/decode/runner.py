"""The decode loop of a patched model: a static KV cache and one CUDA graph per decode step.

    prefill      the patched model's own forward (fused kernels, HF's SDPA/flash) on the prompt; its K/V are copied
                 into the static cache, and the first token is chosen from its last logits
    decode step  the embedding -> every layer (step.py) -> final add + norm -> lm_head -> (sampling warpers) ->
                 next_token: the token chosen, written after the current one, the position counter advanced and
                 the new token's embedding looked up for the next step, in one kernel

On CUDA the step is captured once per batch size and cache size and replayed for every token: one host call per
token, no host sync (the loop checks for EOS every few steps). The cache position lives in a device tensor, so
the same graph serves every step. On the CPU (tests, reference backend) the same step runs eagerly.

The runner owns the buffers (StepState), the capture and the token loop; DecodeStep (step.py) owns the layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..layers.guard import weights_signature
from ..ops import REFERENCE, decode_attention_workspace, next_token_workspace
from .options import DecodeOptions
from .step import DecodeStep

EOS_CHECK_EVERY = 16  # decode steps between host checks for "every row has finished"
MIN_CAPACITY = 256
MAX_EOS_IDS = 8


@dataclass
class Sampling:
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0


class StepState:
    """The static buffers one (batch size, cache capacity) pair decodes in; a captured graph reads only these."""

    def __init__(self, step: DecodeStep, options: DecodeOptions, batch: int, capacity: int):
        dev, cuda = step.device, step.device.type == "cuda"
        self.batch, self.capacity = batch, capacity
        kv_shape = (step.num_layers, batch, step.num_kv_heads, capacity, step.head_dim)
        self.k = torch.zeros(kv_shape, dtype=step.dtype, device=dev)
        self.v = torch.zeros(kv_shape, dtype=step.dtype, device=dev)
        self.tokens = torch.zeros(batch, capacity + 1, dtype=torch.long, device=dev)  # prompt + generated
        self.slot = torch.zeros(1, dtype=torch.long, device=dev)  # index of the current token (= its cache row)
        self.pad = torch.zeros(batch, dtype=torch.long, device=dev)  # leading pad tokens per row
        self.finished = torch.zeros(batch, dtype=torch.bool, device=dev)
        self.eos = torch.full((MAX_EOS_IDS,), -1, dtype=torch.long, device=dev)  # EOS ids, -1 for unused entries
        self.pad_token = torch.zeros((), dtype=torch.long, device=dev)
        self.x = torch.zeros(batch, step.hidden, dtype=step.dtype, device=dev)  # the current tokens' embeddings
        self.next_token_workspace = next_token_workspace(batch, dev)
        self.cublas = cuda and batch >= options.cublas_min_batch
        # Norms inside the GEMVs' prologues (on the CPU always: the reference path is the same either way).
        self.fused_norms = not self.cublas and (not cuda or step.hidden <= options.fused_norm_max_hidden)
        self.int4_separate_norm = batch >= options.int4_separate_norm_batch
        self.splits = step.attention_splits(batch)
        self.workspace = decode_attention_workspace(
            batch, step.num_heads, step.num_kv_heads, step.head_dim, self.splits, dev
        )
        self.cos, self.sin = step.rope_tables(capacity)
        # GPTQ int4 linears: K slices per linear for this batch size, and one workspace the kernels of one stream
        # share (each leaves its counters zero, and they run one after another); the branch stream has its own.
        plan = step.int4
        self.int4_splits = {key: plan.splits(batch, lin, head) for key, (lin, head) in plan.linears.items()}
        size = plan.workspace_numel(batch, self.int4_splits)
        self.int4_workspace = torch.zeros(size, dtype=torch.int32, device=dev)
        branch_size = size if step.branch_stream is not None else 0
        self.branch_int4_workspace = torch.zeros(branch_size, dtype=torch.int32, device=dev)
        self.deferred = plan.deferred_outputs(batch)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.graph_sampling: Sampling | None = None

    @property
    def nbytes(self) -> int:
        buffers = (self.k, self.v, self.tokens, self.x, self.workspace, self.int4_workspace, self.branch_int4_workspace)
        buffers += tuple(t for d in self.deferred.values() for t in (d.acc, d.bias_rows) if t is not None)
        return sum(t.numel() * t.element_size() for t in buffers)


class DecodeRunner:
    def __init__(self, model, options: DecodeOptions | None = None):
        options = DecodeOptions() if options is None else options
        if not isinstance(options, DecodeOptions):
            raise TypeError(f"DecodeRunner takes a DecodeOptions, got {type(options).__name__}")
        self.model, self.options = model, options
        state = getattr(model, "_patcher_state", None)
        if state is not None:  # plans rebuilt where the weights changed since they were built (and no forward ran)
            state.check_weights(model)
        self.decode_step = DecodeStep(model, options)
        self.device = self.decode_step.device
        self.use_graphs = options.use_graphs and self.device.type == "cuda"
        self.next_token_ops = None if options.fuse_next_token else REFERENCE
        self.states: dict[int, StepState] = {}  # batch size -> buffers (and graph), grown on demand
        self.weights = weights_signature(model)  # the plans, caches and graphs read these weights' memory

    def state_for(self, batch: int, needed: int) -> StepState:
        state = self.states.get(batch)
        if state is None or state.capacity < needed:
            self.states.pop(batch, None)  # free the smaller cache (and its graph) first
            capacity = max(MIN_CAPACITY, 1 << (needed - 1).bit_length())
            state = self.states[batch] = StepState(self.decode_step, self.options, batch, capacity)
        return state

    def memory_bytes(self) -> int:
        return sum(s.nbytes for s in self.states.values())

    def logits(self, st: StepState, x: torch.Tensor | None = None) -> torch.Tensor:
        return self.decode_step.logits(st, x)

    @staticmethod
    def scores(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
        """What next_token takes the argmax of: the logits (greedy), or for sampling, after HF's warpers in HF's
        order (temperature, top-k, top-p), probs / E with E ~ Exp(1), whose argmax is a draw from probs (no host
        sync, a graph-capturable RNG)."""
        if not sampling.do_sample:
            return logits
        scores = logits.float()
        if sampling.temperature != 1.0:
            scores = scores / sampling.temperature
        if 0 < sampling.top_k < scores.shape[-1]:
            kth = torch.topk(scores, sampling.top_k, dim=-1).values[..., -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if sampling.top_p < 1.0:
            sorted_scores, order = torch.sort(scores, descending=False)
            remove = sorted_scores.softmax(dim=-1).cumsum(dim=-1) <= (1 - sampling.top_p)
            remove[..., -1:] = False
            scores = scores.masked_fill(remove.scatter(1, order, remove), float("-inf"))
        probs = scores.softmax(dim=-1)
        return probs / torch.empty_like(probs).exponential_(1.0)

    def next_token(self, scores: torch.Tensor, st: StepState) -> None:
        """The token after the current one from `scores` (pad for finished rows; EOS ids finish a row) written at
        slot + 1, the slot advanced, and (plain embeddings) the new token's embedding in st.x: one kernel."""
        ops = self.next_token_ops or self.decode_step.ops
        embed_weight = self.decode_step.embed_weight
        ops.next_token(scores, st.tokens, st.slot, st.finished, st.eos, st.pad_token, embed_weight, st.x,
                       st.next_token_workspace)  # fmt: skip

    def run_step(self, st: StepState, sampling: Sampling) -> None:
        """One decode step: logits, the token chosen, written and its embedding looked up."""
        x = st.x if self.decode_step.embed_weight is not None else None
        self.next_token(self.scores(self.logits(st, x), sampling), st)

    # ---- CUDA graph -----------------------------------------------------------------------------------------
    def _capture(self, st: StepState, sampling: Sampling) -> None:
        """Captures one step on the state's buffers. Runs before prefill: the warm-up's writes are overwritten."""
        rng = torch.cuda.get_rng_state(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side), torch.no_grad():
            self.run_step(st, sampling)  # warm-up: allocator, lazy module state
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph), torch.no_grad():
            self.run_step(st, sampling)
        torch.cuda.set_rng_state(rng, self.device)
        st.graph, st.graph_sampling = graph, sampling

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
    ) -> torch.Tensor:
        """prompt [B, T] (left-padded) -> [B, T + n] with n <= new_tokens (fewer if every row hit EOS)."""
        if weights_signature(self.model) != self.weights:
            raise RuntimeError(
                "the model's weights changed since this DecodeRunner was built (its plans and captured graphs read "
                "the old ones); build a new DecodeRunner (model.generate does so by itself)"
            )
        B, T = input_ids.shape
        st = self.state_for(B, T + new_tokens)
        has_eos = bool(eos)
        vocab = self.decode_step.embed.weight.shape[0]
        if has_eos and not 0 <= pad_token_id < vocab:
            raise ValueError(
                f"pad_token_id {pad_token_id} is outside the vocabulary (0 .. {vocab - 1}): finished rows continue "
                "with it"
            )
        if self.use_graphs and (st.graph is None or st.graph_sampling != sampling):
            st.graph = None
            self._capture(st, sampling)
        # Each step leaves the int4 accumulators as the next one needs them; one cut short (an exception in an eager
        # step) may not have, so every generate starts from zeros.
        for deferred in st.deferred.values():
            deferred.acc.zero_()
        st.eos.fill_(-1)
        if eos:
            st.eos[: len(eos)].copy_(torch.tensor(eos, dtype=torch.long))
        st.pad_token.fill_(pad_token_id)
        st.finished.zero_()
        st.pad.copy_((attention_mask == 0).sum(-1))
        st.tokens[:, :T].copy_(input_ids)

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
            st.k[i, :, :, :T].copy_(layer.keys)
            st.v[i, :, :, :T].copy_(layer.values)
        last_logits = out.logits[:, -1]
        del out
        st.slot.fill_(T - 1)  # next_token writes the first new token at T and advances the slot to it
        self.next_token(self.scores(last_logits, sampling), st)

        steps = new_tokens - 1
        for i in range(steps):
            if st.graph is not None:
                st.graph.replay()
            else:
                self.run_step(st, sampling)
            if has_eos and (i + 1) % EOS_CHECK_EVERY == 0 and bool(st.finished.all()):
                steps = i + 1
                break
        length = T + 1 + steps
        tokens = st.tokens[:, :length].clone()
        if has_eos and bool(st.finished.all()):
            # HF stops right after the step in which the last row finished.
            generated = tokens[:, T:]
            is_eos = (generated[..., None] == st.eos).any(-1)
            first_eos = torch.where(is_eos.any(-1), is_eos.float().argmax(-1), generated.shape[1] - 1)
            tokens = tokens[:, : T + int(first_eos.max()) + 1]
        return tokens
