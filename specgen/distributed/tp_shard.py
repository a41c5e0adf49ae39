"""Tensor-parallel shards of a decoder's weights, cut by hand (Megatron-LM's layout, Shoeybi et al. 2019):
each rank holds some attention heads (q/k/v columns, o rows) and some MLP columns (gate/up columns, down
rows), so a block needs one sum over the ranks after o and one after down; the embedding and the LM head hold
a contiguous range of the vocabulary each. Splits are as even as they go (numpy.array_split): the first ranks
take one more.

With expert parallelism (a mixture-of-experts model) the same ranks also split the routed experts: each holds
a contiguous range of expert ids whole, and the router and shared experts as above (router replicated, shared
experts by columns). Every rank has every token's hidden row after the attention's sum, so each routes all of
them alike and runs its own experts over the tokens routed there (the gather is the sum already made); the one
sum after the MLP then adds every expert's output to its token's row (the scatter back)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import paddle

from specgen.errors import ConfigError
from specgen.layers.block import BlockShape, DecoderBlock
from specgen.layers.linear import Linear
from specgen.models.config import ModelConfig
from specgen.models.weights import DecoderWeights

PAD_HEAD = -1  # a local head that pads a group (local_heads): zero q columns and o rows


@dataclass(frozen=True)
class RankShard:
    """What one rank of `world_size` holds."""

    rank: int
    world_size: int
    heads: np.ndarray  # [local_heads] int64 the global query head of each local head (PAD_HEAD: padding)
    kv_heads: np.ndarray  # [local_kv_heads] int64 the global KV head of each local KV head
    inter: tuple[int, int]  # a dense MLP's columns [lo, hi) (shard_block cuts shared experts' alike)
    vocab: tuple[int, int]  # vocabulary rows [lo, hi) of the embedding and the LM head
    vocab_sizes: tuple[int, ...]  # [world_size] every rank's hi - lo (gathered logits are padded to the
    # ... largest)
    experts: tuple[int, int] = (0, 0)  # routed expert ids [lo, hi) held whole (expert parallelism; else none)

    def shape(self, full: BlockShape) -> BlockShape:
        return dataclasses.replace(full, num_heads=len(self.heads), num_kv_heads=len(self.kv_heads))


def _range(n: int, rank: int, world_size: int) -> tuple[int, int]:
    """[lo, hi) of rank's part of n items, as numpy.array_split cuts them."""
    base, extra = divmod(n, world_size)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (rank < extra)


def local_heads(heads: np.ndarray, num_heads: int, num_kv_heads: int) -> tuple[np.ndarray, np.ndarray]:
    """A rank's attention layout for its query `heads`: (the global head of each local head, PAD_HEAD for a
    padding head [local_heads]; the global KV head of each local KV head [local_kv_heads]). Local head j reads
    local KV head j // (local_heads / local_kv_heads), as grouped-query attention does.

    Query head h reads KV head h // G (G = num_heads / num_kv_heads). A rank holds each KV head its heads
    read: sharded when N divides KV, replicated on the ranks sharing a group otherwise. When a group straddles
    two ranks unevenly (SmolLM2's 9 heads and 3 KV heads over 2 ranks: heads 0-4 read KV heads 0 and 1), every
    local group is padded to the rank's largest with heads whose q columns and o rows are zero: they attend,
    and add exactly nothing. This keeps the KV cache at most N - 1 heads over the model's (rather than a copy
    per query head) for a few heads' attention more."""
    kv_of = heads // (num_heads // num_kv_heads)  # [len(heads)]
    kv, counts = np.unique(kv_of, return_counts=True)
    layout = np.full((len(kv), counts.max()), PAD_HEAD, np.int64)  # [local_kv_heads, local group]
    for i, k in enumerate(kv):
        layout[i, :counts[i]] = heads[kv_of == k]
    return layout.reshape(-1), kv.astype(np.int64)


def plan_shard(cfg: ModelConfig, rank: int, world_size: int) -> RankShard:
    heads, kv_heads = local_heads(np.arange(*_range(cfg.num_heads, rank, world_size), dtype=np.int64),
                                  cfg.num_heads, cfg.num_kv_heads)
    experts = _range(cfg.moe.num_experts, rank, world_size) if cfg.moe is not None else (0, 0)
    return RankShard(rank, world_size, heads, kv_heads,
                     _range(cfg.intermediate_size, rank, world_size),
                     _range(cfg.vocab_size, rank, world_size),
                     tuple(hi - lo for lo, hi in (_range(cfg.vocab_size, r, world_size)
                                                  for r in range(world_size))),
                     experts)


def check_tensor_parallel(cfg: ModelConfig, world_size: int, expert_parallel: bool = False) -> None:
    """What a sharded run takes: tensor parallelism a dense model, expert parallelism a mixture-of-experts one
    (at least one expert per rank); both at least one query head per rank."""
    flag = f"--{'expert' if expert_parallel else 'tensor'}-parallel-size {world_size}"
    if cfg.moe is not None and not expert_parallel:
        raise ConfigError("--tensor-parallel-size does not shard a mixture-of-experts model's experts; use "
                          "--expert-parallel-size N (experts split over N ranks, attention sharded "
                          "over them as here)")
    if cfg.moe is None and expert_parallel:
        raise ConfigError("--expert-parallel-size shards a mixture-of-experts model's experts; "
                          "this model is dense: use --tensor-parallel-size")
    if world_size > cfg.num_heads:
        raise ConfigError(f"{flag} is more ranks than the model's {cfg.num_heads} attention heads; "
                          "use at most that many")
    if expert_parallel and world_size > cfg.moe.num_experts:
        raise ConfigError(f"{flag} is more ranks than the model's {cfg.moe.num_experts} experts; "
                          "use at most that many")


def _take(w: paddle.Tensor, idx: np.ndarray, axis: int) -> paddle.Tensor:
    """w's rows (axis 0) or columns (axis 1) idx; zeros where idx is negative (a padding head's)."""
    out = paddle.gather(w, paddle.to_tensor(np.maximum(idx, 0)), axis=axis)
    if (idx >= 0).all():
        return out
    keep = paddle.to_tensor(idx >= 0).astype(w.dtype)
    return out * (keep if axis == w.ndim - 1 else keep.unsqueeze(-1))


def _columns(lin: Linear, cols: np.ndarray) -> Linear:
    """A column-parallel part: output columns `cols` of W [in, out] (and of the bias); negative: zeros."""
    return Linear(_take(lin.weight, cols, 1), None if lin.bias is None else _take(lin.bias, cols, 0))


def _rows(lin: Linear, rows: np.ndarray, keep_bias: bool) -> Linear:
    """A row-parallel part: input rows `rows` of W [in, out] (negative: zeros); the bias on one rank only (the
    sum adds it once)."""
    return Linear(_take(lin.weight, rows, 0), lin.bias if keep_bias else None)


def _head_columns(heads: np.ndarray, head_dim: int, offset: int = 0) -> np.ndarray:
    """The columns of heads [n] (head_dim each, after `offset`), -1 for a padding head's."""
    cols = offset + heads[:, None] * head_dim + np.arange(head_dim)[None, :]  # [n, head_dim]
    return np.where(heads[:, None] == PAD_HEAD, -1, cols).reshape(-1)


def shard_block(b: DecoderBlock, s: RankShard, full: BlockShape, inter_size: int) -> DecoderBlock:
    """A dense block's MLP is cut into inter_size's columns s.inter; a routed block keeps its experts
    s.experts whole and cuts its shared experts' columns (if any) as evenly."""
    D, H, KV = full.head_dim, full.num_heads, full.num_kv_heads
    q = _head_columns(s.heads, D)
    k = _head_columns(s.kv_heads, D, H * D)
    v = _head_columns(s.kv_heads, D, (H + KV) * D)
    b = dataclasses.replace(b, qkv=_columns(b.qkv, np.concatenate([q, k, v])), o=_rows(b.o, q, s.rank == 0))
    if b.moe is not None:
        lo, hi = s.experts
        b = dataclasses.replace(b, moe=dataclasses.replace(b.moe, experts=b.moe.experts[lo:hi],
                                                           first_expert=lo))
        if b.down is None:  # no shared experts
            return b
        inter_size = b.down.weight.shape[0]
    cols = np.arange(*_range(inter_size, s.rank, s.world_size), dtype=np.int64)
    return dataclasses.replace(b, gate_up=_columns(b.gate_up, np.concatenate([cols, inter_size + cols])),
                               down=_rows(b.down, cols, s.rank == 0))


def shard_weights(w: DecoderWeights, s: RankShard, full: BlockShape, inter_size: int) -> DecoderWeights:
    """Rank `s.rank`'s part of every weight (dense Paddle [in, out] weights, as the reference backend
    reads)."""
    lo, hi = s.vocab
    return DecoderWeights(
        # [local_vocab, hidden]
        embed=paddle.gather(w.embed, paddle.to_tensor(np.arange(lo, hi, dtype=np.int64))),
        blocks=[shard_block(b, s, full, inter_size) for b in w.blocks],
        final_norm=w.final_norm,
        lm_head=_columns(w.lm_head, np.arange(lo, hi, dtype=np.int64)),  # [hidden] -> [local_vocab]
    )
