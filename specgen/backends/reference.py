"""The reference backend: the forward in Paddle's own operators, composed of the layers in specgen/layers. It
runs on any device Paddle runs on (a paddlepaddle-gpu user's path) and is what the fused kernels are tested
against."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import paddle
import paddle.nn.functional as F

from specgen.backends.base import ForwardOutput, ModelView, MtpPass, RowSampling
from specgen.config import EngineConfig
from specgen.errors import CheckpointError, ConfigError
from specgen.layers.attention import AttentionIndex
from specgen.layers.block import attention, block_forward, mlp_forward
from specgen.layers.linear import Linear
from specgen.layers.logprobs import row_logprobs
from specgen.layers.norm import rms_norm
from specgen.layers.quant import DeviceBlocks
from specgen.layers.sampling import sample
from specgen.runtime.batch import ForwardBatch, build_forward_batch
from specgen.runtime.kv_cache import KVCache


class ReferenceBackend:
    name = "reference"
    int8_product = False

    def __init__(self, engine: EngineConfig):
        self.engine = engine  # the settings the model was loaded with
        self.dtype = engine.dtype

    @property
    def keeps_blocks(self) -> bool:
        """With --quantization wint8 / wint4 the projections stay blocks, dequantized a layer at a time
        (layers/quant.py); otherwise they are float."""
        return self.engine.quantization in ("wint8", "wint4")

    def prepare_linear(self, lin: Linear) -> Linear:
        if lin.weight is None and lin.blocks is not None:
            lin.weight = DeviceBlocks.of(lin.blocks.kind, lin.blocks.blocks)
        if lin.weight is None:
            raise CheckpointError("the reference backend needs every weight as floats (none was converted)")
        lin.blocks = None  # products read the dense weight (or DeviceBlocks); the blocks' memory goes
        return lin

    def prepare(self, model: ModelView) -> None:
        for lin in model.weights.linears():
            self.prepare_linear(lin)

    def forward(self, model: ModelView, batch: ForwardBatch, cache: KVCache,
                logits: bool = True, features: tuple[int, ...] = ()) -> ForwardOutput:
        w = model.weights
        reserve(batch, cache)
        att = AttentionIndex(batch, cache, model.rope, model.shape.num_heads, self.dtype)
        x = self.embed(batch.token_ids, w.embed)  # [num_tokens, hidden]
        moe = model.config.moe
        counts = np.zeros((len(moe.layers), moe.num_experts), np.int64) if moe is not None else None
        captured = {}  # block index -> its input [num_tokens, hidden]
        for i, block in enumerate(w.blocks):
            if i in features:
                captured[i] = x
            routed = counts[moe.layers.index(i)] if block.moe is not None else None
            x = block_forward(x, block, model.shape, att, i, cache.k[i], cache.v[i], routed,
                              reduce=self.reduce)
        captured[len(w.blocks)] = x
        hidden = rms_norm(x, w.final_norm, model.shape.eps)  # [num_tokens, hidden]
        out, greedy = self.head(model, hidden, batch.logit_rows, logits)
        feats = paddle.concat([captured[i] for i in features], axis=-1) if features else None
        return ForwardOutput(out, hidden, greedy, counts, feats)

    # ---- the forward's hooks ----
    # a tensor-parallel rank (distributed/tensor_parallel.py) sums and gathers in them

    # block_forward's sum of a block's row-parallel outputs over the ranks (None: one process holds them
    # whole)
    reduce: Callable[[paddle.Tensor, str], paddle.Tensor] | None = None

    def embed(self, token_ids: np.ndarray, embed: paddle.Tensor) -> paddle.Tensor:
        """token_ids [num_tokens] -> their embedding rows [num_tokens, hidden]."""
        return F.embedding(paddle.to_tensor(token_ids), embed)

    def head(self, model: ModelView, hidden: paddle.Tensor, rows: np.ndarray,
             logits: bool) -> tuple[paddle.Tensor | None, np.ndarray]:
        """The LM head over hidden [num_tokens, hidden] at rows [num_logits]: (logits [num_logits, vocab], or
        None where not asked for and skipped; greedy [num_logits] int64 each row's argmax)."""
        out = model.weights.lm_head(paddle.gather(hidden, paddle.to_tensor(rows)))  # [num_logits, vocab]
        return out, paddle.argmax(out, axis=-1).numpy()

    def logits(self, model: ModelView, hidden: paddle.Tensor) -> paddle.Tensor:
        return model.weights.lm_head(hidden)

    def sample(self, logits: paddle.Tensor | None, s: RowSampling, greedy: np.ndarray) -> np.ndarray:
        return sample(logits, s.temperature, s.top_k, s.top_p, s.u, greedy, s.min_p)

    def logprobs(self, logits: paddle.Tensor, rows: np.ndarray, tokens: np.ndarray,
                 top: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return row_logprobs(logits, rows, tokens, top)

    def new_cache(self, model: ModelView, num_slots: int, max_capacity: int, kv_dtype: str = "auto",
                  num_layers: int | None = None) -> KVCache:
        if kv_dtype not in ("auto", self.dtype):
            raise ConfigError(f"a {kv_dtype} KV cache needs a float32 model on the fused backend "
                              "(specgen's CPU kernels); "
                              f"this model runs {self.dtype} on the reference backend")
        cfg = model.config
        # attention reads whole cache rows and masks the positions past each query: they must hold finite
        # numbers
        return KVCache(cfg.num_layers if num_layers is None else num_layers, num_slots, cfg.num_kv_heads,
                       cfg.head_dim, self.dtype, max_capacity, zeroed=True)

    def prepare_head(self, model: ModelView, head: Any, quantize: bool) -> "ReferenceHead":
        return ReferenceHead(model, head)

    def prepare_eagle(self, model: ModelView, weights: Any, quantize: bool):
        """An EAGLE layer's pass in Paddle's operators (EAGLE-3's: its weights name the main model's blocks
        it reads, `features`)."""
        return Eagle3Pass(model, weights) if getattr(weights, "features", None) else EaglePass(model, weights)

    def describe(self) -> list:
        return [self.name]


def reserve(batch: ForwardBatch, cache: KVCache) -> None:
    """Room in `cache` for the positions `batch` writes (own rows past a shared prefix)."""
    plen = batch.token_prefix_len
    own_max = batch.max_position if plen is None else int((batch.positions - plen).max()) + 1
    cache.reserve(batch.max_position, own_max)


class ReferenceHead:
    """An MTP head's pass in Paddle's operators: the catch-up tokens through the head, then chained drafts."""

    def __init__(self, model: ModelView, head: Any):
        # what the pass reads of the model (not the model itself: the head is cached per model, weakly)
        self.rope, self.shape, self.dtype, self.head = model.rope, model.shape, model.dtype, head
        lm = head.lm_head or model.weights.lm_head  # its own LM head, or the main model's
        if head.draft_vocab is not None:  # drafts from these tokens only: their columns
            lm = Linear(paddle.gather(lm.dense(), paddle.to_tensor(head.draft_vocab), axis=1))
        self.lm_head = lm  # [hidden] -> [draft vocabulary]

    def _pass(self, cache: KVCache, slots, starts, lens, token_ids, prev_hidden):
        """One packed pass of the head over blocks (slots, starts, lens): (block output at each block's end
        [num_seqs, hidden], argmax token there [num_seqs], the block output of every token
        [num_tokens, hidden])."""
        hd = self.head
        batch = build_forward_batch(slots, starts, lens, token_ids, np.zeros(len(slots), bool))
        reserve(batch, cache)
        eps = self.shape.eps
        emb = F.embedding(paddle.to_tensor(batch.token_ids), hd.embed)  # [num_tokens, hidden]
        x = hd.eh_proj(paddle.concat([rms_norm(emb, hd.enorm, eps), rms_norm(prev_hidden, hd.hnorm, eps)],
                                     axis=-1))
        att = AttentionIndex(batch, cache, self.rope, self.shape.num_heads, self.dtype)
        x = block_forward(x, hd.block, self.shape, att, 0, cache.k[0], cache.v[0])
        last = paddle.gather(x, paddle.to_tensor(batch.logit_rows))  # [num_seqs, hidden]
        drafts = paddle.argmax(self.lm_head(rms_norm(last, hd.final_norm, eps)), axis=-1).numpy()
        return last, hd.token_ids(drafts), x

    def run(self, cache: KVCache, p: MtpPass) -> tuple[np.ndarray, paddle.Tensor]:
        first = np.concatenate([[0], np.cumsum(p.seq_lens)[:-1]]).astype(np.int64)  # [num_seqs]
        h_main = paddle.gather(p.hidden, paddle.to_tensor(p.rows))  # [num_tokens, hidden]
        x, d, rows = self._pass(cache, p.token_slots[first], p.positions[first], p.seq_lens, p.token_ids,
                                h_main)
        out = np.zeros((len(p.last_rows), p.depth), np.int64)
        if not len(p.last_rows):
            return out, rows
        # the sequences that want drafts: their blocks' ends are catch-up tokens p.last_rows
        wanted = np.searchsorted(first, p.last_rows, side="right") - 1  # [num_wanted] their sequence
        x = paddle.gather(x, paddle.to_tensor(wanted))
        out[:, 0] = d = d[wanted]
        slots, last_pos = p.token_slots[p.last_rows], p.positions[p.last_rows]
        ones = np.ones(len(slots), np.int64)
        for i in range(1, p.depth):
            x, d, _ = self._pass(cache, slots, last_pos + i, ones, d, x)
            out[:, i] = d
        return out, rows


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
    """One pass of an EAGLE-3 layer (Eagle3Weights, engine/proposers/eagle3.py), in Paddle's operators (any
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
