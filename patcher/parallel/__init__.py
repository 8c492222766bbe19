"""Tensor-parallel models as transformers shards them (`from_pretrained(path, tp_plan="auto")` under torchrun)."""

from .rank_sum import RankSum, rank_sum_reason
from .shards import (
    has_sharded,
    local_heads,
    reduce_group,
    rowwise_linear,
    shard,
    sharded,
    sharding_reason,
    tp_detail,
    tp_styles,
)
from .vocab import embedding_lookup, gather_logits, vocab_group, vocab_reason

__all__ = [
    "RankSum",
    "embedding_lookup",
    "gather_logits",
    "has_sharded",
    "local_heads",
    "rank_sum_reason",
    "reduce_group",
    "rowwise_linear",
    "shard",
    "sharded",
    "sharding_reason",
    "tp_detail",
    "tp_styles",
    "vocab_group",
    "vocab_reason",
]
