"""Hydra heads (Ankner et al., 2024): Medusa-like heads on the main model's last hidden state, where head d
also reads the embeddings of the tokens on the path so far (the root, then the drafts chosen at depths 1..d),
so the tree is built head by head: depth d + 1's guesses are made under each depth-d node that has children.

The public layout (zankner/Hydra, `hydra_head_arch: "mlp"`, `grounded_heads: true`): `config.json`
(hydra_num_heads, hydra_num_layers) and the head's state dict, `hydra_lm_head.safetensors` (or the
repository's `hydra_lm_head.pt`; its `input_embed_fn.weight` is the main model's embedding, not read):
`hydra_mlp.{d}.0.linear.*` and `.res_connection.*` ([hidden, (d + 2) hidden]: res(x) + SiLU(linear(x)) over
[hidden state; emb(root); emb(draft 1); ...; emb(draft d)]), `hydra_mlp.{d}.{j}.linear.*` for the later
residual blocks x + SiLU(linear(x)), and `hydra_lm_head.{d}.weight` / `.bias`. Heads without
`hydra_lm_head.*` share the main model's LM head (as `specgen train-head --kind hydra` saves them), and
`draft_vocab.npy` restricts guesses as for Medusa.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import paddle
import paddle.nn.functional as F

from specgen.engine.proposers.base import Drafting, checkpoint_key, prepared_once
from specgen.engine.proposers.medusa import (
    MedusaHeads,
    MedusaProposer,
    checked_vocab,
    shared_lm_head,
    shipped_heads,
    tree_to_depth,
)
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
    from specgen.engine.proposers.mtp_head import load_draft_vocab

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
    return HydraHeads(blocks, lm, checked_vocab(load_draft_vocab(path), vocab, path), bias)


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


@dataclass(frozen=True)
class _Level:
    """The template's nodes at one depth d >= 1 (columns of DraftTokens.ids), from their parents at
    depth d - 1."""

    nodes: np.ndarray  # [n_d] int64 columns of the depth-d nodes
    parent: np.ndarray  # [n_d] int64 each node's parent, as a row of the level's inputs
    rank: np.ndarray  # [n_d] int64 each node's rank among its siblings
    expand: np.ndarray  # [p_{d+1}] int64 depth-d nodes with children, as indices into `nodes`


class HydraProposer(MedusaProposer):
    """Token trees built head by head: head d reads [hidden state; emb(root); emb(path's drafts)] of every
    depth-d node with children, for every slot at once."""

    def __init__(self, heads: HydraHeads, topk: int, paths: tuple[tuple[int, ...], ...], embed: paddle.Tensor,
                 lm_head: paddle.Tensor | None = None):
        super().__init__(heads, topk, paths, lm_head)
        self.embed = embed  # [vocab, hidden] the main model's
        vocab = None if heads.draft_vocab is None else paddle.to_tensor(heads.draft_vocab)
        if heads.lm_bias is not None:
            self.lm_bias = [b if vocab is None else paddle.gather(b, vocab) for b in heads.lm_bias]
        # drafts are columns of the draft vocabulary: their embeddings [vocab', hidden], so that the tree is
        # built on the device and copied to the host once
        self.vocab_emb = embed if vocab is None else F.embedding(vocab, embed)
        depth = self.head + 1  # [width] each node's depth
        self.levels = []
        for d in range(1, int(depth.max(initial=0)) + 1):
            nodes = np.nonzero(depth == d)[0]
            parents = self.parents[nodes]  # block indices, at depth d - 1
            above = np.unique(parents)
            nxt = np.isin(nodes + 1, self.parents[depth == d + 1])
            self.levels.append(_Level(nodes, np.searchsorted(above, parents), self.rank[nodes],
                                      np.nonzero(nxt)[0]))
        # per depth, as device index tensors: the nodes' (parent, rank) among the depth's top-k, the nodes
        # with children, and those nodes' parents
        self.picks = [tuple(paddle.to_tensor(a) for a in (lv.parent * self.topk + lv.rank, lv.expand,
                                                          lv.parent[lv.expand])) for lv in self.levels]

    def _prepare_blocks(self) -> None:
        """Each first block's two products as one: [rw | w] [in, 2 hidden] and [rb | b] (Hydra's heads differ
        in width: one product per depth)."""
        self.stacked = None
        self.fused = [(paddle.concat([k[0].rw, k[0].w], axis=1), paddle.concat([k[0].rb, k[0].b]))
                      for k in self.heads.blocks]

    def draft(self, x0: paddle.Tensor, root: np.ndarray) -> np.ndarray:
        n = x0.shape[0]
        # [n, parents at this depth, (d + 2) hidden]: the inputs of the nodes the next depth hangs under
        inputs = paddle.concat([x0, F.embedding(paddle.to_tensor(root), self.embed)], axis=-1).unsqueeze(1)
        columns = []  # [n, n_d] draft-vocabulary columns of each depth's nodes, on the device
        for d, (level, (pick, expand, expand_parent)) in enumerate(zip(self.levels, self.picks)):
            p = inputs.shape[1]
            w, b = self.fused[d]
            res, lin = paddle.split(paddle.matmul(inputs.reshape([n * p, inputs.shape[2]]), w) + b, 2,
                                    axis=-1)
            x = res + F.silu(lin)  # the first block
            for block in self.heads.blocks[d][1:]:
                x = block(x)
            top = self.top(d, x).reshape([n, p * self.topk])  # [n, parents x topk]
            cols = paddle.index_select(top, pick, axis=1)
            columns.append(cols)
            if len(level.expand):
                emb = F.embedding(paddle.index_select(cols, expand, axis=1), self.vocab_emb)
                inputs = paddle.concat([paddle.index_select(inputs, expand_parent, axis=1), emb], axis=-1)
        return self.ids(paddle.concat(columns, axis=1).numpy())  # one host copy; nodes are depth-ordered


def build_hydra_proposer(d: Drafting) -> HydraProposer:
    """--method hydra: the heads at --draft-model (or the package's for the default model), trees of the
    medusa section's shape, k deep at most."""
    model, c = d.model, d.section
    cfg = model.config
    path = d.draft_model or shipped_heads("hydra", str(model.source))
    if path is None:
        raise CheckpointError(f"--method hydra needs --draft-model PATH (Hydra heads: a directory with "
                              f"{WEIGHTS}; `specgen train-head --kind hydra` trains them); heads ship for "
                              "the default model only")
    paths = tree_to_depth(c.tree_paths(), d.k)

    def make() -> HydraProposer:
        heads = load_hydra(path, cfg.hidden_size, cfg.vocab_size, model.dtype)
        return HydraProposer(heads, c.topk, paths, model.weights.embed.astype(model.dtype),
                             shared_lm_head(model, heads.lm_heads))

    return prepared_once(model, checkpoint_key(path, "hydra", c.topk, paths), make).fresh()
