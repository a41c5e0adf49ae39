"""Medusa heads (Cai et al., 2024): their weights in the public layouts (FasterDecoding/Medusa's
`medusa_lm_head.safetensors` or `.pt`, keys `{head}.{layer}.linear.weight` / `.bias` and
`{head}.{num_layers}.weight`, torch's [out, in], an optional `medusa_head.` prefix; or vLLM's conversion,
`blocks.{head}.layers.{layer}.weight` / `.bias`, `lm_heads.{head}.weight` and a `token_map`), loading, saving
and the shipped ones. Heads without `{head}.{num_layers}.weight` share the main model's LM head (`specgen
train-head --kind medusa` saves them so), and a `draft_vocab.npy` beside them restricts their guesses to those
tokens. The drafting (the heads' pass and token trees) is engine/proposers/medusa.py's.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import paddle

from specgen.errors import CheckpointError

WEIGHTS = "medusa_lm_head.safetensors"

# the other files a Medusa checkpoint comes as: the repository's torch state dict, and vLLM's conversion
FILES = (WEIGHTS, "medusa_lm_head.pt", "model.safetensors", "pytorch_model.bin")


_KEY = re.compile(r"^(?:medusa_head\.)?(\d+)\.(\d+)\.(linear\.weight|linear\.bias|weight)$")

# vLLM's names: blocks.{head}.layers.{layer}.weight / .bias, lm_heads.{head}.weight, token_map
_VLLM_KEY = re.compile(r"^(?:medusa_heads\.)?(?:blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)"
                       r"|lm_heads\.(\d+)\.weight|(token_map))$")


@dataclass(frozen=True)
class MedusaHeads:
    """K heads' weights in Paddle's [in, out] orientation."""

    blocks: list[list[tuple[paddle.Tensor, paddle.Tensor]]]  # [K][num_layers] (W [hidden, hidden],
    # b [hidden])
    lm_heads: list[paddle.Tensor] | None  # [K] [hidden, vocab]; None: the main model's LM head, shared
    draft_vocab: np.ndarray | None = None  # [draft_vocab] int64 the tokens guesses are drawn from (None: all)
    lm_draft_columns: bool = False  # lm_heads hold the draft vocabulary's columns only (vLLM's token_map)

    @property
    def num_heads(self) -> int:
        return len(self.blocks)


def load_medusa(path: str | Path, hidden: int, vocab: int, dtype: str) -> MedusaHeads:
    """The heads of a Medusa checkpoint (a directory holding one of FILES, or such a file: FasterDecoding's
    names or vLLM's, safetensors in any float type or a torch state dict), checked against the main model's
    hidden size and vocabulary."""
    from specgen.drafters.mtp import load_draft_vocab
    from specgen.models.hf_loader import read_weights

    path = Path(path)
    file = next((path / f for f in FILES if (path / f).is_file()), path) if path.is_dir() else path
    if not file.is_file():
        raise CheckpointError(f"{path}: no Medusa heads ({' or '.join(FILES)}: keys 0.0.linear.weight ... "
                              "or vLLM's blocks.0.layers.0.weight ...)")
    weights = read_weights([file])
    config = _config(file.parent)
    if any(_VLLM_KEY.match(k) for k in weights) and not any(_KEY.match(k) for k in weights):
        found, token_map = _vllm_names(weights, file, config)
    else:
        found, token_map = {}, None
        for key in weights:
            m = _KEY.match(key)
            if m is None:
                raise CheckpointError(f"{file}: {key!r} is not a Medusa head weight "
                                      f"({{head}}.{{layer}}.linear.weight, "
                                      f"{{head}}.{{layer}}.linear.bias or {{head}}.{{num_layers}}.weight)")
            found[(int(m[1]), int(m[2]), m[3])] = weights[key]
    heads = sorted({h for h, _, _ in found})
    if heads != list(range(len(heads))) or not heads:
        raise CheckpointError(f"{file}: Medusa heads must be numbered 0..K-1, found {heads}")
    linear = [i for _, i, kind in found if kind != "weight"]
    layers = max(linear) + 1 if linear else 0
    shared = not any(kind == "weight" for _, _, kind in found)  # no LM heads: the main model's is shared
    draft_vocab = checked_vocab(token_map if token_map is not None else
                                load_draft_vocab(path) if path.is_dir() else None, vocab, file)
    lm_rows = vocab if token_map is None else len(draft_vocab)

    def tensor(h: int, i: int, kind: str, shape: tuple[int, ...]) -> paddle.Tensor:
        w = found.get((h, i, kind))
        if w is None and kind == "linear.bias":  # vLLM's heads without medusa_fc_bias
            w = np.zeros(shape, np.float32)
        if w is None or w.shape != shape:
            raise CheckpointError(f"{file}: head {h} {i}.{kind} should be {list(shape)} (the main model's "
                                  f"hidden {hidden}, vocabulary {vocab}), got "
                                  f"{None if w is None else list(w.shape)}")
        return paddle.to_tensor(np.ascontiguousarray(w.T if w.ndim == 2 else w).astype(dtype))

    return MedusaHeads(
        blocks=[[(tensor(h, i, "linear.weight", (hidden, hidden)), tensor(h, i, "linear.bias", (hidden,)))
                 for i in range(layers)] for h in heads],
        lm_heads=None if shared else [tensor(h, layers, "weight", (lm_rows, hidden)) for h in heads],
        draft_vocab=draft_vocab, lm_draft_columns=token_map is not None and not shared)


def _config(directory: Path) -> dict:
    import json

    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def _vllm_names(weights, file: Path, config: dict) -> tuple[dict, np.ndarray | None]:
    """vLLM's converted heads as FasterDecoding's (head, layer, kind) keys, and its token_map (the token id of
    each LM-head row, when the heads' vocabulary is truncated). With `original_lm_head` every head uses head
    0's LM head, as vLLM does."""
    found: dict[tuple[int, int, str], np.ndarray] = {}
    lm: dict[int, np.ndarray] = {}
    token_map = None
    for key in weights:
        m = _VLLM_KEY.match(key)
        if m is None:
            raise CheckpointError(f"{file}: {key!r} is not a Medusa head weight in vLLM's names "
                                  "(blocks.{head}.layers.{layer}.weight / .bias, lm_heads.{head}.weight, "
                                  "token_map)")
        if m[5]:
            token_map = np.asarray(weights[key]).astype(np.int64)
        elif m[4] is not None:
            lm[int(m[4])] = weights[key]
        else:
            found[(int(m[1]), int(m[2]), "linear." + m[3])] = weights[key]
    layers = 1 + max((i for _, i, _ in found), default=-1)
    heads = sorted({h for h, _, _ in found} | set(lm))
    for h in heads:
        w = lm.get(0 if config.get("original_lm_head") else h)
        if w is not None:
            found[(h, layers, "weight")] = w
    if token_map is not None and len(token_map) == int(config.get("vocab_size", -1)):
        token_map = None if np.array_equal(token_map, np.arange(len(token_map))) else token_map
    return found, token_map


def checked_vocab(ids: np.ndarray | None, vocab: int, source: Path) -> np.ndarray | None:
    """A draft vocabulary's token ids, refused unless they are ids of the main model's vocabulary."""
    if ids is None:
        return None
    ids = np.asarray(ids)
    if ids.ndim != 1 or not len(ids) or ids.dtype.kind not in "iu" or ids.min() < 0 or ids.max() >= vocab:
        raise CheckpointError(f"{source}: the draft vocabulary must be token ids in [0, {vocab})")
    return ids.astype(np.int64)


def save_medusa(path: str | Path, blocks: list[list[tuple[np.ndarray, np.ndarray]]],
                lm_heads: list[np.ndarray] | None, extra: dict | None = None):
    """Heads in the public layout (torch orientation [out, in] given): WEIGHTS and config.json (with `extra`'s
    keys). lm_heads None: the heads share the main model's LM head (no `{head}.{num_layers}.weight`)."""
    import json

    from safetensors.numpy import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for h, layers in enumerate(blocks):
        for i, (w, b) in enumerate(layers):
            tensors[f"{h}.{i}.linear.weight"], tensors[f"{h}.{i}.linear.bias"] = w, b
        if lm_heads is not None:
            tensors[f"{h}.{len(layers)}.weight"] = lm_heads[h]
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(path / WEIGHTS))
    (path / "config.json").write_text(json.dumps({"medusa_num_heads": len(blocks),
                                                  "medusa_num_layers": len(blocks[0]), **(extra or {})},
                                                 indent=2))

# Heads shipped with the package for the default model, trained by `specgen train-head --kind KIND`.
ASSETS = Path(__file__).resolve().parents[1] / "assets"


def shipped_heads(kind: str, source: str) -> Path | None:
    """The package's heads of `kind` (medusa, hydra) when the main model is the default one and they are
    there."""
    from specgen.models.default_model import DEFAULT_GGUF

    path = ASSETS / kind / "smollm2-135m-instruct"
    return path if Path(source).name == DEFAULT_GGUF and (path / "config.json").is_file() else None
