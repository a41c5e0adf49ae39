"""The trainable MTP head: the engine's MtpHead math in Paddle with autograd, and its DeepSeek-V3 export.

Parameters use the engine's layout (Paddle [in, out], fused QKV and gate/up, RoPE in halves), so that the
training forward runs the same operations as `MtpProposer` (tests/unit/test_mtp_train.py holds them equal).
The embedding, the RoPE tables and the LM head are the main model's, frozen.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import paddle
import paddle.nn.functional as F

from specgen.drafters.mtp import random_mtp_weights
from specgen.errors import ConfigError
from specgen.layers.attention import AttentionIndex
from specgen.layers.block import DecoderBlock, block_forward
from specgen.layers.linear import Linear
from specgen.layers.norm import rms_norm
from specgen.models.model import Model
from specgen.models.weights import TensorReader
from specgen.runtime.kv_cache import KVCache

BLOCK_KEYS = ("attn_norm", "mlp_norm", "w_qkv", "b_qkv", "w_o", "b_o", "w_gate_up", "b_gate_up", "w_down",
              "b_down", "q_norm", "k_norm")


def residual_rms(model: Model, token_ids: np.ndarray) -> float:
    """Median per-token RMS of the main model's residual stream entering its last layer, over one sequence."""
    from specgen.runtime.batch import build_forward_batch

    n = len(token_ids)
    cfg = model.config
    batch = build_forward_batch(np.array([0]), np.array([0]), np.array([n]), token_ids, np.array([False]))
    cache = KVCache(cfg.num_layers, 1, cfg.num_kv_heads, cfg.head_dim, model.dtype, n, initial_capacity=n)
    att = AttentionIndex(batch, cache, model.rope, cfg.num_heads, model.dtype)
    x = F.embedding(paddle.to_tensor(batch.token_ids), model.weights.embed)  # [n, hidden]
    # the reference layers over dense copies of the weights
    for i, block in enumerate(model.weights.blocks[:-1]):
        dense = dataclasses.replace(block, **{k: Linear(getattr(block, k).dense(), getattr(block, k).bias)
                                              for k in ("qkv", "o", "gate_up", "down")})
        x = block_forward(x, dense, model.shape, att, i, cache.k[i], cache.v[i])
    # the first token is an outlier (attention sink)
    return float(np.median(np.sqrt((x.numpy()[1:] ** 2).mean(-1))))


def block_arrays(b: DecoderBlock) -> dict[str, np.ndarray]:
    """A decoder block's weights as float32 arrays under the training names (BLOCK_KEYS; absent ones left
    out)."""
    named = {"attn_norm": b.attn_norm, "mlp_norm": b.mlp_norm, "q_norm": b.q_norm, "k_norm": b.k_norm}
    for key, lin in (("qkv", b.qkv), ("o", b.o), ("gate_up", b.gate_up), ("down", b.down)):
        named[f"w_{key}"], named[f"b_{key}"] = lin.dense(), lin.bias
    return {k: np.asarray(v.numpy(), np.float32) for k, v in named.items() if v is not None}


def initial_weights(model: Model, init: str, seed: int, scale: float = 1.0) -> dict[str, np.ndarray]:
    """Engine-layout float32 arrays.

    "last-layer": the block is a copy of the main model's last decoder layer; eh_proj passes the hidden half
    through unchanged and starts the embedding half at zero; enorm and hnorm are `scale` (give residual_rms),
    so that the block sees its input at the magnitude of the residual stream it was trained on: the pre-norm
    block adds outputs of that magnitude, which would drown an input of RMS 1 (initial loss ~60 instead of
    ~8). The final norm is the main model's. "random": the layout's random initialisation (std 0.02).
    """
    cfg = model.config
    h = cfg.hidden_size
    if init == "last-layer":
        block = block_arrays(model.weights.blocks[-1])
        eh = np.concatenate([np.zeros((h, h), np.float32), np.eye(h, dtype=np.float32)])  # [2 hidden, hidden]
    else:
        r = TensorReader(random_mtp_weights(cfg, seed), "random", cfg, "float32")
        block = block_arrays(r.block(f"model.layers.{cfg.num_layers}."))
        eh = np.random.default_rng(seed + 1).standard_normal((2 * h, h)).astype(np.float32) * 0.02
    norm = np.full(h, scale if init == "last-layer" else 1.0, np.float32)
    return {"enorm": norm, "hnorm": norm.copy(), "eh_proj": eh, **block,
            "final_norm": model.weights.final_norm.numpy().astype(np.float32)}


class TrainableBlock(paddle.nn.Layer):
    """A decoder block (parameters BLOCK_KEYS, and whatever else `weights` names) over padded windows:
    [batch, seq_len] positions of one sequence each, causal within a window."""

    def __init__(self, model: Model, weights: dict[str, np.ndarray]):
        super().__init__()
        if model.dtype != "float32":
            raise ConfigError("training runs the main model in float32")
        cfg = self.cfg = model.config
        self.eps, self.scale = cfg.rms_norm_eps, 1.0 / math.sqrt(cfg.head_dim)
        # frozen: [vocab, hidden], [max_len, D/2]
        self.embed, self.cos, self.sin = model.weights.embed, model.rope.cos, model.rope.sin
        for name, w in weights.items():
            p = self.create_parameter(list(w.shape), dtype="float32",
                                      default_initializer=paddle.nn.initializer.Assign(np.ascontiguousarray(w)))
            self.add_parameter(name, p)

    def _p(self, name: str) -> paddle.Tensor | None:
        return self._parameters.get(name)

    def block(self, x: paddle.Tensor, positions: paddle.Tensor):
        """x [batch, seq_len, hidden] -> (the block's output, its keys and values)."""
        q, k, v = self._qkv(x, positions)
        L = x.shape[1]
        mask = paddle.to_tensor(np.triu(np.full((L, L), -np.inf, np.float32), 1))  # [L, L] key j <= query i
        probs = F.softmax(paddle.matmul(q, k, transpose_y=True) + mask, axis=-1)  # [B, H, L, L]
        return self._finish(x, paddle.matmul(probs, v)), (k, v)

    def _qkv(self, x: paddle.Tensor, positions: paddle.Tensor):
        """q [batch, heads, seq_len, D] scaled, k/v [batch, heads, seq_len, D] (kv heads repeated for GQA)."""
        cfg = self.cfg
        B, L = x.shape[0], x.shape[1]
        H, KV, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv = paddle.matmul(self.attn_input(x), self.w_qkv)  # [B, L, (H + 2 KV) D]
        if self._p("b_qkv") is not None:
            qkv = qkv + self.b_qkv
        q, k, v = paddle.split(qkv, [H * D, KV * D, KV * D], axis=-1)
        q, k, v = q.reshape([B, L, H, D]), k.reshape([B, L, KV, D]), v.reshape([B, L, KV, D])
        if self._p("q_norm") is not None:
            q, k = rms_norm(q, self.q_norm, self.eps), rms_norm(k, self.k_norm, self.eps)
        cos = paddle.gather(self.cos, positions.reshape([-1])).reshape([B, L, 1, D // 2])
        sin = paddle.gather(self.sin, positions.reshape([-1])).reshape([B, L, 1, D // 2])
        q, k = _rope(q, cos, sin) * self.scale, _rope(k, cos, sin)
        # head h reads kv head h // (H / KV), as in the engine
        k, v = (paddle.repeat_interleave(t, H // KV, axis=2) for t in (k, v))
        return (t.transpose([0, 2, 1, 3]) for t in (q, k, v))

    def attn_input(self, x: paddle.Tensor) -> paddle.Tensor:
        """What the attention's projections read of the block input x: its norm."""
        return rms_norm(x, self.attn_norm, self.eps)

    def residual(self, x: paddle.Tensor) -> paddle.Tensor:
        """The residual stream the block adds to: the block input x itself."""
        return x

    def _finish(self, x: paddle.Tensor, attn: paddle.Tensor) -> paddle.Tensor:
        """Output projection, residual, MLP: attn [batch, heads, seq_len, D] -> [batch, seq_len, hidden]."""
        B, H, L, D = attn.shape
        o = paddle.matmul(attn.transpose([0, 2, 1, 3]).reshape([B, L, H * D]), self.w_o)
        if self._p("b_o") is not None:
            o = o + self.b_o
        x = self.residual(x) + o
        gu = paddle.matmul(rms_norm(x, self.mlp_norm, self.eps), self.w_gate_up)  # [B, L, 2 intermediate]
        if self._p("b_gate_up") is not None:
            gu = gu + self.b_gate_up
        gate, up = paddle.split(gu, 2, axis=-1)
        m = paddle.matmul(F.silu(gate) * up, self.w_down)
        if self._p("b_down") is not None:
            m = m + self.b_down
        return x + m



class TrainableHead(TrainableBlock):
    """MTP head over padded windows: [batch, seq_len] positions of one sequence each, causal within a
    window."""

    def forward(self, hidden: paddle.Tensor, next_ids: paddle.Tensor, positions: paddle.Tensor):
        """First draft: returns (block output [batch, seq_len, hidden], its keys and values for the chain)."""
        return self.block(self.block_input(hidden, next_ids), positions)

    def block_input(self, hidden: paddle.Tensor, token_ids: paddle.Tensor) -> paddle.Tensor:
        """[batch, seq_len, hidden]: eh_proj([RMSNorm(emb(token i + 1)); RMSNorm(hidden at i)])."""
        emb = F.embedding(token_ids, self.embed)  # [batch, seq_len, hidden]
        both = paddle.concat([rms_norm(emb, self.enorm, self.eps), rms_norm(hidden, self.hnorm, self.eps)],
                             axis=-1)
        return paddle.matmul(both, self.eh_proj)

    def chain(self, x1: paddle.Tensor, kv1, after_ids: paddle.Tensor,
              positions: paddle.Tensor) -> paddle.Tensor:
        """Second draft, as the engine chains it: at each position i the head's own output x1[i] and
        token i + 2 make a query at position i + 1 that sees the first pass's keys of positions <= i and its
        own key."""
        x = self.block_input(x1, after_ids)
        q, k, v = self._qkv(x, positions + 1)
        k1, v1 = kv1
        L = x.shape[1]
        mask = paddle.to_tensor(np.triu(np.full((L, L), -np.inf, np.float32), 1))
        scores = paddle.concat([paddle.matmul(q, k1, transpose_y=True) + mask,
                                paddle.sum(q * k, axis=-1, keepdim=True)], axis=-1)  # [B, H, L, L + 1]
        probs = F.softmax(scores, axis=-1)
        attn = paddle.matmul(probs[..., :L], v1) + probs[..., L:] * v
        return self._finish(x, attn)

    def logits(self, x: paddle.Tensor, rows: paddle.Tensor, lm_head: paddle.Tensor) -> paddle.Tensor:
        return row_logits(x, rows, self.final_norm, self.eps, lm_head)


def row_logits(x: paddle.Tensor, rows: paddle.Tensor, norm: paddle.Tensor, eps: float,
               lm_head: paddle.Tensor) -> paddle.Tensor:
    """[num_rows, vocab'] logits of flat rows `rows` of x [batch, seq_len, hidden] through the final norm and
    lm_head [hidden, vocab']."""
    flat = paddle.gather(x.reshape([-1, x.shape[-1]]), rows)
    return paddle.matmul(rms_norm(flat, norm, eps), lm_head)


def _rope(x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor) -> paddle.Tensor:
    """Rotate-half RoPE, the engine's formula: x [B, L, heads, D], cos/sin [B, L, 1, D/2]."""
    x1, x2 = paddle.split(x, 2, axis=-1)
    return paddle.concat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _half_to_interleaved(w: np.ndarray, num_heads: int, head_dim: int) -> np.ndarray:
    """Inverse of the engine's _interleaved_to_half row permutation."""
    order = np.concatenate([np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)])
    shaped = w.reshape(num_heads, head_dim, *w.shape[1:])
    return shaped[:, np.argsort(order)].reshape(w.shape)


def export_weights(head: TrainableHead, dtype: str = "float32", index: int = 0) -> dict[str, np.ndarray]:
    """The head (module `index` of a multi-layer one) in the DeepSeek-V3 layout under
    `model.layers.{num_layers + index}.` (HF [out, in] weights); the embedding and LM head are not written:
    the engine shares the main model's."""
    w = {name: p.numpy() for name, p in head.named_parameters()}
    out = {"enorm.weight": w["enorm"], "hnorm.weight": w["hnorm"], "eh_proj.weight": w["eh_proj"].T,
           "shared_head.norm.weight": w["final_norm"], **block_to_hf(w, head.cfg)}
    p = f"model.layers.{head.cfg.num_layers + index}."
    return {p + n: np.ascontiguousarray(a.astype(dtype)) for n, a in out.items()}


def block_to_hf(w: dict[str, np.ndarray], cfg) -> dict[str, np.ndarray]:
    """A block's training arrays (BLOCK_KEYS, engine layout) -> its HF weights, named below the layer
    prefix."""
    H, KV, D, inter = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    q, k, v = np.split(w["w_qkv"].T, [H * D, (H + KV) * D])
    qkv_b = np.split(w["b_qkv"], [H * D, (H + KV) * D]) if "b_qkv" in w else None
    if cfg.rope_interleaved:
        q, k = _half_to_interleaved(q, H, D), _half_to_interleaved(k, KV, D)
        if qkv_b is not None:
            qkv_b[0], qkv_b[1] = _half_to_interleaved(qkv_b[0], H, D), _half_to_interleaved(qkv_b[1], KV, D)
    gate, up = np.split(w["w_gate_up"].T, [inter])
    out = {"input_layernorm.weight": w["attn_norm"],
           "post_attention_layernorm.weight": w["mlp_norm"], "self_attn.q_proj.weight": q,
           "self_attn.k_proj.weight": k, "self_attn.v_proj.weight": v, "self_attn.o_proj.weight": w["w_o"].T,
           "mlp.gate_proj.weight": gate, "mlp.up_proj.weight": up, "mlp.down_proj.weight": w["w_down"].T}
    if qkv_b is not None:
        out.update({f"self_attn.{n}_proj.bias": b for n, b in zip("qkv", qkv_b)})
    if "b_o" in w:
        out["self_attn.o_proj.bias"] = w["b_o"]
    if "b_gate_up" in w:
        out["mlp.gate_proj.bias"], out["mlp.up_proj.bias"] = np.split(w["b_gate_up"], [inter])
        out["mlp.down_proj.bias"] = w["b_down"]
    if "q_norm" in w:
        out["self_attn.q_norm.weight"], out["self_attn.k_norm.weight"] = w["q_norm"], w["k_norm"]
    return out
