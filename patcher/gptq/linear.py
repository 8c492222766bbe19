"""A linear layer stored in the GPTQ format, in place of nn.Linear inside a loaded model."""

from __future__ import annotations

import torch
from torch import nn

from . import format as fmt


class GPTQLinear(nn.Module):
    """y = x @ dequantize(qweight, qzeros, scales, g_idx) + bias, with the checkpoint tensors as buffers.

    The forward dequantizes to the dtype of `scales` (fp16, as the checkpoints store them) and multiplies in the
    activation dtype: the pure-torch reference the int4 kernels are tested against.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group_size: int,
        bias: bool,
        version: int = 1,
        scales_dtype: torch.dtype = torch.float16,
        device=None,
    ):
        super().__init__()
        if in_features % fmt.PACK or out_features % fmt.PACK:
            raise ValueError(
                f"GPTQ 4-bit needs in/out features divisible by {fmt.PACK}, got {in_features}x{out_features}"
            )
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group_size, self.version = fmt.BITS, group_size, version
        groups = fmt.groups_for(in_features, group_size)
        kw = {"device": device}
        self.register_buffer("qweight", torch.zeros(in_features // fmt.PACK, out_features, dtype=torch.int32, **kw))
        self.register_buffer("qzeros", torch.zeros(groups, out_features // fmt.PACK, dtype=torch.int32, **kw))
        self.register_buffer("scales", torch.zeros(groups, out_features, dtype=scales_dtype, **kw))
        self.register_buffer("g_idx", fmt.default_g_idx(in_features, group_size, device))
        self.register_buffer("bias", torch.zeros(out_features, dtype=scales_dtype, **kw) if bias else None)

    def dequantize(self) -> torch.Tensor:
        """The weight as [in_features, out_features] in the dtype of the scales."""
        return fmt.dequantize(self.qweight, self.qzeros, self.scales, self.g_idx, self.version)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x @ self.dequantize().to(x.dtype)
        return out + self.bias.to(x.dtype) if self.bias is not None else out

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
            f"group_size={self.group_size}, format=v{self.version}, bias={self.bias is not None}"
        )
