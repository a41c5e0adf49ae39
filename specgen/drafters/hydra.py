"""Hydra heads (Ankner et al., 2024): their weights in the public layout (zankner/Hydra, `hydra_head_arch:
"mlp"`, `grounded_heads: true`): `config.json` (hydra_num_heads, hydra_num_layers) and the head's state dict,
`hydra_lm_head.safetensors` or the repository's `hydra_lm_head.pt` (its `input_embed_fn.weight` is the main
model's embedding, not read): `hydra_mlp.{d}.0.linear.*` and `.res_connection.*` ([hidden, (d + 2) hidden]:
res(x) + SiLU(linear(x)) over [hidden state; emb(root); emb(draft 1); ...; emb(draft d)]),
`hydra_mlp.{d}.{j}.linear.*` for the later residual blocks x + SiLU(linear(x)), and `hydra_lm_head.{d}.weight`
/ `.bias`. Heads without `hydra_lm_head.*` share the main model's LM head (as `specgen train-head --kind
hydra` saves them), and `draft_vocab.npy` restricts guesses as for Medusa. The drafting is
engine/proposers/hydra.py's.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import paddle
import paddle.nn.functional as F

from specgen.drafters.medusa import MedusaHeads, checked_vocab
from specgen.errors import CheckpointError

WEIGHTS = "hydra_lm_head.safetensors"

TORCH_WEIGHTS = "hydra_lm_head.pt"


EMBED = "input_embed_fn.weight"  # the main model's embedding in a saved head's state dict (not read)

_KEY = re.compile(r"^hydra_(?:mlp\.(\d+)\.(\d+)\.(linear|res_connection)|lm_head\.(\d+))\.(weight|bias)$")


@dataclass(frozen=True)
class HydraBlock:
    """One residual block, Paddle's [in, out] orientation: res(x) + SiLU(x w + b), res the identity or
    x rw + rb."""

    w: paddle.Tensor  # [in, hidden]
    b: paddle.Tensor  # [hidden]
    rw: paddle.Tensor | None = None  # [in, hidden] (a head's first block, whose input is wider)
    rb: paddle.Tensor | None = None  # [hidden]

    def __call__(self, x: paddle.Tensor) -> paddle.Tensor:
        res = x if self.rw is None else paddle.matmul(x, self.rw) + self.rb
        return res + F.silu(paddle.matmul(x, self.w) + self.b)


@dataclass(frozen=True)
class HydraHeads(MedusaHeads):
    """MedusaHeads whose blocks are HydraBlocks and whose LM heads may have biases."""

    lm_bias: list[paddle.Tensor] | None = None  # [K] [vocab]


def _read_state(directory: Path) -> dict[str, np.ndarray]:
    """The heads' tensors (safetensors in any float type, or the repository's torch state dict, read without
    running code from it)."""
    from specgen.models.hf_loader import read_weights

    for name in (WEIGHTS, TORCH_WEIGHTS):
        if (directory / name).is_file():
            return read_weights([directory / name])
    raise CheckpointError(f"{directory}: no Hydra heads ({WEIGHTS} or {TORCH_WEIGHTS} beside a config.json)")


def load_hydra(path: str | Path, hidden: int, vocab: int, dtype: str) -> HydraHeads:
    """The heads of a Hydra checkpoint directory, checked against its config and the main model's sizes."""
    from specgen.drafters.mtp import load_draft_vocab

    path = Path(path)
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: no readable Hydra config.json ({exc})") from None
    if config.get("hydra_head_arch", "mlp") != "mlp" or not config.get("grounded_heads", True) \
            or config.get("hidden_state_offset", 0) != 0:
        raise CheckpointError(f"{path}: only Hydra's grounded \"mlp\" heads on the last hidden state are "
                              f"supported (hydra_head_arch {config.get('hydra_head_arch')!r}, grounded_heads "
                              f"{config.get('grounded_heads')}, hidden_state_offset "
                              f"{config.get('hidden_state_offset')})")
    state = _read_state(path)
    for key in state:
        if key == EMBED:  # the main model's embedding, which the saved head holds as a submodule
            if tuple(state.info[key]) != (vocab, hidden):
                raise CheckpointError(f"{path}: {EMBED} should be {[vocab, hidden]} (the main model's "
                                      f"embedding), got {list(state.info[key])}")
        elif _KEY.match(key) is None:
            raise CheckpointError(f"{path}: {key!r} is not a Hydra mlp head weight")
    K, layers = int(config.get("hydra_num_heads", 0)), int(config.get("hydra_num_layers", 0))
    if K < 1 or layers < 1:
        raise CheckpointError(f"{path}: config.json needs hydra_num_heads and hydra_num_layers >= 1")

    def tensor(key: str, shape: tuple[int, ...]) -> paddle.Tensor:
        w = state.get(key)
        if w is None or w.shape != shape:
            raise CheckpointError(f"{path}: {key} should be {list(shape)} (the main model's hidden {hidden}, "
                                  f"vocabulary {vocab}), got {None if w is None else list(w.shape)}")
        return paddle.to_tensor(np.ascontiguousarray(w.T if w.ndim == 2 else w).astype(dtype))

    blocks = []
    for d in range(K):
        width = (d + 2) * hidden
        first = HydraBlock(tensor(f"hydra_mlp.{d}.0.linear.weight", (hidden, width)),
                           tensor(f"hydra_mlp.{d}.0.linear.bias", (hidden,)),
                           tensor(f"hydra_mlp.{d}.0.res_connection.weight", (hidden, width)),
                           tensor(f"hydra_mlp.{d}.0.res_connection.bias", (hidden,)))
        blocks.append([first] + [HydraBlock(tensor(f"hydra_mlp.{d}.{j}.linear.weight", (hidden, hidden)),
                                            tensor(f"hydra_mlp.{d}.{j}.linear.bias", (hidden,)))
                                 for j in range(1, layers)])
    shared = "hydra_lm_head.0.weight" not in state
    lm = None if shared else [tensor(f"hydra_lm_head.{d}.weight", (vocab, hidden)) for d in range(K)]
    bias = None if shared or "hydra_lm_head.0.bias" not in state else \
        [tensor(f"hydra_lm_head.{d}.bias", (vocab,)) for d in range(K)]
    return HydraHeads(blocks, lm, checked_vocab(load_draft_vocab(path), vocab, path), lm_bias=bias)


def save_hydra(path: str | Path, blocks: list[list[dict[str, np.ndarray]]],
               lm_heads: list[np.ndarray] | None, extra: dict | None = None) -> None:
    """Heads in the public layout: blocks [K][layers] {"w" [hidden, in], "b", and the first block's "rw",
    "rb"} in torch's orientation; lm_heads None: shared with the main model."""
    from safetensors.numpy import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    names = {"w": "linear.weight", "b": "linear.bias", "rw": "res_connection.weight",
             "rb": "res_connection.bias"}
    tensors = {f"hydra_mlp.{d}.{j}.{names[k]}": v for d, layers in enumerate(blocks)
               for j, block in enumerate(layers) for k, v in block.items()}
    for d, lm in enumerate(lm_heads or []):
        tensors[f"hydra_lm_head.{d}.weight"] = lm
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(path / WEIGHTS))
    config = {"hydra_num_heads": len(blocks), "hydra_num_layers": len(blocks[0]), "hydra_head_arch": "mlp",
              "grounded_heads": True, "hidden_state_offset": 0, **(extra or {})}
    (path / "config.json").write_text(json.dumps(config, indent=2))
