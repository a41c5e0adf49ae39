"""Checkpoint: what every loader (HF directory, GGUF) hands to the runtime."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from specgen.models.config import ModelConfig
from specgen.models.tokenizer import TextTokenizer

# GGUF block formats whose raw blocks the runtime can multiply by directly (specgen/kernels/linear.cc): bytes
# per block, and weights per block (the K-quants' super-blocks hold 256).
# "QX" is specgen's own (specgen.kernels.qx_rows): what rows of mixed formats are converted to when fused.
QUANT_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210, "QX": 48}
QUANT_BLOCK_WEIGHTS = {"Q4_0": 32, "Q4_1": 32, "Q8_0": 32, "Q4_K": 256, "Q5_K": 256, "Q6_K": 256, "QX": 32}


@dataclass(frozen=True)
class QuantRows:
    """A Linear weight [out, in] as its GGUF file stores it (or, fused from rows of several formats, as QX):
    uint8 blocks [out, in / QUANT_BLOCK_WEIGHTS[kind], QUANT_BLOCK_BYTES[kind]] of `kind`. Dequantized, they
    are the float32 weight the checkpoint also holds."""

    kind: str
    blocks: np.ndarray  # [out, in / QUANT_BLOCK_WEIGHTS[kind], QUANT_BLOCK_BYTES[kind]] uint8


@dataclass
class Checkpoint:
    """Weights in HF naming and HF layout (Linear weights [out, in]), as float32 numpy arrays; `quantized`
    keeps the raw blocks of those a GGUF file stores block-quantized."""

    config: ModelConfig
    weights: dict[str, np.ndarray]
    tokenizer: TextTokenizer | None
    source: str  # the path it was loaded from, for messages
    quantized: dict[str, QuantRows] = field(default_factory=dict)


# Files of an HF checkpoint directory that decide its outputs: weights, configs, tokenizer.
MODEL_FILE_SUFFIXES = (".safetensors", ".json", ".model", ".txt", ".gguf", ".npy", ".jinja")


def checkpoint_files(path: str | Path) -> list[Path]:
    """The files a checkpoint is: a .gguf file itself, or a directory's weight / config / tokenizer files."""
    root = Path(path)
    if root.is_file():
        return [root]
    return sorted(p for p in root.iterdir() if p.is_file() and p.suffix in MODEL_FILE_SUFFIXES)


def file_stamps(files: list[Path]) -> list[list]:
    """[resolved path, size, modification time] of each file: what tells a cache keyed by them that they
    changed."""
    return [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in files]
