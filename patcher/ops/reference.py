"""Every op's pure-torch reference under one module, for callers that compare against them (tests, evals):
`reference.<op name>` is the function its family module (norm.py, rope.py, ...) defined the op with. The helpers
the tests also use (the int4 fixed point, the exact int4 weights, the decode workspaces) are re-exported too."""

from __future__ import annotations

from .attention import decode_attention_workspace
from .int4_ops import FIXED_CLAMP, FIXED_SCALE, from_fixed, int4_weight, to_fixed
from .library import REFERENCES
from .sampling import NEXT_TOKEN_MAX_PARTS, next_token_workspace

__all__ = [
    "FIXED_CLAMP",
    "FIXED_SCALE",
    "NEXT_TOKEN_MAX_PARTS",
    "decode_attention_workspace",
    "from_fixed",
    "int4_weight",
    "next_token_workspace",
    "to_fixed",
]


def __getattr__(name: str):
    try:
        return REFERENCES[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
