"""Linear layers: y = x @ W + b, with W dense [in, out] (reference backend) or packed for the kernels
(fused)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import paddle

from specgen.kernels.packing import Packed
from specgen.layers.quant import DeviceBlocks
from specgen.models.checkpoint import MixedRows, QuantRows, StoredRows


@dataclass
class Linear:
    """A projection. A checkpoint reader fills `weight` with the dense [in, out] tensor and, for a GGUF file
    that stores it block-quantized, `blocks` with its raw blocks (or leaves `weight` None where a backend will
    pack from the blocks alone); the backend then replaces `weight` by what its products read."""

    # paddle.Tensor [in, out], a kernels.Packed, a quant.DeviceBlocks, or None before a backend prepares it
    weight: Any
    bias: paddle.Tensor | None = None  # [out]
    blocks: QuantRows | MixedRows | StoredRows | None = None  # HF layout [out, in / block, block bytes]

    @property
    def packed(self) -> bool:
        return isinstance(self.weight, Packed)

    def __call__(self, x: paddle.Tensor) -> paddle.Tensor:
        """x [rows, in] -> [rows, out] with Paddle's matmul (the reference product; needs a dense weight)."""
        w = self.weight.dense(x.dtype) if isinstance(self.weight, DeviceBlocks) else self.weight
        y = paddle.matmul(x, w)
        return y + self.bias if self.bias is not None else y

    def dense(self) -> paddle.Tensor:
        """The weight as a dense tensor [in, out], whatever its form."""
        if isinstance(self.weight, DeviceBlocks):
            return self.weight.dense()
        return self.weight.dense() if self.packed else self.weight
