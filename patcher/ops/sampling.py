"""The decode loop's step after the lm_head (kernels/sampling/): repetition_penalty on the logits with the tokens so
far kept in a mask (repetition_penalty.cu), top-k's survivors of each row, the sampling warpers on them and their draw
(sample_survivors.cu), and the next token of every row, written into the decode state in place (next_token.cu)."""

from __future__ import annotations

import functools
import math

import torch

from .library import define

NEXT_TOKEN_MAX_PARTS = 64  # kNextTokenMaxParts (kernels/sampling/params.h): blocks per row of scores, at most
SURVIVORS_MAX = 1024  # kSampleSurvivorsMax: the most survivors a row sample_survivors takes
SURVIVORS_PART = 4096  # kSampleSurvivorsPartElems: the scores of a row one block selects from
SURVIVORS_MAX_PARTS = 64  # kSampleSurvivorsMaxParts
SURVIVORS_MAX_VOCAB = SURVIVORS_PART * SURVIVORS_MAX_PARTS  # the longest row sample_survivors takes


def next_token(scores, tokens, slot, finished, eos, pad_token, embed_weight, x, workspace, ids=None) -> None:
    """The decode step's last op, in place: each row's next token (the argmax of its scores [B, V], mapped through
    ids [B, V] where given, or pad_token once the row has finished), finished |= token in eos, tokens[:, slot + 1] =
    token, x = embed_weight[token] (when embed_weight is given: the next step's input), slot += 1. `workspace`
    (next_token_workspace) is the CUDA kernel's scratch."""
    best = scores.argmax(dim=-1)
    if ids is not None:
        best = ids.gather(1, best[:, None]).squeeze(1)
    token = torch.where(finished, pad_token, best)
    finished |= (token[:, None] == eos[None, :]).any(-1)
    tokens.index_copy_(1, slot + 1, token[:, None])
    if embed_weight is not None:
        x.copy_(embed_weight.index_select(0, token))
    slot += 1


def next_token_workspace(batch: int, device) -> torch.Tensor:
    """The zeroed scratch next_token needs (each launch leaves it zero): a ticket, then each block's partial result."""
    return torch.zeros(1 + 2 * batch * NEXT_TOKEN_MAX_PARTS, dtype=torch.int32, device=device)


define(
    "next_token(Tensor scores, Tensor(a!) tokens, Tensor(b!) slot, Tensor(c!) finished, Tensor eos, Tensor pad_token,"
    " Tensor? embed_weight, Tensor(d!) x, Tensor(e!) workspace, Tensor? ids=None) -> ()",
    next_token,
    lambda *args: None,
)


def warp_scores(scores, temperature: float, top_k: int, top_p: float, min_p: float, stable: bool = False):
    """transformers' sampling warpers in its order on float32 scores [B, n] (min_p <= 0: off): temperature, top-k,
    top-p (its ascending sort stable where `stable`: equal scores in index order), min-p; -inf where one removed a
    token."""
    if temperature != 1.0:
        scores = scores / temperature
    if 0 < top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, -math.inf)
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=False, stable=stable)
        remove = sorted_scores.softmax(dim=-1).cumsum(dim=-1) <= (1 - top_p)
        remove[..., -1:] = False
        scores = scores.masked_fill(remove.scatter(1, order, remove), -math.inf)
    if min_p > 0:
        probs = scores.softmax(dim=-1)
        remove = probs < min_p * probs.amax(dim=-1, keepdim=True)
        remove.scatter_(-1, probs.argmax(dim=-1, keepdim=True), False)
        scores = scores.masked_fill(remove, -math.inf)
    return scores


def warp_survivors(values, ids, noise, temperature, top_k, top_p, min_p, warped, sorted_ids, draw) -> None:
    """The warpers and the draw on top-k's survivors, in place. values float32 [B, m] and ids int64 [B, m]: torch.topk's
    m largest scores of each row (distinct ids, values in descending order); noise float32 [B, m]: Exp(1) draws.
    Writes sorted_ids (each row's ids in increasing order), warped (the survivors' scores in that order after
    warp_scores, its top-p sort stable: equal scores in id order) and draw = softmax(warped) / noise, whose argmax
    is a draw from the warped distribution."""
    by_id, order = torch.sort(ids, dim=-1)
    sorted_ids.copy_(by_id)
    scores = warp_scores(values.gather(1, order), temperature, top_k, top_p, min_p, stable=True)
    warped.copy_(scores)
    draw.copy_(scores.softmax(dim=-1) / noise)


def sample_survivors(scores, noise, temperature, top_k, top_p, min_p, warped, sorted_ids, draw, workspace) -> None:
    """warp_survivors on the m = warped.shape[1] largest of scores [B, V] (any float dtype, compared as float32), in
    place. `workspace` (sample_survivors_workspace) is the CUDA kernel's scratch. Which of several scores equal to
    the m-th largest survive is left to the implementation (torch.topk's choice here)."""
    values, ids = torch.topk(scores.float(), warped.shape[1], dim=-1)
    warp_survivors(values, ids, noise, temperature, top_k, top_p, min_p, warped, sorted_ids, draw)


def sample_survivors_workspace(batch: int, vocab: int, m: int, device) -> torch.Tensor:
    """The scratch sample_survivors needs, zeroed: a ticket a row (each launch leaves them zero), then the keys and
    indices of each block's m candidates."""
    parts = min(max(-(-vocab // SURVIVORS_PART), 1), SURVIVORS_MAX_PARTS)
    return torch.zeros(batch + 2 * batch * parts * m, dtype=torch.int32, device=device)


define(
    "sample_survivors(Tensor scores, Tensor noise, float temperature, int top_k, float top_p, float min_p,"
    " Tensor(a!) warped, Tensor(b!) sorted_ids, Tensor(c!) draw, Tensor(d!) workspace) -> ()",
    sample_survivors,
    lambda *args: None,
)


def repetition_penalty(logits, seen, tokens, slot, penalty: float, reciprocal: bool, out) -> None:
    """transformers' RepetitionPenaltyLogitsProcessor on a decode step's logits [B, V] (any float dtype), in place:
    seen [B, V] bool (each row's tokens so far) gains the current tokens, tokens[:, slot] (ids past the vocabulary
    are skipped), and out [B, V] float32 = the logits as float32, where seen: score < 0 ? score * penalty :
    score / penalty (HF's order of operations and cast points). `reciprocal`: the division as torch divides a
    tensor by a Python scalar on the device (scalar_division_by_reciprocal), as the product with float32(1 / penalty);
    else exact."""
    vocab = seen.shape[1]
    current = tokens.index_select(1, slot)  # [B, 1]
    at = current.clamp(0, vocab - 1)
    seen.scatter_(1, at, seen.gather(1, at) | ((current >= 0) & (current < vocab)))
    scores = logits.float()
    if reciprocal:  # torch's CUDA form: 1 / penalty in double, rounded to float32 once (exact as a Python float)
        divided = scores * torch.tensor(1.0 / penalty, dtype=torch.float32).item()
    else:  # a tensor divisor on the device divides exactly there
        divided = scores / torch.full_like(scores, penalty)
    out.copy_(torch.where(seen, torch.where(scores < 0, scores * penalty, divided), scores))


@functools.cache
def scalar_division_by_reciprocal(device: torch.device) -> bool:
    """Whether torch divides a float32 tensor on `device` by a Python scalar as the product with its reciprocal (torch's
    CUDA kernels do, the reciprocal rounded to float32 from double) rather than exactly: 169 / 13 is 13,
    169 * float32(1 / 13) is not. One host sync per device, taken where the Processors are built, outside any
    capture."""
    return (torch.full((1,), 169.0, device=device) / 13.0).item() != 13.0


define(
    "repetition_penalty(Tensor logits, Tensor(a!) seen, Tensor tokens, Tensor slot, float penalty, bool reciprocal,"
    " Tensor(b!) out) -> ()",
    repetition_penalty,
    lambda *args: None,
)
