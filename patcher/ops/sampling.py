"""The decode loop's step after the lm_head (kernels/sampling/next_token.cu): the next token of every row, written
into the decode state in place."""

from __future__ import annotations

import torch

from .library import define

NEXT_TOKEN_MAX_PARTS = 64  # kNextTokenMaxParts (kernels/sampling/params.h): blocks per row of scores, at most


def next_token(scores, tokens, slot, finished, eos, pad_token, embed_weight, x, workspace) -> None:
    """The decode step's last op, in place: each row's next token (the argmax of its scores [B, V], or pad_token
    once the row has finished), finished |= token in eos, tokens[:, slot + 1] = token, x = embed_weight[token] (when
    embed_weight is given: the next step's input), slot += 1. `workspace` (next_token_workspace) is the CUDA
    kernel's scratch."""
    token = torch.where(finished, pad_token, scores.argmax(dim=-1))
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
    " Tensor? embed_weight, Tensor(d!) x, Tensor(e!) workspace) -> ()",
    next_token,
    lambda *args: None,
)
