"""Writing a checkpoint as an ordinary HF directory (config.json, model.safetensors, tokenizer files), and the
draft `specgen make-draft` cuts from a main model: its first L decoder layers with its final norm and LM
head."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from specgen.errors import CheckpointError, ConfigError
from specgen.models.checkpoint import Checkpoint
from specgen.models.config import ARCHITECTURES, ModelConfig

HF_CLASS = {arch: cls for cls, arch in reversed(list(ARCHITECTURES.items()))}  # llama -> LlamaForCausalLM


def first_layers(ckpt: Checkpoint, num_layers: int) -> Checkpoint:
    """The model's embedding, its first `num_layers` decoder layers, its final norm and LM head (float
    weights; block-quantized copies dropped: a loader quantizes again if asked)."""
    total = ckpt.config.num_layers
    if not 1 <= num_layers < total:
        raise ConfigError(f"--layers must be in 1..{total - 1} (the main model has {total}), "
                          f"got {num_layers}")
    keep = {}
    for name, w in ckpt.weights.items():
        if name.startswith("model.layers."):
            if int(name.split(".")[2]) >= num_layers:
                continue
        keep[name] = w
    return dataclasses.replace(ckpt, config=dataclasses.replace(ckpt.config, num_layers=num_layers),
                               weights=keep, quantized={})


def hf_config(cfg: ModelConfig) -> dict:
    """config.json for `cfg`, in the keys hf_loader.parse_config (and transformers) read."""
    out = {
        "architectures": [HF_CLASS[cfg.architecture]], "model_type": cfg.architecture,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings, "hidden_act": "silu", "torch_dtype": "float32",
        "attention_bias": cfg.qkv_bias and cfg.architecture != "qwen2", "mlp_bias": cfg.mlp_bias,
        "bos_token_id": cfg.bos_token_id, "eos_token_id": list(cfg.eos_token_ids) or None,
    }
    if cfg.architecture == "ernie4_5":
        out["use_bias"] = cfg.qkv_bias
    if cfg.rope_scaling is not None:
        out["rope_scaling"] = {"rope_type": "llama3", **dataclasses.asdict(cfg.rope_scaling)}
    return out


def save_hf(ckpt: Checkpoint, directory: Path, extra: dict | None = None, keep: tuple[str, ...] = ()) -> None:
    """Write `ckpt` into `directory` (created; written into a temporary sibling, then renamed): config.json
    (with `extra` keys), model.safetensors in float32, tokenizer.json and tokenizer_config.json. `keep`:
    entries the directory may already hold (a draft's training state); the files then go in beside them,
    config.json last."""
    directory = Path(directory)
    if directory.exists() and any(p.name not in keep for p in directory.iterdir()):
        raise ConfigError(f"{directory}: exists and is not empty")
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        tmp.chmod(0o755)
        (tmp / "config.json").write_text(json.dumps({**hf_config(ckpt.config), **(extra or {})}, indent=2)
                                         + "\n")
        save_file({n: np.ascontiguousarray(w, dtype=np.float32) for n, w in ckpt.weights.items()},
                  str(tmp / "model.safetensors"))
        tok = ckpt.tokenizer
        if tok is not None:
            tok.tokenizer.save(str(tmp / "tokenizer.json"))
            meta = {"chat_template": tok.chat_template, "bos_token": tok.bos_token,
                    "eos_token": tok.eos_token, "add_bos_token": tok.add_bos_token}
            (tmp / "tokenizer_config.json").write_text(json.dumps(meta, indent=2) + "\n")
        if directory.exists():  # beside what it keeps: the files moved in one by one, config.json last
            for f in sorted(tmp.iterdir(), key=lambda f: f.name == "config.json"):
                os.replace(f, directory / f.name)
        else:
            os.rename(tmp, directory)
    except OSError as exc:
        raise CheckpointError(f"cannot write {directory}: {exc}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
