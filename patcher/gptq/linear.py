"""A linear layer stored in the GPTQ format, in place of nn.Linear inside a loaded model."""

from __future__ import annotations

import torch
from torch import nn

from . import format as fmt


class GPTQLinear(nn.Module):
    """y = x @ dequantize(qweight, qzeros, scales, g_idx) + bias, with the checkpoint tensors as buffers.

    The forward dequantizes to the dtype of `scales` (fp16, as the checkpoints store them) and multiplies in the
    activation dtype: the pure-torch reference the int4 kernels are tested against.

    `qweight` is in the checkpoint layout [K/8, N], or after `to_units` (patch_model does it) in the kernels' units
    layout [K/32, N/32, 128] (format.py). The state dict holds the checkpoint layout either way, and loading one into
    a units-layout module converts it, so saving and loading see the checkpoint format only.
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
        self.register_state_dict_post_hook(_checkpoint_qweight)
        self.register_load_state_dict_pre_hook(_qweight_as_held)

    @property
    def units(self) -> bool:
        """Whether qweight is in the units layout."""
        return self.qweight.dim() == 3

    def to_units(self) -> None:
        """Puts qweight in the units layout (format.fits_units must hold); a copy, the old tensor is dropped."""
        self.qweight = fmt.to_units(self.qweight)

    def to_checkpoint(self) -> None:
        """Puts qweight back in the checkpoint layout."""
        self.qweight = fmt.checkpoint_layout(self.qweight)

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
            + (", qweight in units" if self.units else "")
        )


def _checkpoint_qweight(module: GPTQLinear, state_dict: dict, prefix: str, local_metadata) -> None:
    key = prefix + "qweight"
    if key in state_dict and state_dict[key].dim() == 3:
        state_dict[key] = fmt.from_units(state_dict[key])


def _qweight_as_held(module: GPTQLinear, state_dict: dict, prefix: str, *args) -> None:
    key = prefix + "qweight"
    incoming = state_dict.get(key)
    if incoming is not None and module.units and incoming.dim() == 2:
        state_dict[key] = fmt.to_units(incoming)
