"""Loads HF checkpoint directories: config.json, safetensors (single or sharded), tokenizer files."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from specgen.errors import CheckpointError
from specgen.models.checkpoint import SAFETENSORS_DTYPES, Checkpoint, Lazy, SafetensorsFile
from specgen.models.config import ARCHITECTURES, ModelConfig, MoeConfig, RopeScaling
from specgen.models.tokenizer import TextTokenizer


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: cannot read JSON ({exc})") from None


def _rope_scaling(cfg: dict[str, Any], path: Path) -> RopeScaling | None:
    rs = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not rs:
        return None
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise CheckpointError(f"{path}: rope_scaling type {kind!r} is not supported (supported: llama3)")
    return RopeScaling(
        factor=float(rs["factor"]),
        low_freq_factor=float(rs["low_freq_factor"]),
        high_freq_factor=float(rs["high_freq_factor"]),
        original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
    )


def _eos_ids(directory: Path, cfg: dict[str, Any]) -> tuple[int, ...]:
    gen_path = directory / "generation_config.json"
    eos = _read_json(gen_path).get("eos_token_id") if gen_path.exists() else None
    if eos is None:
        eos = cfg.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))


def _moe(cfg: dict[str, Any], arch: str) -> MoeConfig | None:
    """The routing of a qwen3_moe / ernie4_5_moe config.json (either spelling of the expert count), as
    transformers' decoder layers decide which blocks are routed."""
    layers = int(cfg["num_hidden_layers"])
    if arch == "qwen3_moe":
        num = int(cfg.get("num_experts", cfg.get("num_local_experts", 0)))
        step, dense = int(cfg.get("decoder_sparse_step", 1)), set(cfg.get("mlp_only_layers") or [])
        routed = tuple(i for i in range(layers) if i not in dense and num > 0 and (i + 1) % step == 0)
        return MoeConfig(num, int(cfg["num_experts_per_tok"]), int(cfg["moe_intermediate_size"]), routed,
                         bool(cfg.get("norm_topk_prob", False)))
    if arch == "ernie4_5_moe":
        num = int(cfg.get("moe_num_experts", cfg.get("num_experts", 0)))
        start, interval = int(cfg.get("moe_layer_start_index", 1)), int(cfg.get("moe_layer_interval", 1))
        end = int(cfg.get("moe_layer_end_index", -1))
        end = layers - 1 if end == -1 else end
        routed = tuple(i for i in range(layers) if (i + 1) % interval == 0 and start <= i <= end)
        return MoeConfig(num, int(cfg.get("moe_k", cfg.get("num_experts_per_tok", 0))),
                         int(cfg["moe_intermediate_size"]), routed, True,
                         float(cfg.get("moe_norm_min", 1e-12)),
                         int(cfg.get("moe_num_shared_experts", 0)), True)
    return None


def parse_config(directory: Path) -> ModelConfig:
    path = directory / "config.json"
    cfg = _read_json(path)
    archs = cfg.get("architectures") or []
    arch = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        raise CheckpointError(
            f"{path}: unsupported architecture {archs or cfg.get('model_type')!r} "
            f"(supported: {', '.join(sorted(ARCHITECTURES))})"
        )
    try:
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        use_bias = bool(cfg.get("use_bias", False))
        ernie = arch in ("ernie4_5", "ernie4_5_moe")
        rope_theta = cfg.get("rope_theta")
        if rope_theta is None:
            rope_theta = (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        return ModelConfig(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", ernie)),
            rope_scaling=_rope_scaling(cfg, path),
            qkv_bias=arch == "qwen2" or (ernie and use_bias) or bool(cfg.get("attention_bias")),
            o_bias=(ernie and use_bias) or (arch == "llama" and bool(cfg.get("attention_bias"))),
            mlp_bias=(ernie and use_bias) or bool(cfg.get("mlp_bias", False)),
            qk_norm=arch in ("qwen3", "qwen3_moe"),
            rope_interleaved=ernie,
            eos_token_ids=_eos_ids(directory, cfg),
            bos_token_id=cfg.get("bos_token_id"),
            moe=_moe(cfg, arch),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{path}: missing or bad field {exc}") from None


def _weight_files(directory: Path) -> list[Path]:
    """The checkpoint's weight files: model.safetensors (or its shards), else pytorch_model.bin (or its
    shards), which models/torch_file.py reads without running code from them."""
    for single, index in (("model.safetensors", "model.safetensors.index.json"),
                          ("pytorch_model.bin", "pytorch_model.bin.index.json")):
        if (directory / index).exists():
            names = sorted(set(_read_json(directory / index).get("weight_map", {}).values()))
            if not names:
                raise CheckpointError(f"{directory / index}: empty weight_map")
            return [directory / n for n in names]
        if (directory / single).exists():
            return [directory / single]
    raise CheckpointError(f"{directory}: no model.safetensors or pytorch_model.bin (or their "
                          ".index.json)")


def read_weights(files: list[Path]) -> Lazy[np.ndarray]:
    """The tensors of safetensors files or of torch.save files (.bin, .pt, .pth), by the files' suffix."""
    from specgen.models.torch_file import TORCH_SUFFIXES, read_torch_files

    if files and all(f.suffix in TORCH_SUFFIXES for f in files):
        return read_torch_files(files)
    return read_safetensors(files)


def read_safetensors(files: list[Path]) -> Lazy[np.ndarray]:
    """Every tensor of the shards as float32 (F32, F16, BF16 and the other types numpy knows; BF16, which
    numpy does not, widened exactly from its bits), each read from its file when asked for: the headers are
    read and checked here, the data when a load asks for a tensor."""
    where: dict[str, SafetensorsFile] = {}
    for f in files:
        if not f.exists():
            raise CheckpointError(f"{f}: weight shard not found")
        try:
            shard = SafetensorsFile.open(f)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{f}: cannot read safetensors ({exc})") from None
        for name, t in shard.tensors.items():
            if t["dtype"] not in SAFETENSORS_DTYPES:
                raise CheckpointError(f"{f}: tensor {name!r} has dtype {t['dtype']}, which is not supported")
            where[name] = shard
    return Lazy({n: shard.shape(n) for n, shard in where.items()}, lambda n: where[n].read(n))


def load_tokenizer(directory: Path) -> TextTokenizer | None:
    tok_path = directory / "tokenizer.json"
    if not tok_path.exists():
        return None
    try:
        tok = Tokenizer.from_file(str(tok_path))
    except Exception as exc:  # tokenizers raises a plain Exception for a malformed file
        raise CheckpointError(f"{tok_path}: cannot read tokenizer ({exc})") from None
    tcfg_path = directory / "tokenizer_config.json"
    tcfg = _read_json(tcfg_path) if tcfg_path.exists() else {}

    def _tok(value: Any) -> str | None:
        return value.get("content") if isinstance(value, dict) else value

    template = tcfg.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    jinja = directory / "chat_template.jinja"
    if template is None and jinja.exists():
        template = jinja.read_text(encoding="utf-8")
    return TextTokenizer(
        tokenizer=tok,
        chat_template=template,
        bos_token=_tok(tcfg.get("bos_token")),
        eos_token=_tok(tcfg.get("eos_token")),
        add_bos_token=bool(tcfg.get("add_bos_token", False)),
    )


def load_hf_dir(directory: str | Path) -> Checkpoint:
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a directory")
    config = parse_config(directory)
    weights = read_weights(_weight_files(directory))
    return Checkpoint(config=config, weights=weights, tokenizer=load_tokenizer(directory),
                      source=str(directory))
