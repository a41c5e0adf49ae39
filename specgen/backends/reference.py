"""The reference backend: the forward in Paddle's own operators, composed of the layers in specgen/layers. It
runs on any device Paddle runs on (a paddlepaddle-gpu user's path) and is what the fused kernels are tested
against."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import paddle
import paddle.nn.functional as F

from specgen.backends.base import ForwardOutput, ModelView, RowSampling
from specgen.config import EngineConfig
from specgen.errors import CheckpointError, ConfigError
from specgen.layers.attention import AttentionIndex
from specgen.layers.block import block_forward
from specgen.layers.linear import Linear
from specgen.layers.logprobs import row_logprobs
from specgen.layers.norm import rms_norm
from specgen.layers.quant import DeviceBlocks
from specgen.layers.sampling import sample
from specgen.runtime.batch import ForwardBatch
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

    samples_in_forward = False  # (forward computes every logit; `sampling` is not read)

    def forward(self, model: ModelView, batch: ForwardBatch, cache: KVCache,
                logits: bool = True, features: tuple[int, ...] = (),
                sampling: RowSampling | None = None) -> ForwardOutput:
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
        return sample(logits, s.temperature, s.top_k, s.top_p, s.streams(), greedy, s.min_p)

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

    def prepare_drafter(self, model: ModelView, weights: Any, quantize: bool) -> Any:
        """A learned drafter's reference pass (its weights' own, in Paddle's operators)."""
        return weights.reference_pass(model)

    def describe(self) -> list:
        return [self.name]


def reserve(batch: ForwardBatch, cache: KVCache) -> None:
    """Room in `cache` for the positions `batch` writes (own rows past a shared prefix)."""
    plen = batch.token_prefix_len
    own_max = batch.max_position if plen is None else int((batch.positions - plen).max()) + 1
    cache.reserve(batch.max_position, own_max)


