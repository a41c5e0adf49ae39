"""What a backend does for the engine: prepare a decoder's weights, run a packed forward, make KV caches,
run an MTP head's pass. Two implement it: the Paddle reference (any device) and the fused CPU kernels."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import paddle

from specgen.config import EngineConfig
from specgen.layers.block import BlockShape
from specgen.layers.rotary import RopeTables
from specgen.models.config import ModelConfig
from specgen.models.weights import DecoderWeights
from specgen.runtime.batch import ForwardBatch
from specgen.runtime.kv_cache import KVCache


class ModelView(Protocol):
    """What a backend reads of the model it runs (specgen.models.model.Model)."""

    config: ModelConfig
    dtype: str
    weights: DecoderWeights
    rope: RopeTables
    shape: BlockShape
    max_len: int


@dataclass(frozen=True)
class ForwardOutput:
    """One forward's results."""

    logits: paddle.Tensor | None  # [num_logits, vocab]; None when not asked for and the backend skipped them
    hidden: paddle.Tensor  # [num_tokens, hidden] final normed hidden states
    greedy: np.ndarray  # [num_logits] int64 each logit row's argmax (the lowest id on a tie); with `sampled`
    # each row's token, its sampled rows sampled
    expert_counts: np.ndarray | None = None  # [num_routed_blocks, num_experts] int64 tokens each expert took
    # ... (MoE)
    features: paddle.Tensor | None = None  # [num_tokens, C hidden] the inputs of the C blocks asked for (the
    # last block's output for index num_layers), side by side: EAGLE-3's features; None when none were asked
    sampled: bool = False  # the forward sampled the rows RowSampling asked for (Backend.samples_in_forward)


@dataclass(frozen=True)
class MtpPass:
    """One step's pass of an MTP head: its cache caught up over the catch-up tokens (grouped by sequence, in
    order), then depth drafts for each sequence that wants them, each applying the head again to its own
    output row and draft one position further on."""

    token_slots: np.ndarray  # [num_tokens] int64 head cache slot of each catch-up token
    positions: np.ndarray  # [num_tokens] int64 head position
    token_ids: np.ndarray  # [num_tokens] int64 token i + 1 of position i
    rows: np.ndarray  # [num_tokens] int64 row of `hidden` holding the main model's hidden state at position i
    hidden: paddle.Tensor  # [num_rows, hidden]
    seq_lens: np.ndarray  # [num_seqs] int64 catch-up tokens of each sequence (>= 1)
    last_rows: np.ndarray  # [num_wanted] int64 the last catch-up token of each sequence that wants drafts
    depth: int  # drafts per wanted sequence (>= 1)
    # float64 [4, num_wanted]: each wanted sequence's 1 / temperature (0: greedy), request key (high, low 32
    # bits) and the output position of its first draft; a sampled one's drafts are coupled to the tokens
    # verification samples (layers/sampling.py's coupled_drafts). None: every draft the argmax
    draw: np.ndarray | None = None


@dataclass(frozen=True)
class RowSampling:
    """How each logit row of a step is sampled (layers/sampling.py's rule)."""

    temperature: np.ndarray  # [num_logits] float64, 0 = greedy
    top_k: np.ndarray  # [num_logits] int64, 0 = off
    top_p: np.ndarray  # [num_logits] float64, 1 = off
    min_p: np.ndarray  # [num_logits] float64, 0 = off
    # each row's noise stream is that of (its request's key, its output position) (layers/sampling.streams:
    # the fused operator computes it itself); None: every row greedy
    key: np.ndarray | None  # [num_logits] uint64
    position: np.ndarray | None  # [num_logits] int64 output positions (>= 0)

    def unfiltered(self) -> bool:
        """Whether no sampled row has a filter on (top_k, top_p, min_p): the rows a backend that samples in
        its forward takes (their kept set is every token, so no logit is needed beyond the keys' bounds)."""
        s = self.temperature > 0
        if not s.any():
            return True
        return bool((self.top_k[s] <= 0).all() and (self.top_p[s] >= 1).all() and (self.min_p[s] <= 0).all())

    def streams(self) -> np.ndarray | None:
        """[num_logits] uint64 each row's noise stream; None where every row is greedy."""
        from specgen.layers.sampling import streams

        return None if self.key is None else streams(self.key, self.position)


class PreparedHead(Protocol):
    """An MTP head prepared for a backend."""

    def run(self, cache: KVCache, p: MtpPass) -> tuple[np.ndarray, Any]:
        """Catch up and draft: (int64 [num_wanted, depth] token ids, the block's output rows of the catch-up
        tokens, paddle [num_tokens, hidden]: the next module's hidden input in multi-layer MTP)."""


class Backend(Protocol):
    name: str  # "fused" | "reference"
    dtype: str
    engine: EngineConfig  # the settings the model was loaded with (threads, cpu_target, ...)
    int8_product: bool  # products quantize their inputs to int8 (EngineConfig.matmul int8)

    @property
    def keeps_blocks(self) -> bool:
        """Whether projections stored as GGUF blocks are multiplied from their blocks (their float copies are
        then never converted)."""

    def prepare_linear(self, lin: Any) -> Any:
        """A block's Linear, as the checkpoint is read (packed, its blocks dropped): returns it."""

    def prepare(self, model: ModelView) -> None:
        """Bring the model's weights into the form this backend's products read (in place)."""

    @property
    def samples_in_forward(self) -> bool:
        """Whether forward, given `sampling` and no logits asked for, samples the rows itself (rows whose
        filters are off: RowSampling.unfiltered), without the logits."""

    def forward(self, model: ModelView, batch: ForwardBatch, cache: KVCache, logits: bool,
                features: tuple[int, ...] = (), sampling: RowSampling | None = None) -> ForwardOutput:
        """One packed forward; writes the tokens' K/V. With `logits` False the caller needs the greedy tokens
        only (the logits may then be skipped), or with `sampling` the tokens those rows sample, where the
        backend samples in its forward (ForwardOutput.sampled); `features`: the blocks whose inputs
        ForwardOutput.features holds."""

    def logits(self, model: ModelView, hidden: paddle.Tensor) -> paddle.Tensor:
        """The LM head over final normed hidden rows [rows, hidden] -> [rows, vocab]."""

    def sample(self, logits: paddle.Tensor | None, s: RowSampling, greedy: np.ndarray) -> np.ndarray:
        """[num_logits] int64 each row's token: greedy rows keep `greedy` (the forward's argmax), sampled rows
        sample logits [num_logits, vocab] by the rule of layers/sampling.py."""

    def logprobs(self, logits: paddle.Tensor, rows: np.ndarray, tokens: np.ndarray,
                 top: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The log-softmax of logits rows `rows` at `tokens` (float64 [n]) and their `top` most likely tokens
        (int64 and float64 [n, top]; most likely first, the lower id first on a tie): layers/logprobs.py's
        rule."""

    def new_cache(self, model: ModelView, num_slots: int, max_capacity: int, kv_dtype: str,
                  num_layers: int | None = None) -> KVCache:
        """A KV cache for this backend (kv_dtype: auto, the model's dtype, or float16)."""

    def prepare_drafter(self, model: ModelView, weights: Any, quantize: bool) -> Any:
        """A learned drafter's weights (specgen/drafters: an MTP module, an EAGLE or EAGLE-3 layer) ready to
        run beside `model`: a PreparedHead for an MTP module, EaglePass.run's interface for an EAGLE layer.
        `quantize`: its projections as Q8_0 blocks beside a main model kept in GGUF blocks."""

    def describe(self) -> list:
        """What a step's cost depends on besides the model's shape (cost tables are kept per description)."""
