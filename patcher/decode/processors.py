"""Logits processing of the decode step on the GPU, in transformers' semantics and order, inside the captured graph.

`generate` in transformers turns the generation config into a list of LogitsProcessors
(`GenerationMixin._get_logits_processor`) and applies it to each step's logits, cast to float32, before the argmax
(greedy) or the draw (sampling). The decode runner applies the same processing to the same float32 logits, in the
same order, as tensor ops that need no host sync, so the step stays one graph replay:

    repetition_penalty          every token of the row so far, prompt included, its left padding excluded where
                                transformers excludes it (PENALTY_SKIPS_PADDING): score < 0 ? score * penalty
                                : score / penalty; the tokens so far are a [B, V] mask set before the first token
                                (Processors.start) that the op gains the current token in, with the float32 cast
    no_repeat_ngram_size n      -inf for each token that would complete an n-gram already in the row (prompt and
                                its left padding included, as HF reads the raw input_ids): every window of the
                                token buffer whose first n - 1 tokens equal the row's last n - 1 bans its last token
    bad_words_ids               + -inf (HF adds a bias) on single-token words always, and on a longer word's last
                                token where the row ends with the word's prefix (padding included); words equal to
                                one EOS id are dropped, as HF drops them
    min_length, min_new_tokens  EOS ids at -inf while the sequence (or its new part) is shorter
    forced_bos_token_id         at length 1, every token at -inf but BOS (0)
    forced_eos_token_id         at max_length - 1, every token at -inf but those ids (0)
    suppress_tokens             always -inf
    begin_suppress_tokens       -inf at the first generated position
    (sampling) temperature, top_k, top_p, min_p, then a draw; with top_k on, on the SURVIVORS_PER_K * top_k
                                largest scores only (Processors.survivors)

Whatever depends on the call (the prompt length, max_length, min_length, min_new_tokens) is a device tensor of the
StepState, set before the first step; the token ids and the other values are constants of `Sampling`, so a graph is
captured once per `Sampling.graph_key()`. The n-gram and bad-word matches read the StepState's whole token buffer
[B, capacity + 1] with masks built from the device tensor st.slot (the current token's index), so their shapes never
depend on the length so far.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from ..ops import REFERENCE
from ..ops.sampling import (
    SURVIVORS_MAX,
    SURVIVORS_MAX_VOCAB,
    sample_survivors_workspace,
    scalar_division_by_reciprocal,
    warp_scores,
)


def _penalty_skips_padding() -> bool:
    """Whether transformers' generate leaves each row's left padding out of repetition_penalty. Later 5.x releases
    (5.24) pass the rows' padding lengths to RepetitionPenaltyLogitsProcessor, which takes them as a tensor there;
    earlier ones (5.17) take only an int and penalize pad tokens like any other."""
    try:
        RepetitionPenaltyLogitsProcessor(1.5, prompt_ignore_length=torch.zeros(1, dtype=torch.long))
    except ValueError:
        return False
    return True


PENALTY_SKIPS_PADDING = _penalty_skips_padding()
# With top-k on, the warpers and the draw read the SURVIVORS_PER_K * top_k largest scores (Processors.survivors):
# exact unless more tokens than that tie with or beat the k-th largest.
SURVIVORS_PER_K = 2


@dataclass(frozen=True)
class Sampling:
    """The logits processing and token choice of a generate call (transformers' names and defaults)."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float | None = None
    repetition_penalty: float = 1.0
    min_length: int = 0  # needs eos ids
    min_new_tokens: int = 0  # needs eos ids
    eos: tuple[int, ...] = ()  # the EOS ids min_length and min_new_tokens act on
    forced_bos_token_id: int | None = None
    forced_eos_token_ids: tuple[int, ...] = ()  # forced at max_length - 1
    suppress_tokens: tuple[int, ...] = ()
    begin_suppress_tokens: tuple[int, ...] = ()
    no_repeat_ngram_size: int = 0  # 0: off
    bad_words_ids: tuple[tuple[int, ...], ...] = ()  # as HF's NoBadWordsLogitsProcessor keeps them (EOS words out)

    def graph_key(self) -> Sampling:
        """This processing with min_length and min_new_tokens reduced to whether they are on: their values reach the
        step as device tensors (StepState.min_length, min_new_tokens), so calls that differ only in them share the
        processors' masks and a captured graph."""
        return dataclasses.replace(self, min_length=min(self.min_length, 1), min_new_tokens=min(self.min_new_tokens, 1))

    @property
    def processes(self) -> bool:
        """Whether the logits are processed at all (else greedy is the argmax of the raw logits)."""
        return self.do_sample or self != Sampling(do_sample=self.do_sample, eos=self.eos)


class Processors:
    """`Sampling` as tensor ops over one StepState's tokens; the constant masks are built here, before any capture
    (a graph cannot copy host lists to the device), and so is sample_survivors' workspace for `batch` rows. `ops`:
    the backend that runs sample_survivors (the reference by default, and for scores of another shape)."""

    def __init__(self, sampling: Sampling, vocab: int, device: torch.device, ops=None, batch: int = 1):
        self.sampling, self.vocab = sampling, vocab
        self.ops = REFERENCE if ops is None else ops
        # Whether a processor acts before the warpers: then the scores are float32 first, as HF casts the logits.
        self.masks = dataclasses.replace(sampling, do_sample=False, temperature=1.0, top_k=0, top_p=1.0,
                                         min_p=None).processes  # fmt: skip
        m = min(SURVIVORS_PER_K * sampling.top_k, vocab)
        self.survivors_on_kernel = (
            self.ops is not REFERENCE and sampling.do_sample and 0 < m <= SURVIVORS_MAX and vocab <= SURVIVORS_MAX_VOCAB
        )
        self.batch = batch
        self.workspace = sample_survivors_workspace(batch, vocab, m, device) if self.survivors_on_kernel else None

        def mask(ids) -> torch.Tensor:
            m = torch.zeros(vocab, dtype=torch.bool, device=device)
            if ids:
                m[torch.tensor(list(ids), device=device)] = True
            return m

        # repetition_penalty: each row's tokens so far, set by start() and gaining the current token every step
        self.seen, self.reciprocal = None, False
        if sampling.repetition_penalty != 1.0:
            self.seen = torch.zeros(batch, vocab, dtype=torch.bool, device=device)
            self.reciprocal = scalar_division_by_reciprocal(torch.device(device))  # HF's score / penalty here
        self.eos_mask = mask(sampling.eos)
        self.suppress_mask = mask(sampling.suppress_tokens)
        self.begin_mask = mask(sampling.begin_suppress_tokens)
        self.bos_row = None
        if sampling.forced_bos_token_id is not None:
            self.bos_row = torch.where(mask([sampling.forced_bos_token_id]), 0.0, -math.inf)
        self.eos_row = torch.where(mask(sampling.forced_eos_token_ids), 0.0, -math.inf)
        words = sampling.bad_words_ids
        self.bad_single = mask([w[0] for w in words if len(w) == 1])
        # Longer bad words: their prefixes right-aligned in one [words, longest prefix] tensor (`bad_valid` marks the
        # prefix's own positions), matched against each row's last tokens all at once.
        longer = [w for w in words if len(w) > 1]
        self.bad_prefixes = None
        if longer:
            width = max(len(w) - 1 for w in longer)
            prefixes = torch.zeros(len(longer), width, dtype=torch.long)
            valid = torch.zeros(len(longer), width, dtype=torch.bool)
            for i, w in enumerate(longer):
                prefixes[i, width - len(w) + 1 :] = torch.tensor(w[:-1])
                valid[i, width - len(w) + 1 :] = True
            self.bad_prefixes, self.bad_valid = prefixes.to(device), valid.to(device)
            self.bad_last = torch.tensor([w[-1] for w in longer], device=device)
            self.bad_prefix_len = torch.tensor([len(w) - 1 for w in longer], device=device)

    def __call__(self, logits: torch.Tensor, st, keep: tuple | None = None, extra=None, input_ids=None):
        """What next_token takes the argmax of, for the step whose current token is at st.slot: the logits
        themselves where nothing processes them; else the processed float32 scores (greedy), or probs / E with
        E ~ Exp(1), whose argmax is a draw from probs (sampling): over the vocabulary, or with top-k on, a pair
        (probs / E of the survivors [B, m], their ids [B, m]) whose argmax next_token maps through the ids. `keep`: float32 [B, V] buffers (scores, logits)
        that receive what HF's generate reports as the step's `scores` (processed and warped) and `logits`.
        `extra`: the caller's own LogitsProcessorList, run as HF runs it, after these processors and before the
        warpers, on `input_ids` (the sequences so far)."""
        p = self.sampling
        if keep is not None:
            keep[1].copy_(logits)
        if not p.processes and extra is None:
            if keep is not None:
                keep[0].copy_(logits)
            return logits
        if p.do_sample and p.top_k > 0 and not self.masks and extra is None and keep is None:
            _, ids, drawn = self.survivors(logits)  # sample_survivors reads the logits in their own dtype
            return drawn, ids
        length = st.slot + 1  # the sequence so far, as HF's input_ids.shape[-1]
        if p.repetition_penalty != 1.0:  # the float32 cast and the penalty in one op
            scores = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
            self.ops.repetition_penalty(logits, self.seen, st.tokens, st.slot, float(p.repetition_penalty),
                                        self.reciprocal, scores)  # fmt: skip
        else:
            scores = logits.float()
        if p.no_repeat_ngram_size:
            scores = self.no_repeat_ngram(scores, st)
        if p.bad_words_ids:
            scores = self.bad_words(scores, st, length)
        if p.eos and p.min_length > 0:
            scores = torch.where(self.eos_mask & (length < st.min_length), -math.inf, scores)
        if p.eos and p.min_new_tokens > 0:
            scores = torch.where(self.eos_mask & (length - st.prompt_len < st.min_new_tokens), -math.inf, scores)
        if self.bos_row is not None:
            scores = torch.where(length == 1, self.bos_row, scores)
        if p.forced_eos_token_ids:
            scores = torch.where(length == st.max_length - 1, self.eos_row, scores)
        if p.suppress_tokens:
            scores = scores.masked_fill(self.suppress_mask, -math.inf)
        if p.begin_suppress_tokens:
            scores = torch.where(self.begin_mask & (length == st.begin_index), -math.inf, scores)
        if extra is not None:
            scores = extra(input_ids, scores)
        if not p.do_sample:
            if keep is not None:
                keep[0].copy_(scores)
            return scores
        survivors = self.survivors(scores)
        if survivors is None:
            scores = self.warp(scores)
            if keep is not None:
                keep[0].copy_(scores)
            return self.draw(scores)
        warped, ids, drawn = survivors
        if keep is not None:
            keep[0].fill_(-math.inf).scatter_(1, ids, warped)
        return drawn, ids

    def start(self, st, length: int) -> None:
        """Before a call's first token, with its first `length` tokens in st.tokens and st.pad set: repetition_penalty's
        mask of each row's tokens so far (its left padding left out where transformers leaves it out)."""
        if self.seen is None:
            return
        positions = torch.arange(st.tokens.shape[1], device=st.tokens.device)
        match = (positions < length).expand_as(st.tokens)
        if PENALTY_SKIPS_PADDING:
            match = match & (positions >= st.pad[:, None])
        self.seen.copy_(self._hits(match, st.tokens))

    def no_repeat_ngram(self, scores: torch.Tensor, st) -> torch.Tensor:
        """HF's NoRepeatNGramLogitsProcessor on the sequence so far, st.tokens[:, : slot + 1]: each complete n-gram
        window whose first n - 1 tokens equal the row's last n - 1 bans its last token (nothing before n tokens)."""
        n, tokens = self.sampling.no_repeat_ngram_size, st.tokens
        if n > tokens.shape[1]:  # no sequence in this buffer is long enough to hold an n-gram
            return scores
        windows = tokens.unfold(1, n, 1)  # [B, capacity + 2 - n, n]: window s is tokens[:, s : s + n]
        starts = torch.arange(windows.shape[1], device=scores.device)
        match = (starts <= st.slot + 1 - n).expand(tokens.shape[0], -1)  # windows inside the sequence so far
        if n > 1:
            # where the sequence is shorter than n, no window qualifies, so the clamped indices are never used
            last = (st.slot + 2 - n + torch.arange(n - 1, device=scores.device)).clamp(min=0)
            prefix = tokens.index_select(1, last)  # [B, n - 1]
            match = match & (windows[..., :-1] == prefix[:, None]).all(-1)
        return scores.masked_fill(self._hits(match, windows[..., -1]), -math.inf)

    def bad_words(self, scores: torch.Tensor, st, length: torch.Tensor) -> torch.Tensor:
        """HF's NoBadWordsLogitsProcessor: scores + a bias of -inf on banned tokens (0 elsewhere), as HF adds it."""
        banned = self.bad_single.expand_as(scores)
        if self.bad_prefixes is not None:
            width = self.bad_prefixes.shape[1]
            recent = (st.slot + 1 - width + torch.arange(width, device=scores.device)).clamp(min=0)
            tail = st.tokens.index_select(1, recent)  # [B, width]: the row's last tokens, right-aligned
            same = (tail[:, None, :] == self.bad_prefixes) | ~self.bad_valid  # [B, words, width]
            # HF skips a word whose prefix is longer than the sequence so far
            match = same.all(-1) & (self.bad_prefix_len <= length)
            banned = banned | self._hits(match, self.bad_last.expand_as(match))
        return scores + torch.where(banned, -math.inf, 0.0)

    def _hits(self, match: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """[B, V] bool: True at ids[b, j] for each match[b, j]. Ids past the vocabulary (an embedding table larger
        than the lm_head) and unmatched entries go to a spare column, where they unban nothing."""
        hit = torch.zeros(match.shape[0], self.vocab + 1, dtype=torch.bool, device=match.device)
        return hit.scatter(1, torch.where(match, ids.clamp(max=self.vocab), self.vocab), True)[:, : self.vocab]

    def warp(self, scores: torch.Tensor) -> torch.Tensor:
        """HF's sampling warpers in HF's order (temperature, top-k, top-p, min-p) on the whole vocabulary: the scores
        HF's generate reports, -inf where a warper removed the token."""
        survivors = self.survivors(scores)
        if survivors is None:
            p = self.sampling
            return warp_scores(scores, p.temperature, p.top_k, p.top_p, p.min_p or 0.0)
        warped, ids, _ = survivors
        return torch.full_like(scores, -math.inf).scatter_(1, ids, warped)

    def survivors(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """With top-k on, the warpers and the draw on the only tokens that can survive top-k (sample_survivors):
        (warped scores [B, m], their ids [B, m] in increasing order, probs / E of them), m = min(SURVIVORS_PER_K *
        top_k, V), -inf where a warper removed one; None with top-k off. A full-vocabulary top-p would sort all V
        scores; here one kernel selects the m and warps them (the reference past SURVIVORS_MAX survivors or
        SURVIVORS_MAX_VOCAB scores).

        The same as warping all V scores unless more than m tokens score at least the k-th largest score (ties at the
        k-th), and up to the order of equal scores in top-p's sort, which HF's unstable sort leaves to the sort's
        implementation (here: id order). Dividing by the temperature keeps the order, so the k largest scaled scores
        are among the m selected, and the softmax of the survivors is HF's softmax over the vocabulary, whose other
        entries are -inf after top-k."""
        p = self.sampling
        if p.top_k <= 0:
            return None
        rows, m = scores.shape[0], min(SURVIVORS_PER_K * p.top_k, scores.shape[-1])
        noise = torch.empty(rows, m, device=scores.device).exponential_(1.0)
        warped, drawn = torch.empty_like(noise), torch.empty_like(noise)
        by_id = torch.empty(rows, m, dtype=torch.long, device=scores.device)
        ops, workspace = REFERENCE, None
        if self.survivors_on_kernel and scores.shape == (self.batch, self.vocab):  # the runner's step: its batch
            ops, workspace = self.ops, self.workspace
        ops.sample_survivors(scores, noise, float(p.temperature), int(p.top_k), float(p.top_p), float(p.min_p or 0.0),
                             warped, by_id, drawn, workspace)  # fmt: skip
        return warped, by_id, drawn

    @staticmethod
    def draw(scores: torch.Tensor) -> torch.Tensor:
        """probs / E with E ~ Exp(1): its argmax is a draw from softmax(scores), with no host sync and a
        graph-capturable RNG."""
        probs = scores.softmax(dim=-1)
        return probs / torch.empty_like(probs).exponential_(1.0)
