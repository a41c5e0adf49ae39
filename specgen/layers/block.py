"""The pre-norm decoder block (Llama family): its typed weights and its reference forward."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import paddle
import paddle.nn.functional as F

from specgen.layers.attention import AttentionIndex
from specgen.layers.linear import Linear
from specgen.layers.moe import MoeExperts, moe_forward
from specgen.layers.norm import rms_norm
from specgen.layers.rotary import rotate

LINEAR_FIELDS = ("qkv", "o", "gate_up", "down")  # a block's projections (Linear)


@dataclass
class DecoderBlock:
    """One block's weights: QKV and gate/up fused at load, projections in Paddle's [in, out]. A routed block
    (mixture of experts) has `moe`, and gate_up / down only for its shared experts (None without)."""

    attn_norm: paddle.Tensor | None  # [hidden]; None: no input norm (an EAGLE-1 draft layer)
    qkv: Linear  # [hidden] -> [(H + 2 KV) D], q and k rows in rotate-half order
    o: Linear  # [H D] -> [hidden]
    mlp_norm: paddle.Tensor  # [hidden]
    gate_up: Linear | None  # [hidden] -> [2 inter]: gate, then up (the dense MLP, or the shared experts)
    down: Linear | None  # [inter] -> [hidden]
    q_norm: paddle.Tensor | None = None  # [head_dim] (Qwen3: RMSNorm on each head of q and k before RoPE)
    k_norm: paddle.Tensor | None = None
    moe: MoeExperts | None = None  # the routed experts

    def linears(self) -> list[Linear]:
        own = [getattr(self, name) for name in LINEAR_FIELDS if getattr(self, name) is not None]
        return own + (self.moe.linears() if self.moe is not None else [])


@dataclass(frozen=True)
class BlockShape:
    """The head layout a block runs with."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float


def block_forward(x: paddle.Tensor, w: DecoderBlock, shape: BlockShape, att: AttentionIndex, layer: int,
                  k_cache: paddle.Tensor, v_cache: paddle.Tensor, counts: np.ndarray | None = None,
                  reduce: Callable[[paddle.Tensor, str], paddle.Tensor] | None = None) -> paddle.Tensor:
    """x [num_tokens, hidden] -> the block's output; writes the tokens' K/V into the block's cache. A routed
    block adds its tokens per expert to counts [num_experts] when given. `reduce`: a tensor-parallel rank's
    sum over the ranks of its row-parallel outputs (o and down hold its rows;
    specgen/distributed/tp_shard.py), told which ("attention" or "mlp": an expert-parallel rank's experts and
    shared-expert columns are summed in the latter)."""
    inp = rms_norm(x, w.attn_norm, shape.eps) if w.attn_norm is not None else x
    attn = attention(inp, w, shape, att, layer, k_cache, v_cache)  # [num_tokens, hidden]
    x = x + (attn if reduce is None else reduce(attn, "attention"))
    mlp = mlp_forward(rms_norm(x, w.mlp_norm, shape.eps), w, counts)
    return x + (mlp if reduce is None else reduce(mlp, "mlp"))


def attention(inp: paddle.Tensor, w: DecoderBlock, shape: BlockShape, att: AttentionIndex, layer: int,
              k_cache: paddle.Tensor, v_cache: paddle.Tensor) -> paddle.Tensor:
    """The block's attention over its (normed) input inp [num_tokens, in] -> o's output [num_tokens, hidden];
    writes the tokens' K/V. (in: the hidden size; an EAGLE-3 layer's 2 hidden.)"""
    n, H, KV, D, eps = inp.shape[0], shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.eps
    qkv = w.qkv(inp)  # [num_tokens, (H + 2 KV) D]
    q, k, v = paddle.split(qkv, [H * D, KV * D, KV * D], axis=-1)
    q, k, v = q.reshape([n, H, D]), k.reshape([n, KV, D]), v.reshape([n, KV, D])
    if w.q_norm is not None:
        q, k = rms_norm(q, w.q_norm, eps), rms_norm(k, w.k_norm, eps)
    q, k = rotate(q, att.cos, att.sin), rotate(k, att.cos, att.sin)
    return w.o(att.attend(q, k, v, layer, k_cache, v_cache))


def mlp_forward(h: paddle.Tensor, w: DecoderBlock, counts: np.ndarray | None = None) -> paddle.Tensor:
    """The block's MLP (routed experts and / or the dense one) over its normed input h [num_tokens,
    hidden]."""
    mlp = moe_forward(h, w.moe, counts) if w.moe is not None else None
    if w.gate_up is not None:
        gate, up = paddle.split(w.gate_up(h), 2, axis=-1)
        dense = w.down(F.silu(gate) * up)
        mlp = dense if mlp is None else mlp + dense
    return mlp
