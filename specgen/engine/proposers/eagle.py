"""EAGLE drafting (Li et al., 2024): a feature-level draft layer grows a token tree for each slot; EAGLE-2's
dynamic tree keeps the nodes of highest cumulative draft probability, or a static shape keeps given paths.

The layer and its checkpoints: specgen/drafters/eagle.py (EAGLE-1/2) and eagle3.py (EAGLE-3). The feature at a
committed position is the main model's final normed hidden state there (what EAGLE's reference code feeds,
`StepUpdate.hidden`), or for EAGLE-3 the inputs of the main model's blocks it names (EagleProposer.features).

Cache: the layer's own KV cache in the slot layout, caught up after every step on the positions whose main
hidden state became known (MtpProposer's catch-up, reused: prompt window, shared prefix, prompt chunks). The
tree is then grown past the last caught-up position: nodes of depth d run at the position of their parent's
feature (root position + d - 1 ... the root is the last committed token), written to scratch rows after the
caught-up ones with an ancestor mask (engine/tree.py's 64-bit masks), overwritten by the next catch-up as
rejected drafts are.

Growing (all slots at once, one pass per depth): depth 1 takes the top-k tokens of the last caught-up
position; each later pass runs the frontier (dynamic: the k candidates of highest cumulative log-probability
at the depth before, EAGLE-2; static: the shape's nodes that have children) and takes the top-k children of
each. The tree offered is the `nodes` candidates of highest cumulative log-probability, in that order (a
parent never scores below its child, so parents come first and every prefix is a tree): the node budget the
controller chooses keeps a prefix, i.e. the budget's most probable nodes. Drafts only: the engine's tree walk
keeps outputs exact.

Copies (EagleConfig.copy, MtpProposer's): a slot whose last copy tokens occurred earlier in its text drafts
what followed there, as a chain in place of its tree (DraftTokens.source 1); its tree is not grown that step.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import paddle

from specgen.drafters.eagle import load_eagle, shipped_eagle
from specgen.drafters.mtp import prompt_window, training_setting
from specgen.engine.proposers.base import Drafting, SlotView, checkpoint_key, prepared_once
from specgen.engine.proposers.medusa import tree_template
from specgen.engine.proposers.mtp import CatchUp, MtpProposer
from specgen.engine.tree import CAUSAL, MAX_TREE_NODES
from specgen.engine.types import DraftTokens
from specgen.errors import CheckpointError
from specgen.models.model import Model

MASK_ROWS = 64  # scratch rows a slot's tree may take: a node must see every other tree row through its mask


@dataclass(frozen=True)
class TreeShape:
    """How trees grow: top-k children per expanded node, and either a dynamic frontier of `topk` nodes per
    depth (EAGLE-2) or a static shape's nodes."""

    topk: int
    nodes: int  # candidates offered per tree (the controller's budget keeps a prefix)
    paths: tuple[tuple[int, ...], ...] = ()  # a static shape (Medusa's choices); empty: dynamic

    def static_nodes(self, depth: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Static shapes: (depth [n], rank [n], parents [n]) of the shape's nodes (tree_template's order)."""
        head, rank, parents = tree_template(self.paths, depth, self.topk)
        return head + 1, rank, parents


class EagleProposer(MtpProposer):
    """Token trees from an EAGLE layer; the catch-up of its cache is MtpProposer's."""

    # a hand-off carries the tree grown at the prompt's last position too (else the first decode
    # step's is empty)
    SLOT_ARRAYS = MtpProposer.SLOT_ARRAYS + ("tree_ids", "tree_parents", "tree_probs")

    def __init__(self, model: Model, runner, k: int, shape: TreeShape,
                 acceptance_hint: float | None = None, prompt_window: int = 0, copy_min: int = 0, lib=None):
        """runner: the layer prepared for the model's backend (prepare_eagle; EaglePass.run's interface);
        copy_min > 0: MtpProposer's copies, offered as a chain in place of the slot's tree
        (DraftTokens.source 1)."""
        self.runner = runner
        # EAGLE-3: the main model's blocks whose inputs are the layer's features (the engine hands them over
        # in place of the final hidden states)
        self.features = tuple(getattr(runner, "features", ()))
        super().__init__(model, [self.runner], k, acceptance_hint, copy_min=copy_min,
                         prompt_window=prompt_window, lib=lib)
        self.shape = shape
        self.width = min(shape.nodes, MAX_TREE_NODES)
        if shape.paths:
            self.width = min(self.width, len(shape.static_nodes(k)[0]))
        front = shape.topk if not shape.paths else int(np.bincount(shape.static_nodes(k)[2]).max(initial=1))
        if shape.topk * (k - 1) > MASK_ROWS or front * (k - 1) > MASK_ROWS:
            raise CheckpointError(f"an EAGLE tree of top-{shape.topk} over {k} depths needs more than "
                                  f"{MASK_ROWS} rows of tree mask")
        self.tree_ids = np.zeros((0, self.width), np.int64)  # [num_slots, width] each slot's tree for its
        # next step
        self.tree_parents = np.zeros((0, self.width), np.int64)  # [num_slots, width] block index of each
        # parent
        self.tree_probs = np.zeros((0, self.width))  # [num_slots, width] the layer's probability of each
        # node's path

    def _ensure(self, num_slots: int) -> None:
        if self.cache is None:
            super()._ensure(num_slots)
            self.caches = [self.runner.new_cache(num_slots)]
            self.cache = self.caches[0]
            self.tree_ids = np.zeros((num_slots, self.width), np.int64)
            self.tree_parents = np.zeros((num_slots, self.width), np.int64)
            self.tree_probs = np.zeros((num_slots, self.width))

    def propose(self, view: SlotView) -> DraftTokens:
        """Each slot's tree; with copies, a copied chain (source 1) where the slot's text repeats. A step
        where no slot has a tree of the layer's offers the copies alone as plain chains: the engine's chain
        path costs less per step than a tree's planning and walk (writing at batch 1, the layer detached:
        0.93x of plain decoding with every step on the tree path)."""
        n, s = len(view.slots), view.slots
        if self.cache is None:
            return DraftTokens.none(n, self.k)
        use = self._copying(view) if self.copy_min and n else np.zeros(n, bool)  # [num_seqs] a copy,
        # not a tree
        source = use.astype(np.int64) if self.copy_min else None  # [num_seqs] 1: a copied chain
        num = self.head_drafts(view)  # [num_seqs] tree nodes
        if not (num[~use] > 0).any():  # [num_seqs, k] chains: the copies, none elsewhere
            return DraftTokens(np.where(use[:, None], self.copy_ids[s], 0),
                               np.where(use, self.copy_num[s], 0), source)
        # [num_seqs, width] each (fancy indexing: copies, not the proposer's rows)
        ids, parents, probs = self.tree_ids[s], self.tree_parents[s], self.tree_probs[s]
        if use.any():
            w = min(self.k, self.width)  # a copied chain within the tree's width
            ids[use] = 0
            ids[use, :w] = self.copy_ids[s[use], :w]
            num = np.where(use, np.minimum(self.copy_num[s], w), num)
            parents[use] = np.arange(self.width)  # a chain: node i's parent is the node before it
            probs[use] = 0.0  # priced from the slot's acceptance of copies, not the layer's probabilities
        return DraftTokens(ids, num, source, parents, probs)

    def _draft(self, c: CatchUp) -> None:
        """The catch-up pass, then each wanting slot's tree (a slot whose last caught-up position is not the
        one before its last token, a prompt chunk with more to come, gets none)."""
        first = np.concatenate([[0], np.cumsum(c.total)[:-1]])  # [num_seqs] first catch-up token of each
        last = c.start + c.total - 1  # [num_seqs] last caught-up main position
        want = c.want & (last == c.seq_lens - 2)
        k1 = self.shape.topk
        feat, vals, ids = self.runner.run(self.cache, c.slots, c.pos[first] - c.shift, c.total, c.next_ids,
                                          c.hidden, c.rows, (first + c.total - 1)[want], k1)
        self.num_drafts[c.slots] = 0
        if not want.any():
            return
        slots = c.slots[want]
        root = last[want] - c.shift[want]  # [num_seqs] head position of the last caught-up token
        tree_ids, parents, num, score = self._grow(slots, root, feat, (first + c.total - 1)[want], vals, ids,
                                                   c.depth)
        self.tree_ids[slots], self.tree_parents[slots], self.num_drafts[slots] = tree_ids, parents, num
        self.tree_probs[slots] = np.exp(score)  # (-inf past the nodes kept: 0)

    def _grow(self, slots: np.ndarray, root: np.ndarray, feats: paddle.Tensor, root_rows: np.ndarray,
              vals: np.ndarray, ids: np.ndarray, depth: int) -> tuple[np.ndarray, ...]:
        """Trees of `depth` levels for slots [num_seqs] whose last caught-up token sits at head position root
        [num_seqs] with its output feature at root_rows [num_seqs] of feats [rows, hidden] and top-k children
        (vals, ids) [num_seqs, k]. Parents come before their children.
        Returns (token ids [num_seqs, width], parents [num_seqs, width], nodes [num_seqs], cumulative
        log-probabilities [num_seqs, width])."""
        n, k = len(slots), self.shape.topk
        static = self.shape.static_nodes(depth) if self.shape.paths else None
        # candidates, appended depth by depth: token, cumulative log-probability, parent candidate
        # (-1: the root)
        cand_ids, cand_score, cand_parent = [], [], []
        front_score = np.zeros((n, 1))  # [num_seqs, F] the expanded nodes' cumulative log-probabilities
        front_cand = np.full((n, 1), -1, np.int64)  # [num_seqs, F] their candidate index
        front_row = np.full((n, 1), -1, np.int64)  # [num_seqs, F] their tree row (-1: the root, caught up)
        front_back = np.full((n, 1), CAUSAL, np.int64).view(np.uint64)  # [num_seqs, F] their masks
        front_static = np.zeros(1, np.int64)  # static shapes: the shape node of each frontier node (0: root)
        front_rows = root_rows.reshape(n, 1)  # [num_seqs, F] rows of feats holding the frontier's
        # output features
        vals, ids = vals.reshape(n, 1, k), ids.reshape(n, 1, k)  # [num_seqs, F, k]
        rows_used = 0
        for d in range(1, depth + 1):
            f = front_cand.shape[1]
            base = sum(x.shape[1] for x in cand_ids)
            score = (front_score[:, :, None] + vals).reshape(n, f * k)  # [num_seqs, F k]
            if static is not None:  # only the shape's nodes of this depth are candidates
                at = np.nonzero(static[0] == d)[0]  # the shape's nodes of depth d (block index at + 1)
                # their candidate index
                flat = np.searchsorted(front_static, static[2][at]) * k + static[1][at]
                keep = np.full(f * k, -np.inf)
                keep[flat] = 0.0
                score = score + keep[None, :]
            cand_ids.append(ids.reshape(n, f * k))
            cand_score.append(score)
            cand_parent.append(np.repeat(front_cand, k, axis=1))
            if d == depth:
                break
            if static is None:  # EAGLE-2: expand the k best candidates of this depth
                sel = np.argsort(-score, axis=1, kind="stable")[:, :k]  # [num_seqs, k]
            else:  # the shape's nodes of this depth that have children
                has_children = np.isin(at + 1, static[2])
                sel = np.broadcast_to(flat[has_children], (n, int(has_children.sum())))
                front_static = at[has_children] + 1
            f_new = sel.shape[1]
            if f_new == 0:  # a static shape shallower than depth
                break
            parent_f = sel // k  # [num_seqs, F'] frontier index of each new frontier node's parent
            rows = np.arange(rows_used, rows_used + f_new)[None, :]  # [1, F'] their tree rows
            p_row = np.take_along_axis(front_row, parent_f, axis=1)
            back = (np.take_along_axis(front_back, parent_f, axis=1) << (rows - p_row).astype(np.uint64)) \
                | np.uint64(1)
            tok = np.take_along_axis(ids.reshape(n, f * k), sel, axis=1)  # [num_seqs, F']
            parent_rows = np.take_along_axis(front_rows, parent_f, axis=1).reshape(-1)
            feats, v, t = self.runner.run(
                self.cache, slots, root + 1 + rows_used, np.full(n, f_new, np.int64), tok.reshape(-1), feats,
                parent_rows, np.arange(n * f_new), k, np.repeat(root + d, f_new),
                back.view(np.int64).reshape(-1))
            front_rows = np.arange(n * f_new).reshape(n, f_new)
            vals, ids = v.reshape(n, f_new, k), t.reshape(n, f_new, k)
            front_score = np.take_along_axis(score, sel, axis=1)
            front_cand = base + sel
            front_row, front_back = np.broadcast_to(rows, (n, f_new)), back
            rows_used += f_new
        return self._offer(np.concatenate(cand_ids, 1), np.concatenate(cand_score, 1),
                           np.concatenate(cand_parent, 1))

    def _offer(self, cand_ids: np.ndarray, score: np.ndarray, parent: np.ndarray):
        """The `width` candidates of highest cumulative log-probability, best first (a stable order: a parent,
        never below its child and made before it, comes first), as a tree: (ids, parents, nodes, scores)."""
        n, total = cand_ids.shape
        width = min(self.width, total)
        order = np.argsort(-score, axis=1, kind="stable")[:, :width]  # [num_seqs, width]
        # block index of each candidate (+1: the root at -1), 0 unkept
        block = np.zeros((n, total + 1), np.int64)
        np.put_along_axis(block, order + 1, np.arange(1, width + 1)[None, :], axis=1)
        parents = np.take_along_axis(block, np.take_along_axis(parent, order, axis=1) + 1, axis=1)
        ids = np.take_along_axis(cand_ids, order, axis=1)
        kept = np.take_along_axis(score, order, axis=1)
        out_ids = np.zeros((n, self.width), np.int64)
        out_parents = np.zeros((n, self.width), np.int64)
        out_score = np.full((n, self.width), -np.inf)
        out_ids[:, :width], out_parents[:, :width], out_score[:, :width] = ids, parents, kept
        return out_ids, out_parents, np.isfinite(kept).sum(axis=1).astype(np.int64), out_score


def build_eagle_proposer(d: Drafting, eagle3: bool = False) -> EagleProposer:
    """--method eagle: the layer at --draft-model (default: the one shipped for the default model), EAGLE-3's
    when the checkpoint is one."""
    model, e = d.model, d.section
    path = d.draft_model or (None if eagle3 else shipped_eagle(str(model.source)))
    if path is None:
        raise CheckpointError(f"--method {d.method.value} needs --draft-model PATH (an EAGLE layer: "
                              "fc.weight, layers.0.* or EAGLE-3's midlayer.*; `specgen train-head --kind "
                              f"{d.method.value}` trains one); none ships for this model")
    where = Path(path) if Path(path).is_dir() else Path(path).parent
    runner = prepare_eagle(model, path, e.quantize)
    if eagle3 and not getattr(runner, "features", None):
        raise CheckpointError(f"{path}: --method eagle3 needs an EAGLE-3 layer (midlayer.*, fc over several "
                              "depths); this is an EAGLE-1/2 layer: use --method eagle")
    return EagleProposer(model, runner, d.k, TreeShape(e.topk, e.nodes, e.tree_paths()),
                         training_setting(where, "eval_acc"), prompt_window(where), e.copy, d.lib)


def build_eagle3_proposer(d: Drafting) -> EagleProposer:
    """--method eagle3: an EAGLE-3 layer at --draft-model (EAGLE-2's trees, the eagle section's shape)."""
    return build_eagle_proposer(d, eagle3=True)


def prepare_eagle(model: Model, path: str | Path, quantize: bool = True):
    """The EAGLE layer at `path` loaded and prepared for the model's backend, once per model in this
    process."""
    return prepared_once(model, checkpoint_key(path, "eagle", quantize),
                         lambda: model.backend.prepare_drafter(model, load_eagle(path, model), quantize))


