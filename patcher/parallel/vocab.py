"""The embedding and the lm_head of a tensor-parallel model, as the decode step runs them on each rank's shards.

transformers shards both by vocabulary (dim 0) where its plan names them:

- the lm_head "colwise_gather_output": each rank multiplies its block of vocabulary rows, and the blocks of logits
  are gathered into the whole [B, V] on every rank;
- the embedding "embedding_rowwise" (every model in later 5.x releases, tied ones in 5.17; GPT-NeoX's embed_in in
  its own plan): each rank looks up the tokens of its block of the vocabulary, zeros for the others, and the ranks'
  rows are summed. Exactly one rank adds a non-zero row for each token, so the sum is that row, bit for bit.

The decode step serves these layouts where the vocabulary divides evenly over the ranks (the blocks then start at
rank x V / ranks on any split rule, so every rank computes the same offsets and the same answer to "is it served").
"""

from __future__ import annotations

import torch
from torch import nn

from .shards import Shard, dist, shard, sharded

GATHERED_HEAD = "colwise_gather_output"


def vocab_group(weight):
    """The process group over which a vocabulary-sharded table is split, or None for a whole table."""
    return weight.device_mesh.get_group() if sharded(weight) else None


def _table_reason(weight, what: str) -> str | None:
    if not sharded(weight):
        return None
    mesh = weight.device_mesh
    if mesh.ndim != 1:
        return f"the {what} is on a {mesh.ndim}-D device mesh"
    if tuple(weight.placements) != (Shard(0),):
        return f"the {what} is sharded {tuple(weight.placements)}, not by vocabulary (Shard(dim=0))"
    if weight.shape[0] % mesh.size():
        return f"the {what}'s vocabulary {weight.shape[0]} does not divide evenly over {mesh.size()} ranks"
    return None


def vocab_reason(embed: nn.Module, lm_head: nn.Module, styles: dict[int, str]) -> str | None:
    """Why the decode step can't run this embedding and lm_head on its rank's shards, or None. `styles`:
    parallel.tp_styles of the model."""
    weight = getattr(embed, "weight", None)
    if sharded(weight):
        if type(embed).forward is not nn.Embedding.forward or embed.max_norm is not None:
            return f"a sharded {type(embed).__name__} embedding with its own lookup"
        reason = _table_reason(weight, "embedding")
        if reason:
            return reason
    weight = getattr(lm_head, "weight", None)
    if sharded(weight):
        if type(lm_head).forward is not nn.Linear.forward:
            return f"a sharded {type(lm_head).__name__} lm_head"
        style = styles.get(id(lm_head))
        if style != GATHERED_HEAD:
            return f"the lm_head is sharded {style!r} (the step gathers a {GATHERED_HEAD!r} one)"
        bias = lm_head.bias
        if bias is not None and (not sharded(bias) or tuple(bias.placements) != (Shard(0),)):
            return "the lm_head's bias is not sharded by vocabulary as its weight"
        return _table_reason(weight, "lm_head")
    return None


def embedding_lookup(tokens: torch.Tensor, weight) -> torch.Tensor:
    """nn.Embedding's lookup of `tokens` in a table sharded by vocabulary (transformers' embedding_rowwise): this
    rank's rows, zeros for tokens outside its block, summed over the ranks."""
    local, group = shard(weight), vocab_group(weight)
    start = dist.get_group_rank(group, dist.get_rank()) * local.shape[0]
    index = tokens - start
    outside = (index < 0) | (index >= local.shape[0])
    rows = torch.nn.functional.embedding(index.masked_fill(outside, 0), local)
    rows.masked_fill_(outside.unsqueeze(-1), 0)
    dist.all_reduce(rows, group=group)
    return rows


def gather_logits(local: torch.Tensor, gathered: torch.Tensor, group) -> torch.Tensor:
    """[B, V] from each rank's block of logits [B, V / ranks] (transformers' colwise_gather_output), through
    `gathered` [ranks x B, V / ranks], a buffer the caller keeps (a captured graph reads no fresh one)."""
    dist.all_gather_into_tensor(gathered, local.contiguous(), group=group)
    ranks, (batch, width) = gathered.shape[0] // local.shape[0], local.shape
    return gathered.view(ranks, batch, width).transpose(0, 1).reshape(batch, ranks * width)
