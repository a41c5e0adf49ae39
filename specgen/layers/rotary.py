"""Rotary position embedding: the tables (with Llama-3 frequency scaling) and rotate-half application."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import paddle

from specgen.models.config import ModelConfig


def inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies [head_dim / 2], with Llama-3 scaling when configured (as transformers does)."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    rs = cfg.rope_scaling
    if rs is None:
        return inv
    low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / rs.factor, inv)
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled)


@dataclass(frozen=True)
class RopeTables:
    """cos and sin of every position's angles, [max_len, head_dim / 2] in the model's dtype."""

    cos: paddle.Tensor
    sin: paddle.Tensor

    @classmethod
    def build(cls, cfg: ModelConfig, dtype: str) -> "RopeTables":
        # HF computes the angles in float32; matching that keeps fp32 logits within 1e-6 of theirs.
        ang_dtype = np.float32 if dtype == "float32" else np.float64
        ang = (np.arange(cfg.max_position_embeddings, dtype=ang_dtype)[:, None]
               * inv_freq(cfg).astype(ang_dtype)[None])
        return cls(paddle.to_tensor(np.cos(ang).astype(dtype)), paddle.to_tensor(np.sin(ang).astype(dtype)))


def rotate(x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor) -> paddle.Tensor:
    """Rotate-half RoPE: x [num_tokens, heads, head_dim]; cos / sin [num_tokens, 1, head_dim / 2]."""
    x1, x2 = paddle.split(x, 2, axis=-1)
    return paddle.concat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
