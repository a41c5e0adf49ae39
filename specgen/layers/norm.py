"""RMSNorm (HF's LlamaRMSNorm)."""
from __future__ import annotations

import paddle


def rms_norm(x: paddle.Tensor, w: paddle.Tensor, eps: float) -> paddle.Tensor:
    """x / sqrt(mean(x^2) + eps) * w over the last axis."""
    var = paddle.mean(x * x, axis=-1, keepdim=True)
    return x * paddle.rsqrt(var + eps) * w
