"""Causal attention of packed variable-length blocks over each slot's cached keys, in Paddle's operators (the
reference backend: any device Paddle runs on).

A block's queries see its slot's positions up to their own. With a shared prefix (cascade attention) a slot
with prefix length p reads positions < p from the prefix's one-slot cache and stores its own position j at
row j - p; one softmax runs over both parts, as over a private copy of the prefix. Short blocks (decode,
verify) share one padded computation ("virtual padding"); long ones (prefill) are grouped by length so that
padding a 30-token prompt to a 1,000-token one does not cost 30x.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import paddle
import paddle.nn.functional as F

from specgen.layers.rotary import RopeTables
from specgen.runtime.batch import ForwardBatch
from specgen.runtime.kv_cache import KVCache

GROUP_THRESHOLD = 16  # blocks longer than this are grouped apart from the short ones
GROUP_BUDGET = 1 << 19  # a long-block group's padded num_seqs * max_q * max_kv at most


@dataclass(frozen=True)
class AttnGroup:
    """Query blocks of similar length that share one padded attention computation."""

    seq_index: np.ndarray  # [num_seqs_g] int64 index of each block in the batch
    pad_token_index: np.ndarray  # [num_seqs_g, max_q] int64 packed-token index, or num_tokens for padding
    pad_positions: np.ndarray  # [num_seqs_g, max_q] int64 position of each padded query (0 for padding)
    max_kv: int  # keys attended: positions [0, max_kv) of each block's slot
    token_rows: np.ndarray  # [num_tokens_g] int64 packed-token indices of this group's tokens, in order
    token_pad_index: np.ndarray  # [num_tokens_g] int64 flat index into [num_seqs_g * max_q] of each token


def attention_groups(starts: np.ndarray, lens: np.ndarray, threshold: int = GROUP_THRESHOLD,
                     budget: int = GROUP_BUDGET) -> tuple[AttnGroup, ...]:
    """Blocks (first positions starts [num_seqs], lengths lens [num_seqs] >= 1) into groups: the short ones in
    one, the long ones sorted by length and split so that each group's padded size stays within `budget`."""
    cu = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=cu[1:])
    num_tokens = int(cu[-1])
    is_long = lens > threshold
    members = [np.nonzero(~is_long)[0]] if (~is_long).any() else []
    long_seqs = np.nonzero(is_long)[0]
    long_seqs = long_seqs[np.argsort(lens[long_seqs], kind="stable")]
    start = 0
    while start < len(long_seqs):
        end = start + 1
        while end < len(long_seqs):
            q = lens[long_seqs[end]]
            if (end - start + 1) * q * (starts[long_seqs[start:end + 1]] + q).max() > budget:
                break
            end += 1
        members.append(long_seqs[start:end])
        start = end
    groups = []
    for seqs in members:
        max_q = int(lens[seqs].max())
        col = np.arange(max_q)
        valid = col[None, :] < lens[seqs][:, None]  # [num_seqs_g, max_q]
        pad_index = np.where(valid, cu[seqs][:, None] + col[None, :], num_tokens)
        groups.append(AttnGroup(
            seq_index=seqs.astype(np.int64),
            pad_token_index=pad_index.astype(np.int64),
            pad_positions=np.where(valid, starts[seqs][:, None] + col[None, :], 0).astype(np.int64),
            max_kv=int((starts[seqs] + lens[seqs]).max()),
            token_rows=pad_index[valid].astype(np.int64),
            token_pad_index=np.nonzero(valid.reshape(-1))[0].astype(np.int64),
        ))
    return tuple(groups)


class _GroupIndex:
    """Device-side gather indices of one attention group, built once per forward and used by every block.

    Every reordering is one gather (no transposes): queries into [num_seqs, kv_heads, group * max_q, D],
    keys/values from the cache into [num_seqs, kv_heads, max_kv, D], and the output back to packed tokens.
    """

    def __init__(self, g: AttnGroup, slots: np.ndarray, prefix_lens: np.ndarray, cache: KVCache,
                 num_heads: int, dtype: str, tree_mask: np.ndarray | None = None):
        S, Q = g.pad_token_index.shape
        KV, G, cap = cache.num_kv_heads, num_heads // cache.num_kv_heads, cache.capacity
        shared = bool(prefix_lens.any())
        # When the group is every slot in cache order, attend over the cache tensor itself (a free view):
        # reading a few stale positions past max_kv costs less than gathering the keys into a copy.
        self.direct = not shared and S == cache.num_slots and bool((slots == np.arange(S)).all()) \
            and cap <= 2 * g.max_kv
        L = cap if self.direct else g.max_kv
        self.shape = (S, KV, G, Q, L)
        valid = np.zeros(S * Q, bool)
        valid[g.token_pad_index] = True
        # padding queries read token 0; dropped later
        tok = np.where(valid.reshape(S, Q), g.pad_token_index, 0)
        head = (np.arange(KV)[:, None] * G + np.arange(G)[None, :])  # [KV, G]
        q_rows = tok[:, None, None, :] * num_heads + head[None, :, :, None]  # [S, KV, G, Q]
        self.q_rows = paddle.to_tensor(q_rows.reshape(-1))
        self.kv_rows = self.prefix_rows = self.from_prefix = None
        if not self.direct:
            pos = np.arange(L)[None, None, :]  # [1, 1, L]
            p = prefix_lens[:, None, None]  # [S, 1, 1]
            # a slot's own rows past its capacity are never allowed (masked), but must be read within it
            own = ((slots[:, None, None] * KV + np.arange(KV)[None, :, None]) * cap
                   + np.clip(pos - p, 0, cap - 1))
            self.kv_rows = paddle.to_tensor(own.reshape(-1))  # [S * KV * L]
            if shared:
                pcap = cache.prefix.capacity
                pre = np.arange(KV)[None, :, None] * pcap + np.minimum(pos, pcap - 1)  # [1, KV, L]
                self.prefix_rows = paddle.to_tensor(np.broadcast_to(pre, (S, KV, L)).reshape(-1))
                self.from_prefix = paddle.to_tensor(np.broadcast_to(pos < p, (S, KV, L)).reshape(-1, 1))
        allowed = np.arange(L)[None, None, :] <= g.pad_positions[:, :, None]  # [S, Q, L]
        # a token tree's node sees the rows of its ancestors only (bit b: b rows back)
        if tree_mask is not None:
            masks = np.append(tree_mask, -1).view(np.uint64)[g.pad_token_index]  # [S, Q] (padding: all bits)
            back = g.pad_positions[:, :, None] - np.arange(L)[None, None, :]  # [S, Q, L]
            bit = (masks[:, :, None] >> np.clip(back, 0, 63).astype(np.uint64)) & np.uint64(1)
            allowed &= (back >= 64) | (bit == 1)
        neg = np.finfo(np.float32).min if dtype == "float32" else np.finfo(np.float64).min
        bias = np.where(allowed, 0.0, neg).astype(dtype)[:, None, None]  # [S, 1, 1, Q, L]
        if S * num_heads * Q * L <= (1 << 24):
            # Paddle's broadcasting add is ~30x slower than a same-shape add on CPU:
            # materialise once per forward.
            bias = np.broadcast_to(bias, (S, KV, G, Q, L))
        self.bias = paddle.to_tensor(np.ascontiguousarray(bias))
        # head h = kv * G + g of token (s, q) sits at row
        # ((s * KV + kv) * G + g) * Q + q = (s * H + h) * Q + q
        s_of, q_of = np.divmod(g.token_pad_index, Q)  # [num_tokens_g]
        out_rows = (s_of[:, None] * num_heads + np.arange(num_heads)[None, :]) * Q + q_of[:, None]  # [n_g, H]
        self.out_rows = paddle.to_tensor(out_rows.reshape(-1))
        self.num_tokens = len(g.token_rows)
        self.token_rows = paddle.to_tensor(g.token_rows)  # [num_tokens_g]

    def _keys(self, cache: paddle.Tensor, prefix: paddle.Tensor | None, D: int) -> paddle.Tensor:
        S, KV, _, _, L = self.shape
        if self.direct:
            return cache.reshape([S, KV, L, D])
        own = paddle.gather(cache, self.kv_rows)  # [S * KV * L, D]
        if self.prefix_rows is not None:
            own = paddle.where(self.from_prefix, paddle.gather(prefix, self.prefix_rows), own)
        return own.reshape([S, KV, L, D])

    def attend(self, q, k_cache, v_cache, prefix_k, prefix_v, D: int) -> paddle.Tensor:
        """q [num_tokens * H, D] already scaled by 1 / sqrt(D) -> [num_tokens_g, H * D]."""
        S, KV, G, Q, L = self.shape
        qp = paddle.gather(q, self.q_rows).reshape([S, KV, G * Q, D])
        kp, vp = self._keys(k_cache, prefix_k, D), self._keys(v_cache, prefix_v, D)
        scores = paddle.matmul(qp, kp, transpose_y=True).reshape([S, KV, G, Q, L]) + self.bias
        probs = F.softmax(scores, axis=-1).reshape([S, KV, G * Q, L])
        out = paddle.matmul(probs, vp).reshape([S * KV * G * Q, D])
        return paddle.gather(out, self.out_rows).reshape([self.num_tokens, KV * G * D])


class AttentionIndex:
    """One forward's device indices, shared by every block: RoPE rows, cache rows, attention groups."""

    def __init__(self, batch: ForwardBatch, cache: KVCache, rope: RopeTables, num_heads: int, dtype: str):
        n = len(batch.token_ids)
        KV = cache.num_kv_heads
        self.num_tokens, self.num_heads, self.dtype = n, num_heads, dtype
        pos = paddle.to_tensor(batch.model_positions)  # [num_tokens] (a tree node: its root's + its depth)
        self.cos = paddle.gather(rope.cos, pos).unsqueeze(1)  # [num_tokens, 1, head_dim / 2]
        self.sin = paddle.gather(rope.sin, pos).unsqueeze(1)
        plen = batch.token_prefix_len if batch.token_prefix_len is not None else np.zeros(n, np.int64)
        rows = ((batch.token_slots[:, None] * KV + np.arange(KV)[None, :]) * cache.capacity
                + (batch.positions - plen)[:, None])  # [num_tokens, num_kv_heads]: own rows past the prefix
        self.cache_rows = paddle.to_tensor(rows.reshape(-1))  # [num_tokens * num_kv_heads]
        cu = np.concatenate([[0], np.cumsum(batch.block_lens)[:-1]]).astype(np.int64)
        seq_prefix = plen[cu] if n else np.zeros(0, np.int64)  # [num_seqs]
        groups = attention_groups(batch.block_starts, batch.block_lens, GROUP_THRESHOLD, GROUP_BUDGET)
        self.groups = [_GroupIndex(g, batch.block_slots[g.seq_index], seq_prefix[g.seq_index], cache,
                                   num_heads, dtype, batch.tree_mask) for g in groups]
        self.single = len(groups) == 1 and np.array_equal(groups[0].token_rows, np.arange(n))
        self.prefix = cache.prefix

    def attend(self, q, k, v, layer: int, k_cache, v_cache) -> paddle.Tensor:
        """Write k, v [num_tokens, KV, D] into the block's cache rows, then attention of q [num_tokens, H, D]
        (rotated) over each slot's keys: [num_tokens, H * D]."""
        n, H, D = self.num_tokens, self.num_heads, q.shape[-1]
        KV = k.shape[1]
        paddle.scatter_(k_cache, self.cache_rows, k.reshape([n * KV, D]), overwrite=True)
        paddle.scatter_(v_cache, self.cache_rows, v.reshape([n * KV, D]), overwrite=True)
        q = q.reshape([n * H, D]) * (1.0 / math.sqrt(D))
        pk = self.prefix.k[layer] if self.prefix is not None else None
        pv = self.prefix.v[layer] if self.prefix is not None else None
        parts = [g.attend(q, k_cache, v_cache, pk, pv, D) for g in self.groups]
        if self.single:
            return parts[0]
        out = paddle.zeros([n, H * D], dtype=self.dtype)
        for g, part in zip(self.groups, parts):
            out = paddle.scatter(out, g.token_rows, part, overwrite=True)
        return out
