"""Weights kept as GGUF blocks on the reference backend (--quantization wint8 / wint4, or a GGUF's own blocks
with --keep-blocks): each product dequantizes its weight in Paddle's operators, one layer at a time, to
exactly the float32 values gguf.quants gives (those the fused kernels rebuild), so the model holds its blocks
(1.06 bytes a weight in Q8_0, 0.63 in Q4_1) instead of float32 copies (4). Paddle's operators run on any
device, so this is the GPU path too (where Paddle's own weight_only_linear is the faster alternative, with its
own per-channel scales and so other numbers)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import paddle

from specgen.kernels.packing import block_parts
from specgen.models.checkpoint import QUANT_BLOCK_WEIGHTS

# formats kept as stored; the others (K-quants, QX) as block_parts' d, m, q per 16 inputs
NATIVE = ("Q8_0", "Q4_0", "Q4_1")


@dataclass
class DeviceBlocks:
    """A weight [in, out] kept as blocks on the device, rows [out, in / 32, ...]:
    Q8_0: d float16 [out, kb, 1], q int8 [out, kb, 32]; Q4_0 / Q4_1: d (and m) float16 [out, kb, 1], the
    stored nibble bytes uint8 [out, kb, 16] (input j in byte j's low nibble, j + 16 in its high one); other
    kinds ("QX"): d and m float32 [out, kb, 2] (per 16 inputs), q int8 [out, kb, 32]."""

    kind: str
    d: paddle.Tensor
    m: paddle.Tensor | None
    q: paddle.Tensor
    out: int
    inp: int

    @classmethod
    def of(cls, kind: str, blocks: np.ndarray) -> "DeviceBlocks":
        """From GGUF blocks [out, in / block weights, block bytes] of `kind`."""
        out, inp = blocks.shape[0], blocks.shape[1] * QUANT_BLOCK_WEIGHTS[kind]

        def f16(a: np.ndarray) -> paddle.Tensor:
            return paddle.to_tensor(np.ascontiguousarray(a).view(np.float16))

        if kind in NATIVE:
            qs = blocks[..., 4:] if kind == "Q4_1" else blocks[..., 2:]
            q = paddle.to_tensor(np.ascontiguousarray(qs).view(np.int8 if kind == "Q8_0" else np.uint8))
            return cls(kind, f16(blocks[..., 0:2]), f16(blocks[..., 2:4]) if kind == "Q4_1" else None, q, out,
                       inp)
        d, m, q = block_parts(kind, blocks)  # [out, in / 32, 2], [out, in / 32, 2], [out, in / 32, 32]
        return cls("QX", paddle.to_tensor(d), paddle.to_tensor(m), paddle.to_tensor(q), out, inp)

    def nbytes(self) -> int:
        return sum(int(t.numel()) * t.element_size() for t in (self.d, self.m, self.q) if t is not None)

    def dense(self, dtype: str = "float32") -> paddle.Tensor:
        """The weight [in, out] in `dtype`: gguf.quants' float32 values (d * q, d * q + m), widened."""
        if self.kind in ("Q4_0", "Q4_1"):
            low = paddle.bitwise_and(self.q, paddle.full([1], 15, "uint8"))
            high = paddle.bitwise_right_shift(self.q, paddle.full([1], 4, "uint8"))
            q = paddle.concat([low, high], axis=-1).astype("float32")  # [out, kb, 32]
            if self.kind == "Q4_0":
                q = q - 8.0
        else:
            q = self.q.astype("float32")
        if self.kind == "QX":
            shape = [self.out, -1, 2, 16]  # per half block of 16 inputs
            w = q.reshape(shape) * self.d.unsqueeze(-1) + self.m.unsqueeze(-1)
        else:
            w = q * self.d.astype("float32")
            if self.m is not None:
                w = w + self.m.astype("float32")
        w = w.reshape([self.out, self.inp]).t()
        return w if dtype == "float32" else w.astype(dtype)
