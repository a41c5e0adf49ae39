"""Frozen configuration dataclasses, one per concern; the single source of defaults."""
from __future__ import annotations

import dataclasses
import enum
import os
from dataclasses import dataclass, field
from typing import Any

from specgen.errors import ConfigError


class Method(str, enum.Enum):
    """Speculative method: one string per method."""

    NONE = "none"
    NGRAM = "ngram"
    MTP = "mtp"

    @classmethod
    def parse(cls, value: str | "Method") -> "Method":
        try:
            return cls(value)
        except ValueError:
            valid = ", ".join(m.value for m in cls)
            raise ConfigError(f"unknown method {value!r} (valid: {valid})") from None


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding parameters. temperature 0 means greedy."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    seed: int = 0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # keep generating past EOS (fixed-length outputs for benchmarks)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0, got {self.top_k}")
        if isinstance(self.stop, list):
            object.__setattr__(self, "stop", tuple(self.stop))
        if isinstance(self.stop, str) or any(not isinstance(s, str) or not s for s in self.stop):
            raise ConfigError("stop must be a list of non-empty strings")


def default_threads() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


@dataclass(frozen=True)
class EngineConfig:
    """The static batch and the runtime."""

    batch_size: int = 32  # slots
    dtype: str = "float32"
    threads: int = 0  # 0: the cores available
    max_model_len: int = 0  # 0: the model's context length
    max_prefill_tokens: int = 4096  # prompt tokens admitted (and prefilled) per step
    prefill_chunk: int = 0  # prompts longer than this are prefilled in chunks across steps; 0: whole prompts
    shared_prefix: str = "auto"  # auto: the first batch's common prompt prefix is computed once (cascade); off
    min_shared_prefix: int = 64  # shorter common prefixes are not shared
    kv_cache_dtype: str = "auto"  # auto: the compute dtype; float16: halves the cache (float32 models, CPU kernels)
    matmul: str = "float32"  # int8: inputs quantized per block of 32 for integer products (GGUF block weights)

    def __post_init__(self) -> None:
        if not 1 <= self.batch_size <= 256:
            raise ConfigError(f"batch_size must be in 1..256, got {self.batch_size}")
        if self.dtype not in ("float32", "float64"):
            raise ConfigError(f"dtype must be float32 or float64, got {self.dtype!r}")
        if self.threads < 0:
            raise ConfigError(f"threads must be >= 0, got {self.threads}")
        if self.max_model_len < 0 or self.max_prefill_tokens < 1:
            raise ConfigError("max_model_len must be >= 0 and max_prefill_tokens >= 1")
        if self.shared_prefix not in ("auto", "off"):
            raise ConfigError(f"shared_prefix must be 'auto' or 'off', got {self.shared_prefix!r}")
        if self.min_shared_prefix < 1:
            raise ConfigError(f"min_shared_prefix must be >= 1, got {self.min_shared_prefix}")
        if self.kv_cache_dtype not in ("auto", "float16"):
            raise ConfigError(f"kv_cache_dtype must be 'auto' or 'float16', got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype == "float16" and self.dtype != "float32":
            raise ConfigError(f"kv_cache_dtype float16 needs dtype float32, got {self.dtype!r}")
        if self.matmul not in ("float32", "int8"):
            raise ConfigError(f"matmul must be 'float32' or 'int8', got {self.matmul!r}")
        if self.matmul == "int8" and self.dtype != "float32":
            raise ConfigError(f"matmul int8 needs dtype float32, got {self.dtype!r}")
        if self.prefill_chunk < 0:
            raise ConfigError(f"prefill_chunk must be >= 0 (0: no chunking), got {self.prefill_chunk}")


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding. k (num_speculative_tokens) is FastDeploy's bound 1..5."""

    method: Method = Method.NONE
    num_speculative_tokens: int = 3
    ngram_min: int = 1
    ngram_max: int = 3
    ngram_pool: int = 1 << 20  # tokens of finished requests' text kept for n-gram lookup (0: own text only)
    mtp_model: str | None = None
    # MTP drafting with the slot's own text: where the last mtp_copy (or more) tokens occurred earlier in the
    # prompt or output, the draft is what followed there (prompt lookup) instead of the head's guess; 0: the head
    # only. The shipped head hardly copies from far back (it trains on 128-position windows): with 2, first drafts
    # on held-out summarization / RAG are accepted 0.45 / 0.53 of the time, not 0.27 / 0.33 (BENCHMARKS.md, "MTP
    # drafts that copy"). Copies come from the slot's own text (not the job's n-gram pool).
    mtp_copy: int = 2
    adaptive: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "method", Method.parse(self.method))
        if not 1 <= self.num_speculative_tokens <= 5:
            raise ConfigError(f"num_speculative_tokens must be in 1..5, got {self.num_speculative_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ConfigError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}")
        if not 0 <= self.mtp_copy <= 8:
            raise ConfigError(f"mtp_copy must be in 0..8 tokens (0: the head's drafts only), got {self.mtp_copy}")
        if self.ngram_pool < 0:
            raise ConfigError(f"ngram_pool must be >= 0 tokens (0: no pool), got {self.ngram_pool}")


def from_mapping(cls: type, values: dict[str, Any], where: str) -> Any:
    """Build a config dataclass from a mapping; unknown keys are an error naming the valid ones."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)} (valid: {', '.join(sorted(names))})")
    try:
        return cls(**values)
    except TypeError as exc:
        raise ConfigError(f"{where}: {exc}") from None


__all__ = ["Method", "SamplingParams", "EngineConfig", "SpecConfig", "from_mapping", "default_threads", "field"]
