"""The runtime model: a Llama-family decoder (Llama / Mistral / Qwen2 / Qwen3 / ERNIE-4.5) as typed weights,
its RoPE tables, and the backend that runs its packed variable-length forward."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import paddle

from specgen.backends.base import Backend, ForwardOutput, RowSampling
from specgen.layers.block import BlockShape
from specgen.layers.rotary import RopeTables
from specgen.models.checkpoint import Checkpoint
from specgen.models.weights import DecoderWeights
from specgen.runtime.batch import ForwardBatch
from specgen.runtime.kv_cache import KVCache


class Model:
    """A decoder ready to run: `forward` runs one packed step and writes the KV cache."""

    def __init__(self, ckpt: Checkpoint, backend: Backend):
        """backend: from specgen.backends.select_backend (its dtype is the model's)."""
        self.config = ckpt.config
        self.source = ckpt.source
        self.dtype = backend.dtype
        self.backend = backend
        self.weights = DecoderWeights.read(ckpt, self.dtype, blocks_only=self.backend.keeps_blocks,
                                           prepare=self.backend.prepare_linear)
        cfg = self.config
        self.shape = BlockShape(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps)
        self.rope = RopeTables.build(cfg, self.dtype)
        self.max_len = cfg.max_position_embeddings
        self.backend.prepare(self)

    @property
    def int8_product(self) -> bool:
        """Whether products quantize their inputs to int8 (EngineConfig.matmul int8)."""
        return self.backend.int8_product

    def forward(self, batch: ForwardBatch, cache: KVCache, logits: bool = True,
                features: tuple[int, ...] = (), sampling: RowSampling | None = None) -> ForwardOutput:
        """One packed forward over `batch`; with `logits` False only the greedy tokens are needed, or with
        `sampling` the sampled tokens, where the backend samples in its forward (Backend.samples_in_forward);
        `features`: the blocks whose inputs ForwardOutput.features holds (EAGLE-3's)."""
        return self.backend.forward(self, batch, cache, logits, features, sampling)

    @property
    def samples_in_forward(self) -> bool:
        """Whether forward samples unfiltered rows itself, without their logits
        (Backend.samples_in_forward)."""
        return self.backend.samples_in_forward

    def new_cache(self, num_slots: int, max_capacity: int, kv_dtype: str = "auto",
                  num_layers: int | None = None) -> KVCache:
        """A KV cache for this model's blocks (or num_layers blocks: an MTP head's), in its dtype (auto) or
        float16 (float32 models, fused backend)."""
        return self.backend.new_cache(self, num_slots, max_capacity, kv_dtype, num_layers)

    def logits(self, hidden: paddle.Tensor) -> paddle.Tensor:
        """The LM head over final normed hidden rows [rows, hidden] -> [rows, vocab]."""
        return self.backend.logits(self, hidden)

    def sample(self, logits: paddle.Tensor | None, rows: RowSampling, greedy: np.ndarray) -> np.ndarray:
        """[num_logits] int64 each logit row's token (greedy, or sampled by the backend's sampler)."""
        return self.backend.sample(logits, rows, greedy)

    def logprobs(self, logits: paddle.Tensor, rows: np.ndarray, tokens: np.ndarray,
                 top: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Log-probabilities of `tokens` at logits rows `rows`, and the top `top` (the backend's operator)."""
        return self.backend.logprobs(logits, rows, tokens, top)

    def cost_key(self) -> str:
        """What a step's cost depends on in this model (the step-cost tables are kept per key): its shape,
        dtype, backend and weights' formats."""
        return json.dumps([dataclasses.asdict(self.config), self.dtype, self.backend.describe()],
                          sort_keys=True, default=str)
