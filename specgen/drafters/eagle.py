"""An EAGLE layer (Li et al., 2024): its weights in EAGLE's public layout (SafeAILab's `model.safetensors` or
`pytorch_model.bin`), loading, saving, the shipped one, and its reference pass (Paddle's operators, any
backend; the fused backend runs specgen_eagle_pass instead). The drafting (trees, catch-up) is
engine/proposers/eagle.py's.

The layer: at position i, x = fc([embedding of token i + 1; feature at i]) (+ fc.bias), one Llama decoder
layer (`layers.0.*`; EAGLE-1's layer 0 has no input norm, a layer that has `input_layernorm` uses it), then an
optional final norm (`norm.weight`); that output feature feeds the main model's LM head (the distribution of
token i + 2) and is the next draft's feature input. Embedding and LM head are the main model's.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import paddle

from specgen.backends.base import ModelView
from specgen.drafters.eagle_pass import EaglePass
from specgen.drafters.mtp import _block_config, load_draft_vocab
from specgen.errors import CheckpointError
from specgen.layers.block import DecoderBlock
from specgen.layers.linear import Linear
from specgen.models.config import ModelConfig
from specgen.models.model import Model
from specgen.models.weights import TensorReader


@dataclass
class EagleWeights:
    """The draft layer; embedding and LM head are the main model's (the LM head's draft-vocabulary
    columns)."""

    embed: paddle.Tensor  # [vocab, hidden]
    fc: Linear  # [2 hidden] -> [hidden]: [embedding; feature], with EAGLE's bias when the checkpoint has one
    block: DecoderBlock  # attn_norm None: no input norm (EAGLE-1's layer 0)
    norm: paddle.Tensor | None  # [hidden] final norm of the output feature (EAGLE-3, specgen's training);
    # None: none
    lm_head: Linear  # [hidden] -> [vocab] the main model's (a runner keeps the draft vocabulary's columns)
    draft_vocab: np.ndarray | None  # [draft vocab] int64 token id of each LM-head column; None: all

    fused = "eagle"  # the fused backend's own pass for it (specgen_eagle_pass)

    def token_ids(self, columns: np.ndarray) -> np.ndarray:
        return columns if self.draft_vocab is None else self.draft_vocab[columns]

    def reference_pass(self, model: ModelView) -> "EaglePass":
        return EaglePass(model, self)


def eagle_config(cfg: ModelConfig) -> dict:
    """config.json of an EAGLE layer for a main model of config `cfg` (a one-layer Llama, EAGLE's)."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 1,
            "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
            "max_position_embeddings": cfg.max_position_embeddings, "vocab_size": cfg.vocab_size,
            "bias": True}


def read_eagle(weights: dict[str, np.ndarray], source: str, main: Model,
               draft_vocab: np.ndarray | None = None) -> EagleWeights:
    """The layer from EAGLE's layout: fc.weight [hidden, 2 hidden] (+ fc.bias), layers.0.* one decoder layer
    (input_layernorm optional), norm.weight optional; an embed_tokens.weight or lm_head.weight of its own is
    refused (EAGLE shares the main model's)."""
    if "fc.weight" not in weights or not any(n.startswith("layers.0.") for n in weights):
        raise CheckpointError(f"{source}: not an EAGLE layer (expected fc.weight and layers.0.*)")
    extra = sorted(n for n in weights if n.startswith("layers.") and not n.startswith("layers.0."))
    if extra:
        raise CheckpointError(f"{source}: EAGLE layers past the first are not supported ({extra[0]})")
    if "lm_head.weight" in weights:
        raise CheckpointError(f"{source}: an EAGLE layer with its own LM head is not supported (it shares "
                              "the main model's)")
    cfg = main.config
    h = cfg.hidden_size
    norm_name = "layers.0.input_layernorm.weight"
    has_norm = norm_name in weights
    block_weights = weights if has_norm else {**weights, norm_name: np.ones(h, np.float32)}
    r = TensorReader(block_weights, source, _block_config(cfg, weights), main.dtype)
    block = r.block("layers.0.")
    if not has_norm:
        block = dataclasses.replace(block, attn_norm=None)
    if draft_vocab is not None:
        ids = np.asarray(draft_vocab)
        if (ids.ndim != 1 or not len(ids) or ids.dtype.kind not in "iu" or ids.min() < 0
                or ids.max() >= cfg.vocab_size):
            raise CheckpointError(f"{source}: draft vocabulary must be token ids in [0, {cfg.vocab_size})")
        draft_vocab = ids.astype(np.int64)
    return EagleWeights(
        embed=main.weights.embed,
        fc=r.linear(["fc.weight"], [(h, 2 * h)], ["fc.bias"] if "fc.bias" in weights else None),
        block=block, norm=r.param("norm.weight", (h,)) if "norm.weight" in weights else None,
        lm_head=main.weights.lm_head, draft_vocab=draft_vocab)


def load_eagle(path: str | Path, main: Model):
    """An EAGLE checkpoint: a directory with model.safetensors or pytorch_model.bin (SafeAILab's layout; or
    their shards), or one such file, and an optional draft_vocab.npy beside it; an EAGLE-3 one (midlayer.*)
    gives Eagle3Weights."""
    from specgen.drafters.eagle3 import configured_features, is_eagle3, read_eagle3
    from specgen.models.hf_loader import _weight_files, read_weights
    from specgen.models.torch_file import TORCH_SUFFIXES

    p = Path(path)
    if p.is_file() and p.suffix in (".safetensors", *TORCH_SUFFIXES):
        files, d = [p], p.parent
    elif p.is_dir():
        files, d = _weight_files(p), p
    else:
        raise CheckpointError(f"{p}: no EAGLE checkpoint (a directory with model.safetensors or "
                              "pytorch_model.bin, or such a file)")
    weights = read_weights(files)
    if is_eagle3(weights):
        return read_eagle3(weights, str(p), main, configured_features(d, main.config.num_layers))
    return read_eagle(weights, str(p), main, load_draft_vocab(d))


SHIPPED = Path(__file__).resolve().parents[1] / "assets" / "eagle" / "smollm2-135m-instruct"

def shipped_eagle(source: str) -> Path | None:
    """The package's EAGLE layer when the main model is the default one and one ships."""
    from specgen.models.default_model import DEFAULT_GGUF

    if Path(source).name != DEFAULT_GGUF or not (SHIPPED / "model.safetensors").is_file():
        return None
    return SHIPPED


def save_eagle(directory: str | Path, weights: dict[str, np.ndarray], cfg: ModelConfig,
               extra: dict | None = None):
    """An EAGLE layer's weights (EAGLE's names, HF [out, in]) as model.safetensors + config.json."""
    from safetensors.numpy import save_file

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in weights.items()}, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({**eagle_config(cfg), **(extra or {})}, indent=2))


