"""The pre-norm decoder block (Llama family): its typed weights and its reference forward."""
from __future__ import annotations

from dataclasses import dataclass

import paddle
import paddle.nn.functional as F

from specgen.layers.attention import AttentionIndex
from specgen.layers.linear import Linear
from specgen.layers.norm import rms_norm
from specgen.layers.rotary import rotate

LINEAR_FIELDS = ("qkv", "o", "gate_up", "down")  # a block's projections (Linear)


@dataclass
class DecoderBlock:
    """One block's weights: QKV and gate/up fused at load, projections in Paddle's [in, out]."""

    attn_norm: paddle.Tensor  # [hidden]
    qkv: Linear  # [hidden] -> [(H + 2 KV) D], q and k rows in rotate-half order
    o: Linear  # [H D] -> [hidden]
    mlp_norm: paddle.Tensor  # [hidden]
    gate_up: Linear  # [hidden] -> [2 inter]: gate, then up
    down: Linear  # [inter] -> [hidden]
    q_norm: paddle.Tensor | None = None  # [head_dim] (Qwen3: RMSNorm on each head of q and k before RoPE)
    k_norm: paddle.Tensor | None = None

    def linears(self) -> list[Linear]:
        return [getattr(self, name) for name in LINEAR_FIELDS]


@dataclass(frozen=True)
class BlockShape:
    """The head layout a block runs with."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float


def block_forward(x: paddle.Tensor, w: DecoderBlock, shape: BlockShape, att: AttentionIndex, layer: int,
                  k_cache: paddle.Tensor, v_cache: paddle.Tensor) -> paddle.Tensor:
    """x [num_tokens, hidden] -> the block's output; writes the tokens' K/V into the block's cache."""
    n, H, KV, D, eps = x.shape[0], shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.eps
    qkv = w.qkv(rms_norm(x, w.attn_norm, eps))  # [num_tokens, (H + 2 KV) D]
    q, k, v = paddle.split(qkv, [H * D, KV * D, KV * D], axis=-1)
    q, k, v = q.reshape([n, H, D]), k.reshape([n, KV, D]), v.reshape([n, KV, D])
    if w.q_norm is not None:
        q, k = rms_norm(q, w.q_norm, eps), rms_norm(k, w.k_norm, eps)
    q, k = rotate(q, att.cos, att.sin), rotate(k, att.cos, att.sin)
    x = x + w.o(att.attend(q, k, v, layer, k_cache, v_cache))
    gate, up = paddle.split(w.gate_up(rms_norm(x, w.mlp_norm, eps)), 2, axis=-1)
    return x + w.down(F.silu(gate) * up)
