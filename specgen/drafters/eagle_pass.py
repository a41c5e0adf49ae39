"""The reference passes of EAGLE-style layers (Paddle's operators: any backend, any device): EaglePass runs
an EAGLE-1/2 layer (drafters/eagle.py), Eagle3Pass an EAGLE-3 one (drafters/eagle3.py). Both batch the blocks,
embed the tokens and take the top-k of the LM head alike; they differ in the layer (layer()) and what the LM
head reads (head_input()).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import paddle
import paddle.nn.functional as F

from specgen.backends.base import ModelView
from specgen.backends.reference import reserve
from specgen.layers.attention import AttentionIndex
from specgen.layers.block import attention, block_forward, mlp_forward
from specgen.layers.linear import Linear
from specgen.layers.norm import rms_norm
from specgen.runtime.batch import build_forward_batch
from specgen.runtime.kv_cache import KVCache


class EaglePass:
    """One pass of an EAGLE layer (EagleWeights, engine/proposers/eagle.py) over packed blocks of tokens, in
    Paddle's operators (any backend, any device)."""

    def __init__(self, model: ModelView, weights: Any):
        self.rope, self.shape, self.dtype, self.w = model.rope, model.shape, model.dtype, weights
        lm = weights.lm_head.dense()  # [hidden, vocab]
        if weights.draft_vocab is not None:  # drafts from these tokens only: their columns
            lm = paddle.gather(lm, paddle.to_tensor(weights.draft_vocab), axis=1)
        self.lm_head = Linear(lm)  # [hidden] -> [draft vocab]
        self.token_ids = weights.token_ids
        cfg = model.config
        self.cache_shape = (cfg.num_kv_heads, cfg.head_dim, model.max_len)

    def new_cache(self, num_slots: int) -> KVCache:
        kv, d, max_len = self.cache_shape
        return KVCache(1, num_slots, kv, d, self.dtype, max_len, zeroed=True)  # masked reads need finite rows

    def run(self, cache: KVCache, slots: np.ndarray, starts: np.ndarray, lens: np.ndarray,
            token_ids: np.ndarray, hidden: paddle.Tensor, rows: np.ndarray, logit_rows: np.ndarray,
            topk: int, rope: np.ndarray | None = None, mask: np.ndarray | None = None):
        """Blocks (slots [num_seqs], rows starts [num_seqs], lens [num_seqs]) of tokens token_ids [num_tokens]
        with their input features at rows [num_tokens] of hidden [num_rows, hidden]; rope [num_tokens] the
        positions RoPE sees and mask [num_tokens] int64 each token's tree mask (None: rows are positions,
        causal). Returns (output features [num_tokens, hidden], top-k log-probabilities [num_logits, topk] and
        token ids [num_logits, topk] at logit_rows [num_logits])."""
        depth = None if rope is None else rope - np.repeat(starts, lens)
        batch = build_forward_batch(slots, starts, lens, token_ids, np.zeros(len(slots), bool),
                                    tree_depth=depth, tree_mask=mask)
        reserve(batch, cache)
        emb = F.embedding(paddle.to_tensor(batch.token_ids), self.w.embed)  # [num_tokens, hidden]
        att = AttentionIndex(batch, cache, self.rope, self.shape.num_heads, self.dtype)
        # [num_tokens, hidden]
        feat = self.layer(emb, paddle.gather(hidden, paddle.to_tensor(rows)), att, cache)
        if not len(logit_rows):
            return feat, np.zeros((0, topk)), np.zeros((0, topk), np.int64)
        logp = F.log_softmax(self.lm_head(self.head_input(paddle.gather(feat, paddle.to_tensor(logit_rows)))),
                             axis=-1)
        vals, cols = paddle.topk(logp, topk, axis=-1)  # [num_logits, topk], largest first
        return feat, vals.numpy().astype(np.float64), self.token_ids(cols.numpy().astype(np.int64))

    def layer(self, emb: paddle.Tensor, h: paddle.Tensor, att: AttentionIndex,
              cache: KVCache) -> paddle.Tensor:
        """The layer over embeddings emb [num_tokens, hidden] and input features h [num_tokens, hidden]: its
        output features (the next depth's input, and the LM head's through head_input)."""
        w = self.w
        x = block_forward(w.fc(paddle.concat([emb, h], axis=-1)), w.block, self.shape, att, 0, cache.k[0],
                          cache.v[0])
        return rms_norm(x, w.norm, self.shape.eps) if w.norm is not None else x

    def head_input(self, feat: paddle.Tensor) -> paddle.Tensor:
        return feat


class Eagle3Pass(EaglePass):
    """One pass of an EAGLE-3 layer (Eagle3Weights), in Paddle's operators (any
    backend, any device). run() as EaglePass.run, but the input features at `rows` are either the main
    model's (C hidden wide: folded by fc) or the layer's own outputs at a tree node's parent (hidden wide),
    and the output features are the layer's outputs before its norm."""

    def __init__(self, model: ModelView, weights: Any):
        self.rope, self.shape, self.dtype, self.w = model.rope, model.shape, model.dtype, weights
        self.lm_head = weights.lm_head  # [hidden] -> [draft vocab], its own
        self.token_ids = weights.token_ids
        self.features = weights.features
        cfg = model.config
        self.hidden_size = cfg.hidden_size
        self.cache_shape = (cfg.num_kv_heads, cfg.head_dim, model.max_len)

    def layer(self, emb: paddle.Tensor, h: paddle.Tensor, att: AttentionIndex,
              cache: KVCache) -> paddle.Tensor:
        w, eps = self.w, self.shape.eps
        if h.shape[1] != self.hidden_size:  # [num_tokens, C hidden] the main model's features
            h = w.fc(h)
        inp = paddle.concat([rms_norm(emb, w.input_norm, eps), rms_norm(h, w.hidden_norm, eps)], axis=-1)
        x = h + attention(inp, w.block, self.shape, att, 0, cache.k[0], cache.v[0])
        return x + mlp_forward(rms_norm(x, w.block.mlp_norm, eps), w.block)

    def head_input(self, feat: paddle.Tensor) -> paddle.Tensor:
        return rms_norm(feat, self.w.norm, self.shape.eps)
