"""Checkpoint: what every loader (HF directory, GGUF) hands to the runtime."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specgen.models.config import ModelConfig
from specgen.models.tokenizer import TextTokenizer


@dataclass
class Checkpoint:
    """Weights in HF naming and HF layout (Linear weights [out, in]), as float32 numpy arrays."""

    config: ModelConfig
    weights: dict[str, np.ndarray]
    tokenizer: TextTokenizer | None
    source: str  # the path it was loaded from, for messages
