"""Weight-only quantization at load (`--quantization`, FastDeploy's names wint8 / wint4), for any checkpoint.

The weights it applies to are every decoder block's projections (q, k, v, o, gate, up, down; in a routed block
each expert's and the shared experts') and the LM head.
- auto (default): as the checkpoint stores them: a GGUF file's blocks stay blocks (their natural mode), float
  weights stay float.
- none: all in floating point (a GGUF file's blocks dequantized: the float model they stand for).
- wint8 / wint4: all in GGUF blocks of 32 weights along the input: wint8 as Q8_0 (symmetric: a float16 scale,
  32 int8), wint4 as Q4_1 (asymmetric: a float16 scale and minimum, 32 4-bit values; closer to the float
  weights than the symmetric Q4_0, at 20 bytes a block instead of 18). The LM head (with a tied head, the
  embedding matrix) is Q8_0 in both, as llama.cpp's 4-bit files keep it: 4 bits there cost the default model
  5% of perplexity. Blocks already of the kind wanted stay as stored; others are quantized from their float
  values.
A quantized weight has both its raw blocks (the fused backend multiplies by them directly) and their
dequantized float32 values (the reference backend multiplies by those, on any device): the same weights on
both paths, each made when asked for. Quantized checkpoints are kept in the cache (blocks, and the float32
weights that are not quantized: never a float copy of a quantized one), so a rerun reads them back instead of
quantizing again.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np

from specgen.models.checkpoint import (
    QUANT_BLOCK_BYTES,
    QUANT_BLOCK_WEIGHTS,
    Checkpoint,
    QuantRows,
    checkpoint_files,
    file_stamps,
)

QUANTIZATIONS = ("auto", "none", "wint8", "wint4")
KIND = {"wint8": "Q8_0", "wint4": "Q4_1"}
HEAD_KIND = "Q8_0"
# Part of every cache key: bump it whenever quantize_checkpoint's output changes.
QUANT_FORMAT = 3
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def projection_names(ckpt: Checkpoint) -> list[str]:
    """The HF names of the weights weight-only quantization applies to: every block's projections and the LM
    head (the embedding's matrix when the head is tied to it)."""
    cfg = ckpt.config
    names = [f"model.layers.{i}.{p}.weight" for i in range(cfg.num_layers) for p in PROJECTIONS]
    # routed blocks: every expert's and the shared experts' projections (not the router)
    if cfg.moe is not None:
        mlp = [f"{p}_proj" for p in ("gate", "up", "down")]
        names += [f"model.layers.{i}.mlp.{e}.{p}.weight" for i in cfg.moe.layers
                  for e in [f"experts.{j}" for j in range(cfg.moe.num_experts)] + ["shared_experts"]
                  for p in mlp]
    head = "lm_head.weight" if "lm_head.weight" in ckpt.weights else "model.embed_tokens.weight"
    return [n for n in names + [head] if n in ckpt.weights]


def quantize_checkpoint(ckpt: Checkpoint, mode: str) -> tuple[Checkpoint, int]:
    """`ckpt` with its projections in `mode`; returns it and how many weights it quantizes. Each weight is
    quantized when first asked for (its blocks, or its float32 values, which are the blocks dequantized), one
    at a time: nothing is held but what is asked for."""
    if mode == "auto":
        return ckpt, 0
    if mode == "none":
        return dataclasses.replace(ckpt, quantized={}), 0
    names = projection_names(ckpt)
    kinds = {}
    for name in names:
        kind = HEAD_KIND if name == names[-1] else KIND[mode]
        shape = ckpt.weights.info[name]
        if ckpt.quantized.info.get(name) == kind or len(shape) != 2 or shape[1] % QUANT_BLOCK_WEIGHTS[kind]:
            continue
        kinds[name] = kind
    weights = ckpt.weights

    def blocks(name: str) -> QuantRows:
        return QuantRows(kinds[name], quantize_rows(weights[name], kinds[name])[0])

    def values(name: str) -> np.ndarray:
        return quantize_rows(weights[name], kinds[name])[1]

    return dataclasses.replace(
        ckpt, quantized=ckpt.quantized.overlay(kinds, blocks),
        weights=weights.overlay({n: weights.info[n] for n in kinds}, values)), len(kinds)


# rows quantized per call of gguf.quants (its temporaries are several times a float32 copy of them)
QUANTIZE_CHUNK = 1 << 22


def quantize_rows(w: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """[out, in] float -> (uint8 blocks [out, in / 32, bytes], their dequantized float32 values [out, in]),
    through the gguf package's reference quantizers (llama.cpp's formats, bit for bit), a few million weights
    at a time."""
    from gguf import GGMLQuantizationType, quants

    qtype = GGMLQuantizationType[kind]
    out, inp = w.shape
    step = max(1, QUANTIZE_CHUNK // max(inp, 1))
    blocks = np.empty((out, inp // QUANT_BLOCK_WEIGHTS[kind], QUANT_BLOCK_BYTES[kind]), np.uint8)
    values = np.empty((out, inp), np.float32)
    for r in range(0, out, step):
        raw = quants.quantize(np.ascontiguousarray(w[r:r + step], dtype=np.float32), qtype)
        blocks[r:r + step] = raw.reshape(-1, *blocks.shape[1:])
        values[r:r + step] = quants.dequantize(raw, qtype)
    return blocks, values


def cache_key(source: str, mode: str) -> str:
    """The quantized entry of a checkpoint: its files' paths, sizes and modification times, and the mode."""
    stamp = file_stamps(checkpoint_files(source))
    from specgen import __version__
    from specgen.models.default_model import CACHE_FORMAT

    # the loaders' output is part of what is cached: their cache format and specgen's version are in the key
    return hashlib.sha256(
        json.dumps([QUANT_FORMAT, CACHE_FORMAT, __version__, mode, stamp]).encode()).hexdigest()[:16]


def load_quantized(source: str, mode: str, cache_root: Path, load) -> Checkpoint:
    """load() quantized to `mode`, through the cache: <cache_root>/quantized/<name>-<mode>-<key>, written one
    weight at a time (read, quantized, written, let go) and then read back from there, so that a first load
    holds no more than a later one."""
    from specgen.models import default_model

    if mode in ("auto", "none"):
        return quantize_checkpoint(load(), mode)[0]
    entry = Path(cache_root) / "quantized" / f"{Path(source).stem}-{mode}-{cache_key(source, mode)}"
    if not entry.is_dir():
        ckpt, count = quantize_checkpoint(load(), mode)
        if not count:
            return ckpt
        default_model.write_quantized_entry(entry, ckpt)
    return default_model.read_quantized_entry(entry, source=source)
