"""Typed weights of a decoder read from a Checkpoint: checked, QKV and gate/up fused, transposed to Paddle's
[in, out], q/k rows reordered for rotate-half RoPE; with the raw GGUF blocks of the projections a file stores
block-quantized, fused and reordered alike."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import paddle

from specgen.errors import CheckpointError
from specgen.kernels.packing import MAX_PARTS, PANEL
from specgen.layers.block import DecoderBlock
from specgen.layers.linear import Linear
from specgen.layers.moe import Expert, MoeExperts
from specgen.models.checkpoint import (
    Checkpoint,
    Lazy,
    MixedRows,
    QuantRows,
    StoredRows,
    block_kind,
    tensor_shape,
)
from specgen.models.config import ModelConfig


def interleaved_to_half(w: np.ndarray, num_heads: int, head_dim: int) -> np.ndarray:
    """Reorder each head's rows from pairs (2i, 2i+1) to halves (i, i + d/2).

    q and k permuted alike leave q.k unchanged, and rotate-half RoPE on the reordered rows equals
    pairwise RoPE on the original ones; so one RoPE implementation serves both layouts.
    """
    order = np.concatenate([np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)])
    shaped = w.reshape(num_heads, head_dim, *w.shape[1:])
    return shaped[:, order].reshape(w.shape)


class TensorReader:
    """Checked access to a checkpoint's numpy tensors, converted to Paddle in the model's dtype, each read
    from the checkpoint when its layer is made (a Lazy checkpoint holds none). `prepare` is given every
    Linear of the blocks as it is made (a backend packs it there: one layer's weights are held unpacked at a
    time)."""

    def __init__(self, weights: Mapping[str, np.ndarray], source: str, cfg: ModelConfig, dtype: str,
                 quantized: Mapping[str, QuantRows] | None = None,
                 prepare: Callable[[Linear], Linear] | None = None):
        self.weights = Lazy.held(weights, tensor_shape)
        self.source, self.cfg, self.dtype = source, cfg, dtype
        self.quantized = Lazy.held(quantized or {}, block_kind)
        self.prepare = prepare or (lambda lin: lin)
        self.block_kinds: set[str] = set()  # the kinds of the blocks the projections were read with

    def check(self, name: str, shape: tuple[int, ...]) -> None:
        got = self.weights.info.get(name)
        if got is None:
            raise CheckpointError(f"{self.source}: missing tensor {name!r}")
        if tuple(got) != shape:
            raise CheckpointError(f"{self.source}: tensor {name!r} has shape {list(got)}, "
                                  f"expected {list(shape)}")

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        self.check(name, shape)
        return self.weights[name]

    def to_paddle(self, arr: np.ndarray) -> paddle.Tensor:
        """A mapped file's array of the model's dtype stays mapped on the CPU (a zero-copy tensor: only the
        pages read become resident); anything else is copied."""
        if (isinstance(arr, np.memmap) and arr.dtype == np.dtype(self.dtype) and arr.flags.c_contiguous
                and arr.flags.writeable and paddle.device.get_device() == "cpu"):
            return paddle.base.core.eager.Tensor(arr, paddle.CPUPlace(), False, True, "mapped", True)
        return paddle.to_tensor(np.ascontiguousarray(arr, dtype=self.dtype))

    def param(self, name: str, shape: tuple[int, ...]) -> paddle.Tensor:
        return self.to_paddle(self.get(name, shape))

    def blocks(self, names: list[str], permute=None) -> QuantRows | MixedRows | None:
        """The raw blocks of HF [out, in] weights `names`, each reordered by `permute` (None: kept) and
        concatenated along out; rows of different formats are converted to QX, with the runs of one format
        kept as `parts` where the fused kernels can take them (at most MAX_PARTS runs, each but the last of
        whole panels). None unless every one is stored block-quantized."""
        if any(n not in self.quantized for n in names):
            return None
        rows = [self.quantized[n] for n in names]
        self.block_kinds |= {q.kind for q in rows}
        permute = permute or [None] * len(rows)
        blocks = [q.blocks if f is None else f(q.blocks) for q, f in zip(rows, permute)]
        if len({q.kind for q in rows}) == 1:
            return QuantRows(rows[0].kind, np.concatenate(blocks))
        runs: list[tuple[str, list[np.ndarray]]] = []  # consecutive rows of one format
        for q, b in zip(rows, blocks):
            if runs and runs[-1][0] == q.kind:
                runs[-1][1].append(b)
            else:
                runs.append((q.kind, [b]))
        mixed = MixedRows(tuple(QuantRows(kind, np.concatenate(bs)) for kind, bs in runs))
        if len(mixed.parts) > MAX_PARTS or any(len(p.blocks) % PANEL for p in mixed.parts[:-1]):
            return QuantRows("QX", mixed.blocks)  # the fused kernels take no such parts
        return mixed

    def linear(self, names: list[str], shapes: list[tuple[int, int]], bias: list[str] | None = None,
               permute=None, blocks_only: bool = False, head: bool = False) -> Linear:
        """HF [out, in] weights `names` fused along out into one Linear [in, sum out], prepared (unless it is
        the LM `head`); with blocks_only and raw blocks for all of them, the dense weight is checked but not
        read (a backend packs the blocks)."""
        for n, s in zip(names, shapes):
            self.check(n, s)
        quant = self.blocks(names, permute) if blocks_only else None
        weight = None
        if quant is None:
            permute = permute or [None] * len(names)
            arrays = [self.get(n, s) for n, s in zip(names, shapes)]
            arrays = [a if f is None else f(a) for a, f in zip(arrays, permute)]
            weight = self.to_paddle(np.concatenate(arrays, axis=0).T)
            del arrays
        b = None
        if bias is not None:
            parts = [self.get(n, (s[0],)) for n, s in zip(bias, shapes)]
            permute = permute or [None] * len(parts)
            b = self.to_paddle(np.concatenate([p if f is None else f(p) for p, f in zip(parts, permute)]))
        if head and quant is not None:  # read again when asked for: the backend packs it, drafters take rows
            quant = StoredRows(quant.kind, lambda: self.blocks(names, permute))
        lin = Linear(weight, b, quant)
        return lin if head else self.prepare(lin)

    def mlp(self, p: str, inter: int, blocks_only: bool, bias: bool) -> tuple[Linear, Linear]:
        """A SwiGLU MLP under prefix `p` (e.g. "model.layers.3.mlp."): (gate_up, down)."""
        h = self.cfg.hidden_size
        gu = [p + "gate_proj.", p + "up_proj."]
        return (self.linear([m + "weight" for m in gu], [(inter, h), (inter, h)],
                            [m + "bias" for m in gu] if bias else None, blocks_only=blocks_only),
                self.linear([p + "down_proj.weight"], [(h, inter)], [p + "down_proj.bias"] if bias else None,
                            blocks_only=blocks_only))

    def experts(self, p: str, blocks_only: bool) -> MoeExperts:
        """A routed block's router and experts under `p` (e.g. "model.layers.3.mlp."), the HF layout of
        Qwen3-MoE and ERNIE-4.5-MoE: gate.weight [num_experts, hidden],
        experts.{e}.{gate,up,down}_proj.weight, and ERNIE's moe_statics.e_score_correction_bias
        [1, num_experts]."""
        moe, h = self.cfg.moe, self.cfg.hidden_size
        E = moe.num_experts
        bias = None
        if moe.selection_bias:
            bias = self.to_paddle(self.get(p + "moe_statics.e_score_correction_bias", (1, E)).reshape(E))
        experts = [Expert(*self.mlp(f"{p}experts.{e}.", moe.intermediate_size, blocks_only, False))
                   for e in range(E)]
        return MoeExperts(router=self.linear([p + "gate.weight"], [(E, h)], blocks_only=blocks_only),
                          experts=experts, num_experts=E, top_k=moe.top_k, norm_topk_prob=moe.norm_topk_prob,
                          norm_min=moe.norm_min, selection_bias=bias)

    def block(self, p: str, blocks_only: bool = False, routed: bool = False) -> DecoderBlock:
        """One decoder block under prefix `p` (e.g. "model.layers.3."); a routed one (mixture of experts) with
        its experts and, where the model has them, its shared experts as the dense MLP."""
        cfg = self.cfg
        h, hd, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
        q_out, kv_out = cfg.num_heads * hd, cfg.num_kv_heads * hd
        permute = None
        if cfg.rope_interleaved:
            permute = [lambda w: interleaved_to_half(w, cfg.num_heads, hd),
                       lambda w: interleaved_to_half(w, cfg.num_kv_heads, hd), None]
        attn = p + "self_attn."
        qkv = [attn + f"{n}_proj." for n in "qkv"]
        moe = self.experts(p + "mlp.", blocks_only) if routed else None
        if not routed:
            gate_up, down = self.mlp(p + "mlp.", inter, blocks_only, cfg.mlp_bias)
        elif cfg.moe.num_shared_experts:
            shared = cfg.moe.num_shared_experts * cfg.moe.intermediate_size
            gate_up, down = self.mlp(p + "mlp.shared_experts.", shared, blocks_only, cfg.mlp_bias)
        else:
            gate_up = down = None
        return DecoderBlock(
            attn_norm=self.param(p + "input_layernorm.weight", (h,)),
            qkv=self.linear([n + "weight" for n in qkv], [(q_out, h), (kv_out, h), (kv_out, h)],
                            [n + "bias" for n in qkv] if cfg.qkv_bias else None, permute, blocks_only),
            o=self.linear([attn + "o_proj.weight"], [(h, q_out)],
                          [attn + "o_proj.bias"] if cfg.o_bias else None, blocks_only=blocks_only),
            mlp_norm=self.param(p + "post_attention_layernorm.weight", (h,)),
            gate_up=gate_up,
            down=down,
            q_norm=self.param(attn + "q_norm.weight", (hd,)) if cfg.qk_norm else None,
            k_norm=self.param(attn + "k_norm.weight", (hd,)) if cfg.qk_norm else None,
            moe=moe,
        )


@dataclass
class DecoderWeights:
    """A decoder's weights: embedding, blocks, final norm, LM head."""

    embed: paddle.Tensor  # [vocab, hidden]
    blocks: list[DecoderBlock]
    final_norm: paddle.Tensor  # [hidden]
    lm_head: Linear  # [hidden] -> [vocab]
    block_kinds: frozenset[str] = frozenset()  # the GGUF block kinds its projections were read with

    @classmethod
    def read(cls, ckpt: Checkpoint, dtype: str, blocks_only: bool = False,
             prepare: Callable[[Linear], Linear] | None = None) -> "DecoderWeights":
        """blocks_only: every projection with raw GGUF blocks is packed from them by the backend, so its
        float32 values are never made. prepare: what the backend does to each block's Linear as it is read
        (the LM head it prepares itself)."""
        cfg = ckpt.config
        r = TensorReader(ckpt.weights, ckpt.source, cfg, dtype, ckpt.quantized, prepare)
        h = cfg.hidden_size
        if "lm_head.bias" in ckpt.weights:
            raise CheckpointError(f"{ckpt.source}: an LM head with a bias (lm_head.bias) is not supported")
        head = ("model.embed_tokens.weight"
                if cfg.tie_word_embeddings and "lm_head.weight" not in ckpt.weights else "lm_head.weight")
        embed = r.param("model.embed_tokens.weight", (cfg.vocab_size, h))  # first: while little is held
        blocks = [r.block(f"model.layers.{i}.", blocks_only, cfg.moe is not None and i in cfg.moe.layers)
                  for i in range(cfg.num_layers)]
        return cls(
            embed=embed,
            blocks=blocks,
            final_norm=r.param("model.norm.weight", (h,)),
            lm_head=r.linear([head], [(cfg.vocab_size, h)], blocks_only=blocks_only, head=True),
            block_kinds=frozenset(r.block_kinds),
        )

    def linears(self) -> list[Linear]:
        return [lin for b in self.blocks for lin in b.linears()] + [self.lm_head]
