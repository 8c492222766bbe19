"""The residual stream as it passes between patched layers: the residual and the deltas not yet added to it.

A patched layer does not add its sub-layer outputs to the residual. It hands `(residual, delta, delta2)` to the
next module, whose first kernel adds them while it normalizes (fused add+norm). The final norm takes the last
layer's sum the same way, so the stack has no standalone residual adds.

Where the next module is not patched, or HF is recording per-layer hidden states (`output_hidden_states=True`),
a layer returns the summed tensor instead, computed in the same order as HF, so nothing outside sees a stream.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

try:  # transformers >= 5: the collector that `output_hidden_states=True` activates
    from transformers.utils.output_capturing import _active_collector
except ImportError:  # pragma: no cover - older layouts record nothing we could miss
    _active_collector = None


class ResidualStream(NamedTuple):
    residual: torch.Tensor
    delta: torch.Tensor | None = None  # LLaMA: the sub-layer output; GPT-NeoX parallel: attention output
    delta2: torch.Tensor | None = None  # GPT-NeoX parallel residual: the MLP output


def as_stream(hidden_states) -> ResidualStream:
    if isinstance(hidden_states, ResidualStream):
        return hidden_states
    return ResidualStream(hidden_states)


def materialize(residual: torch.Tensor, delta: torch.Tensor | None, delta2: torch.Tensor | None) -> torch.Tensor:
    """The summed hidden state, rounded exactly as HF rounds it (`(mlp + attn) + x` for the parallel residual)."""
    if delta is None:
        return residual
    if delta2 is None:
        return residual + delta
    return (delta2 + delta) + residual


def recording_hidden_states() -> bool:
    """True while HF collects per-layer hidden states (those must be plain tensors)."""
    if _active_collector is None:
        return False
    collected = _active_collector.get()
    return collected is not None and "hidden_states" in collected
