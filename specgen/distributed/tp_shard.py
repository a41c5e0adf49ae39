"""Tensor-parallel shards of a decoder's weights, cut by hand (Megatron-LM's layout, Shoeybi et al. 2019): each
rank holds some attention heads (q/k/v columns, o rows) and some MLP columns (gate/up columns, down rows), so a
block needs one sum over the ranks after o and one after down; the embedding and the LM head hold a contiguous
range of the vocabulary each. Splits are as even as they go (numpy.array_split): the first ranks take one more."""
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


@dataclass(frozen=True)
class RankShard:
    """What one rank of `world_size` holds."""

    rank: int
    world_size: int
    heads: np.ndarray  # [local_heads] int64 the global query heads this rank attends with
    kv_heads: np.ndarray  # [local_kv_heads] int64 the global KV head each local KV head is (a copy when replicated)
    inter: tuple[int, int]  # MLP columns [lo, hi)
    vocab: tuple[int, int]  # vocabulary rows [lo, hi) of the embedding and the LM head
    vocab_sizes: tuple[int, ...]  # [world_size] every rank's hi - lo (gathered logits are padded to the largest)

    def shape(self, full: BlockShape) -> BlockShape:
        return dataclasses.replace(full, num_heads=len(self.heads), num_kv_heads=len(self.kv_heads))


def _range(n: int, rank: int, world_size: int) -> tuple[int, int]:
    """[lo, hi) of rank's part of n items, as numpy.array_split cuts them."""
    base, extra = divmod(n, world_size)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (rank < extra)


def local_kv_heads(heads: np.ndarray, num_heads: int, num_kv_heads: int) -> np.ndarray:
    """The KV heads a rank holding query `heads` needs, in the order its attention reads them (local query head j
    uses local KV head j // (local_heads / local_kv_heads), as grouped-query attention does).

    Query head h reads KV head h // G (G = num_heads / num_kv_heads). When the rank's heads fall in whole groups
    or within one group (the ranks divide the KV heads, or the KV heads divide the ranks) each KV head it touches
    is held once: sharded when N divides KV, replicated on the N / KV ranks sharing a group otherwise. When a
    group straddles two ranks unevenly (KV = 2, N = 3: heads {0, 1}, {2}, {3}), the rank holds one copy per query
    head (local attention is then multi-head): more cache, the same numbers."""
    kv_of = heads // (num_heads // num_kv_heads)  # [local_heads]
    uniq, counts = np.unique(kv_of, return_counts=True)
    if np.array_equal(np.repeat(uniq, counts[0]), kv_of):
        return uniq.astype(np.int64)
    return kv_of.astype(np.int64)


def plan_shard(cfg: ModelConfig, rank: int, world_size: int) -> RankShard:
    lo, hi = _range(cfg.num_heads, rank, world_size)
    heads = np.arange(lo, hi, dtype=np.int64)
    return RankShard(rank, world_size, heads, local_kv_heads(heads, cfg.num_heads, cfg.num_kv_heads),
                     _range(cfg.intermediate_size, rank, world_size), _range(cfg.vocab_size, rank, world_size),
                     tuple(hi - lo for lo, hi in (_range(cfg.vocab_size, r, world_size) for r in range(world_size))))


def check_tensor_parallel(cfg: ModelConfig, world_size: int) -> None:
    """What tensor parallelism runs: a dense model with at least one query head per rank."""
    if cfg.moe is not None:
        raise ConfigError("--tensor-parallel-size does not run mixture-of-experts models yet (their experts are not "
                          "sharded); use --data-parallel-size")
    if world_size > cfg.num_heads:
        raise ConfigError(f"--tensor-parallel-size {world_size} is more ranks than the model's {cfg.num_heads} "
                          "attention heads; use at most that many")


def _columns(lin: Linear, cols: np.ndarray) -> Linear:
    """A column-parallel part: output columns `cols` of W [in, out] (and of the bias)."""
    idx = paddle.to_tensor(cols)
    bias = None if lin.bias is None else paddle.gather(lin.bias, idx)
    return Linear(paddle.gather(lin.weight, idx, axis=1), bias)


def _rows(lin: Linear, rows: np.ndarray, keep_bias: bool) -> Linear:
    """A row-parallel part: input rows `rows` of W [in, out]; the bias on one rank only (the sum adds it once)."""
    return Linear(paddle.gather(lin.weight, paddle.to_tensor(rows)), lin.bias if keep_bias else None)


def _head_columns(heads: np.ndarray, head_dim: int, offset: int = 0) -> np.ndarray:
    return (offset + heads[:, None] * head_dim + np.arange(head_dim)[None, :]).reshape(-1)


def shard_block(b: DecoderBlock, s: RankShard, full: BlockShape, inter_size: int) -> DecoderBlock:
    D, H, KV = full.head_dim, full.num_heads, full.num_kv_heads
    q = _head_columns(s.heads, D)
    k = _head_columns(s.kv_heads, D, H * D)
    v = _head_columns(s.kv_heads, D, (H + KV) * D)
    cols = np.arange(*s.inter, dtype=np.int64)
    return dataclasses.replace(
        b, qkv=_columns(b.qkv, np.concatenate([q, k, v])), o=_rows(b.o, q, s.rank == 0),
        gate_up=_columns(b.gate_up, np.concatenate([cols, inter_size + cols])),
        down=_rows(b.down, cols, s.rank == 0))


def shard_weights(w: DecoderWeights, s: RankShard, full: BlockShape, inter_size: int) -> DecoderWeights:
    """Rank `s.rank`'s part of every weight (dense Paddle [in, out] weights, as the reference backend reads)."""
    lo, hi = s.vocab
    return DecoderWeights(
        embed=paddle.gather(w.embed, paddle.to_tensor(np.arange(lo, hi, dtype=np.int64))),  # [local_vocab, hidden]
        blocks=[shard_block(b, s, full, inter_size) for b in w.blocks],
        final_norm=w.final_norm,
        lm_head=_columns(w.lm_head, np.arange(lo, hi, dtype=np.int64)),  # [hidden] -> [local_vocab]
    )
