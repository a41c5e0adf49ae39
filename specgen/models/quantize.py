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
A quantized weight carries both its raw blocks (the fused backend multiplies by them directly) and their
dequantized float32 values (the reference backend multiplies by those, on any device): the same weights on
both paths. Quantized checkpoints are kept in the cache, so a rerun reads them back instead of quantizing
again.
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
    """`ckpt` with its projections in `mode`; returns it and how many weights were quantized."""
    if mode == "auto":
        return ckpt, 0
    if mode == "none":
        return dataclasses.replace(ckpt, quantized={}), 0
    weights, quantized = dict(ckpt.weights), dict(ckpt.quantized)
    count = 0
    names = projection_names(ckpt)
    for name in names:
        kind = HEAD_KIND if name == names[-1] else KIND[mode]
        w = weights[name]
        stored = quantized.get(name)
        if ((stored is not None and stored.kind == kind) or w.ndim != 2
                or w.shape[1] % QUANT_BLOCK_WEIGHTS[kind]):
            continue
        blocks, values = quantize_rows(w, kind)
        quantized[name] = QuantRows(kind, blocks)
        weights[name] = values
        count += 1
    return dataclasses.replace(ckpt, weights=weights, quantized=quantized), count


def quantize_rows(w: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """[out, in] float -> (uint8 blocks [out, in / 32, bytes], their dequantized float32 values [out, in]),
    through the gguf package's reference quantizers (llama.cpp's formats, bit for bit)."""
    from gguf import GGMLQuantizationType, quants

    qtype = GGMLQuantizationType[kind]
    raw = quants.quantize(np.ascontiguousarray(w, dtype=np.float32), qtype)  # [out, in / 32 * bytes]
    values = quants.dequantize(raw, qtype).astype(np.float32, copy=False)
    return raw.reshape(w.shape[0], -1, QUANT_BLOCK_BYTES[kind]), values


def cache_key(source: str, mode: str) -> str:
    """The quantized entry of a checkpoint: its files' paths, sizes and modification times, and the mode."""
    stamp = file_stamps(checkpoint_files(source))
    from specgen import __version__
    from specgen.models.default_model import CACHE_FORMAT

    # the loaders' output is part of what is cached: their cache format and specgen's version are in the key
    return hashlib.sha256(
        json.dumps([QUANT_FORMAT, CACHE_FORMAT, __version__, mode, stamp]).encode()).hexdigest()[:16]


def load_quantized(source: str, mode: str, cache_root: Path, load) -> Checkpoint:
    """load() quantized to `mode`, through the cache: <cache_root>/quantized/<name>-<mode>-<key>."""
    from specgen.models import default_model

    if mode in ("auto", "none"):
        return quantize_checkpoint(load(), mode)[0]
    entry = Path(cache_root) / "quantized" / f"{Path(source).stem}-{mode}-{cache_key(source, mode)}"
    if entry.is_dir():
        return default_model._read_entry(entry, source=source)
    ckpt, count = quantize_checkpoint(load(), mode)
    if count:
        default_model._write_entry(ckpt, entry)
    return ckpt
