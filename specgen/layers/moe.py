"""A mixture-of-experts MLP: its typed weights, its router and its reference forward (Paddle's operators, any
device). The math is transformers' Qwen3MoeSparseMoeBlock / Ernie4_5_MoeSparseMoeBlock (see MoeConfig).

Tokens are grouped by expert and each expert multiplies only its own tokens (one product per expert); a
token's output is then the sum of its chosen experts' outputs in the order of their rank, so a row's result is
made from its own inputs alone. The fused kernels (specgen/kernels/moe.cc) do the same in a fixed order, which
keeps a row's bits independent of the batch. The layer holds the experts of a contiguous range of expert ids
[first_expert, first_expert + len(experts)): all of them, or under expert parallelism a rank's own range
(specgen/distributed/tp_shard.py), where tokens routed elsewhere contribute nothing here (another rank adds
them).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import paddle
import paddle.nn.functional as F

from specgen.layers.linear import Linear


@dataclass
class Expert:
    """One routed expert's SwiGLU MLP, gate and up fused at load."""

    gate_up: Linear  # [hidden] -> [2 expert_inter]: gate, then up
    down: Linear  # [expert_inter] -> [hidden]


@dataclass
class MoeExperts:
    """A routed block's router and (local) experts."""

    router: Linear  # [hidden] -> [num_experts]
    experts: list[Expert]  # expert ids first_expert .. first_expert + len - 1
    num_experts: int  # all of them (the router's outputs)
    top_k: int
    norm_topk_prob: bool
    norm_min: float
    selection_bias: paddle.Tensor | None = None  # [num_experts] added to probs to choose, not to weight
    first_expert: int = 0

    def linears(self) -> list[Linear]:
        return [self.router] + [lin for e in self.experts for lin in (e.gate_up, e.down)]


def route(h: paddle.Tensor, m: MoeExperts) -> tuple[paddle.Tensor, paddle.Tensor]:
    """h [num_tokens, hidden] -> (expert ids [num_tokens, top_k] int64 by rank, weights
    [num_tokens, top_k])."""
    probs = F.softmax(m.router(h), axis=-1)  # [num_tokens, num_experts]
    score = probs + m.selection_bias if m.selection_bias is not None else probs
    _, ids = paddle.topk(score, m.top_k, axis=-1)  # [num_tokens, top_k]
    weights = paddle.take_along_axis(probs, ids, axis=-1)
    if m.norm_topk_prob:
        weights = weights / paddle.clip(weights.sum(axis=-1, keepdim=True), min=m.norm_min)
    return ids, weights


def moe_forward(h: paddle.Tensor, m: MoeExperts, counts: np.ndarray | None = None) -> paddle.Tensor:
    """The routed experts' output for normed rows h [num_tokens, hidden] -> [num_tokens, hidden]; adds each
    expert's token count to counts [num_experts] when given."""
    n, k = h.shape[0], m.top_k
    ids, weights = route(h, m)
    # the one host sync of the layer
    flat = ids.reshape([-1]).numpy()  # [num_tokens * top_k] (token, rank) pairs
    if counts is not None:
        counts += np.bincount(flat, minlength=len(counts))
    order = np.argsort(flat, kind="stable")  # pairs grouped by expert, tokens in order within each
    bounds = np.searchsorted(flat[order], np.arange(m.first_expert, m.first_expert + len(m.experts) + 1))
    y = paddle.zeros([n * k, h.shape[1]], dtype=h.dtype)  # [num_tokens * top_k, hidden] one row per pair
    for e, expert in enumerate(m.experts):
        pairs = order[bounds[e]:bounds[e + 1]]
        if not len(pairs):
            continue
        index = paddle.to_tensor(pairs)
        gate, up = paddle.split(expert.gate_up(paddle.gather(h, paddle.to_tensor(pairs // k))), 2, axis=-1)
        y = paddle.scatter(y, index, expert.down(F.silu(gate) * up), overwrite=True)
    return (y.reshape([n, k, -1]) * weights.unsqueeze(-1)).sum(axis=1)
