"""EAGLE-3 (Li et al., 2025): an EAGLE layer that reads the main model's hidden states at several depths, with
its own LM head over a draft vocabulary: its weights, loading, saving and pass (Paddle's operators, on both
backends). The trees are EAGLE-2's (engine/proposers/eagle.py's EagleProposer); only the layer differs.

The layer (public layout, SafeAILab's and what vLLM / SGLang serve): at a committed position i the features
are the inputs of the main model's blocks `features` (by default the reference's choice: blocks 2, L // 2 and
L - 3 of L; `eagle_aux_hidden_state_layer_ids` in config.json, or under its `eagle_config`, names others),
side by side, and `fc` [hidden, C hidden] folds them to one hidden state h. Then, with e the embedding of
token i + 1 (the main model's), `midlayer`: a Llama decoder layer whose attention reads [input_layernorm(e);
hidden_norm(h)] (2 hidden wide: q/k/v [*, 2 hidden]) and whose residual stream starts at h;
post_attention_layernorm and the MLP as usual. Its output (before any norm) is the feature of the next depth
(no fc: a drafted position has no main-model features); `lm_head(norm(output))` scores the draft vocabulary,
column c being token c + d2t[c]. `t2d` (the inverse map, a mask over the main vocabulary) is not needed.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import paddle

from specgen.backends.base import ModelView
from specgen.drafters.eagle_pass import Eagle3Pass
from specgen.errors import CheckpointError
from specgen.layers.block import DecoderBlock
from specgen.layers.linear import Linear
from specgen.models.checkpoint import Lazy, tensor_shape
from specgen.models.model import Model
from specgen.models.weights import TensorReader

PREFIX = "midlayer."


@dataclass
class Eagle3Weights:
    """An EAGLE-3 layer's weights; the embedding is the main model's."""

    embed: paddle.Tensor  # [vocab, hidden]
    fc: Linear  # [C hidden] -> [hidden]: the main model's features at blocks `features`, side by side
    input_norm: paddle.Tensor  # [hidden] on the embedding
    hidden_norm: paddle.Tensor  # [hidden] on the feature
    block: DecoderBlock  # qkv [2 hidden] -> [(H + 2 KV) D], o, mlp_norm, gate_up, down (attn_norm None)
    norm: paddle.Tensor  # [hidden] before the LM head
    lm_head: Linear  # [hidden] -> [draft vocab], its own
    draft_vocab: np.ndarray | None  # [draft vocab] int64 token id of each LM-head column; None: all
    features: tuple[int, ...]  # main-model blocks whose inputs fc reads, in fc's order

    fused = None  # no fused pass: both backends run the reference pass

    def token_ids(self, columns: np.ndarray) -> np.ndarray:
        return columns if self.draft_vocab is None else self.draft_vocab[columns]

    def reference_pass(self, model: ModelView) -> "Eagle3Pass":
        return Eagle3Pass(model, self)


def is_eagle3(weights) -> bool:
    return any(n.startswith(PREFIX) for n in weights)


def default_features(num_layers: int) -> tuple[int, ...]:
    """The reference's blocks: the inputs of blocks 2, L // 2 and L - 3 (within the model's blocks), in
    ascending order (as the reference collects them walking the layers)."""
    return tuple(sorted(int(np.clip(i, 0, num_layers - 1)) for i in (2, num_layers // 2, num_layers - 3)))


def configured_features(directory: Path | None, num_layers: int) -> tuple[int, ...]:
    """config.json's eagle_aux_hidden_state_layer_ids (top level or under eagle_config), else the default."""
    config: dict[str, Any] = {}
    if directory is not None and (directory / "config.json").is_file():
        try:
            config = json.loads((directory / "config.json").read_text())
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{directory / 'config.json'}: cannot read JSON ({exc})") from None
    ids = config.get("eagle_aux_hidden_state_layer_ids") or \
        (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        return default_features(num_layers)
    if not all(isinstance(i, int) and 0 <= i <= num_layers for i in ids):
        raise CheckpointError(f"{directory}: eagle_aux_hidden_state_layer_ids {ids} must be block indices in "
                              f"[0, {num_layers}]")
    return tuple(sorted(ids))  # the reference collects them walking the layers: fc reads them in that order


def read_eagle3(weights, source: str, main: Model, features: tuple[int, ...]) -> Eagle3Weights:
    """The layer from EAGLE-3's layout: fc.weight [hidden, C hidden], midlayer.* (self_attn.{q,k,v}_proj over
    2 hidden, o_proj, input_layernorm, hidden_norm, post_attention_layernorm, mlp), norm.weight,
    lm_head.weight [draft vocab, hidden] and d2t [draft vocab] (absent: the full vocabulary, in order)."""
    cfg = main.config
    h, hd = cfg.hidden_size, cfg.head_dim
    weights = Lazy.held(weights, tensor_shape)
    if len(features) < 2:
        raise CheckpointError(f"{source}: EAGLE-3 reads two or more main-model depths, got {list(features)}")
    for name in ("fc.weight", "lm_head.weight", PREFIX + "mlp.gate_proj.weight"):
        if name not in weights:
            raise CheckpointError(f"{source}: not an EAGLE-3 layer ({name} missing)")
    a, m = PREFIX + "self_attn.", PREFIX + "mlp."
    norms = ("input_layernorm", "hidden_norm", "post_attention_layernorm")
    known = {"fc.weight", "fc.bias", "norm.weight", "lm_head.weight", "d2t", "t2d", "embed_tokens.weight",
             *(a + f"{n}_proj.weight" for n in "qkvo"), *(PREFIX + f"{n}.weight" for n in norms),
             *(m + f"{n}_proj.weight" for n in ("gate", "up", "down"))}
    extra = sorted(set(weights) - known)
    if extra:  # (attention biases, a second layer, ...: not what the layer runs)
        raise CheckpointError(f"{source}: {extra[0]!r} is not a weight of an EAGLE-3 layer")
    inter = int(weights.info[PREFIX + "mlp.gate_proj.weight"][0])
    draft = int(weights.info["lm_head.weight"][0])
    r = TensorReader(weights, source, cfg, main.dtype)
    q_out, kv_out = cfg.num_heads * hd, cfg.num_kv_heads * hd
    block = DecoderBlock(
        attn_norm=None,
        qkv=r.linear([a + f"{n}_proj.weight" for n in "qkv"],
                     [(q_out, 2 * h), (kv_out, 2 * h), (kv_out, 2 * h)]),
        o=r.linear([a + "o_proj.weight"], [(h, q_out)]),
        mlp_norm=r.param(PREFIX + "post_attention_layernorm.weight", (h,)),
        gate_up=r.linear([m + "gate_proj.weight", m + "up_proj.weight"], [(inter, h), (inter, h)]),
        down=r.linear([m + "down_proj.weight"], [(h, inter)]))
    vocab = None
    if "d2t" in weights:
        d2t = np.asarray(weights["d2t"]).astype(np.int64).reshape(-1)
        if len(d2t) != draft:
            raise CheckpointError(f"{source}: d2t has {len(d2t)} entries for an LM head of {draft} tokens")
        vocab = np.arange(draft, dtype=np.int64) + d2t
        if vocab.min() < 0 or vocab.max() >= cfg.vocab_size or len(np.unique(vocab)) != draft:
            raise CheckpointError(f"{source}: d2t maps the draft vocabulary outside [0, {cfg.vocab_size}) or "
                                  "onto one token twice")
    elif draft != cfg.vocab_size:
        raise CheckpointError(f"{source}: an LM head of {draft} tokens needs d2t (the main vocabulary has "
                              f"{cfg.vocab_size})")
    return Eagle3Weights(
        embed=main.weights.embed,
        fc=r.linear(["fc.weight"], [(h, len(features) * h)], ["fc.bias"] if "fc.bias" in weights else None),
        input_norm=r.param(PREFIX + "input_layernorm.weight", (h,)),
        hidden_norm=r.param(PREFIX + "hidden_norm.weight", (h,)),
        block=block, norm=r.param("norm.weight", (h,)),
        lm_head=r.linear(["lm_head.weight"], [(draft, h)]),
        draft_vocab=vocab, features=tuple(features))


def eagle3_config(cfg, features: tuple[int, ...], draft_vocab: int) -> dict:
    """config.json of an EAGLE-3 layer for a main model of config `cfg` (the reference's fields)."""
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
            "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
            "max_position_embeddings": cfg.max_position_embeddings, "vocab_size": cfg.vocab_size,
            "draft_vocab_size": draft_vocab,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(features)}}


def save_eagle3(directory: str | Path, weights: dict[str, np.ndarray], cfg, features: tuple[int, ...],
                extra: dict | None = None) -> None:
    """An EAGLE-3 layer's weights (its public names, HF [out, in]; d2t int64) as model.safetensors +
    config.json."""
    from safetensors.numpy import save_file

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in weights.items()}, str(d / "model.safetensors"))
    config = {**eagle3_config(cfg, features, int(weights["lm_head.weight"].shape[0])), **(extra or {})}
    (d / "config.json").write_text(json.dumps(config, indent=2))


