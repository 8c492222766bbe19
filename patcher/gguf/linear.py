"""A linear layer holding GGUF blocks as stored, in place of nn.Linear inside a loaded model."""

from __future__ import annotations

import torch
from torch import nn

from . import format as fmt
from . import reference


class GGUFLinear(nn.Module):
    """y = x @ W^T + b with W the GGUF blocks of one tensor, kept quantized.

    Buffers: `qweight` uint8 [out_features, in_features / block * type_size] (each row the blocks along the input
    dimension, exactly as the file stores them; format.py has the layouts) and `bias` (optional, float).
    forward: with quantize_activations, W4A8 (activations quantized to Q8_1, reference.linear_w4a8); otherwise
    W4A16 (the weight dequantized and cast to the activation dtype, reference.linear_w4a16). Inputs of 1 to 8 rows
    (a decode step) of a type the kernels take run the `gguf_gemv` op of their device's backend: the CUDA kernel on
    a GPU, the same reference elsewhere. More rows (prefill) are a GEMM (cuBLAS on a GPU): the weight dequantized to
    the activations' dtype (`gguf_dequantize`) and, for W4A8, the activations rounded through Q8_1 (`round_q8_1`),
    the W4A8 product up to the dtype's rounding of each q * d and the GEMM's summation order; W4A16 there is
    reference.linear_w4a16 exactly. (reference.linear_w4a8 forms the products block by block, the kernels'
    reference, and is two orders of magnitude slower than the GEMM on a CPU.)
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        kind: str | int,
        bias: bool = False,
        quantize_activations: bool = True,
        bias_dtype: torch.dtype = torch.float32,
        device=None,
    ):
        super().__init__()
        t = fmt.block_type(kind)
        self.in_features, self.out_features = in_features, out_features
        self.kind = t.name
        self.quantize_activations = quantize_activations
        width = fmt.bytes_per_row(t.name, in_features)
        self.register_buffer("qweight", torch.zeros(out_features, width, dtype=torch.uint8, device=device))
        self.register_buffer("bias", torch.zeros(out_features, dtype=bias_dtype, device=device) if bias else None)

    @classmethod
    def from_blocks(
        cls, data: torch.Tensor, kind: str | int, bias: torch.Tensor | None = None, quantize_activations: bool = True
    ) -> GGUFLinear:
        """A layer holding `data` (uint8 [out_features, bytes], used as given, not copied) and `bias`."""
        t = fmt.block_type(kind)
        if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] % t.type_size:
            raise ValueError(
                f"{t.name} blocks must be uint8 [out, k * {t.type_size}], got {data.dtype} {tuple(data.shape)}"
            )
        in_features = data.shape[1] // t.type_size * t.block_size
        layer = cls(in_features, data.shape[0], t.name, bias is not None, quantize_activations, device="meta")
        layer.qweight = data
        if bias is not None:
            if bias.shape != (data.shape[0],):
                raise ValueError(f"bias of shape {tuple(bias.shape)} for {data.shape[0]} outputs")
            layer.bias = bias
        return layer

    def dequantize(self) -> torch.Tensor:
        """The weight as fp32 [out_features, in_features], bit-identical to gguf.quants.dequantize."""
        return fmt.dequantize(self.qweight, self.kind)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        path = self._kernel_path(x)
        if path:
            from .. import ops  # (patcher.ops imports patcher.gguf through its gguf family)

            backend = ops.backend_for(x.device)
            if path == "gemv":
                return backend.gguf_gemv(x, self.qweight, self.kind, self.bias, self.quantize_activations)
            return self.gemm(backend.round_q8_1(x) if self.quantize_activations else x, backend)
        if self.quantize_activations:
            return reference.linear_w4a8(x, self.qweight, self.kind, self.bias)
        return reference.linear_w4a16(x, self.qweight, self.kind, self.bias)

    def gemm(self, x: torch.Tensor, backend) -> torch.Tensor:
        """The prefill product from x as the GEMM takes it (for W4A8 already rounded through Q8_1): the weight
        dequantized to x's dtype, then F.linear (cuBLAS on a GPU)."""
        weight = backend.gguf_dequantize(self.qweight, self.kind, x.dtype)
        return torch.nn.functional.linear(x, weight, None if self.bias is None else self.bias.to(x.dtype))

    def _kernel_path(self, x: torch.Tensor) -> str | None:
        """The op path for x: "gemv" for a decode step's input (1 to 8 rows), "gemm" for more rows, None for the
        reference. The ops take fp16/bf16/fp32 values of their block types and record no gradient (no backward)."""
        from ..ops.gguf import GEMV_KINDS, GEMV_MAX_ROWS

        if self.kind not in GEMV_KINDS or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            return None
        if torch.is_grad_enabled() and x.requires_grad:
            return None
        rows = x.numel() // self.in_features if x.dim() and x.shape[-1] == self.in_features else 0
        if 1 <= rows <= GEMV_MAX_ROWS:
            return "gemv"
        return "gemm" if rows else None

    def extra_repr(self) -> str:
        mode = "W4A8 (Q8_1 activations)" if self.quantize_activations else "W4A16"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, type={self.kind}, {mode}, "
            f"bias={self.bias is not None}"
        )
