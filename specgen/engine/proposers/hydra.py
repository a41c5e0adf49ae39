"""Hydra heads (Ankner et al., 2024): Medusa-like heads on the main model's last hidden state, where head d
also reads the embeddings of the tokens on the path so far (the root, then the drafts chosen at depths 1..d),
so the tree is built head by head: depth d + 1's guesses are made under each depth-d node that has children.

Their checkpoints (zankner/Hydra's "mlp" heads): specgen/drafters/hydra.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import paddle
import paddle.nn.functional as F

from specgen.drafters.hydra import WEIGHTS, HydraHeads, load_hydra
from specgen.drafters.medusa import shipped_heads
from specgen.engine.proposers.base import Drafting, checkpoint_key, prepared_once
from specgen.engine.proposers.medusa import MedusaProposer, shared_lm_head, tree_to_depth
from specgen.errors import CheckpointError


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
