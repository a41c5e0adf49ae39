"""Token trees: the layout of a tree's verify block (each node's depth and what it attends to), the walk that
accepts a path, and the pruning of a tree to a node budget or depth. Pure array functions, all slots at once.

A slot's tree block is [root, node 1, ..., node n]: the root is its last committed token, node i (block index
i) has parent parents[i - 1] < i, so parents precede children and the first m nodes of a tree are a tree too.
A chain is the tree whose node i has parent i - 1. Node i is written at cache row root + i, sees
position root + depth(i) through RoPE, and attends to the committed context and to its ancestors
(itself included) only.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from specgen.engine.types import DraftTokens

# a tree mask with every bit set: every earlier row of the block is visible (not a tree)
CAUSAL = np.int64(-1)
# nodes of one slot's tree at most: a node's mask has a bit per row back up to 63; its root, 64 rows back at
# most, is seen as the committed context past them is (EAGLE-2's trees: 60 nodes)
MAX_TREE_NODES = 64
_ONE = np.uint64(1)


def tree_layout(
    parents: np.ndarray,  # [num_seqs, width] int64 block index of each node's parent (DraftTokens.parents)
) -> tuple[np.ndarray, np.ndarray]:
    """(depth [num_seqs, width + 1] int64, mask [num_seqs, width + 1] int64) of every block index, the root's
    included: depth 0 at the root; mask bit b set where the row b back is the token itself or an ancestor
    (bits past the root: the committed context, visible). Entries of nodes past a slot's count are harmless
    filler."""
    num_seqs, width = parents.shape
    rows = np.arange(num_seqs)[:, None]
    index = np.arange(1, width + 1)[None, :]
    p = np.clip(parents, 0, index - 1)  # [num_seqs, width]
    shift = (index - p).astype(np.uint64)
    depth = np.zeros((num_seqs, width + 1), np.int64)
    back = np.zeros((num_seqs, width + 1), np.uint64)
    back[:, 0] = CAUSAL.astype(np.uint64)
    # every node from its parent's values at once; after d rounds the nodes at depth <= d are final, so the
    # rounds stop one after the deepest (a chain of MAX_DRAFT: 6 rounds, however wide the tree)
    for _ in range(width):
        new_depth = depth[rows, p] + 1
        # the parent's visible rows, seen from i - p rows further on, and the node itself
        new_back = (back[rows, p] << shift) | _ONE
        if np.array_equal(new_depth, depth[:, 1:]) and np.array_equal(new_back, back[:, 1:]):
            break
        depth[:, 1:], back[:, 1:] = new_depth, new_back
    return depth, back.view(np.int64)


def reach(
    depth: np.ndarray,  # [num_seqs, width + 1] int64 block depths (tree_layout)
    num_nodes: np.ndarray,  # [num_seqs] int64 nodes verified
) -> np.ndarray:
    """[num_seqs] int64 each slot's deepest verified node's depth (0: none verified)."""
    # the verified nodes
    verified = np.arange(1, depth.shape[1])[None, :] <= num_nodes[:, None]  # [num_seqs, width]
    return np.where(verified, depth[:, 1:], 0).max(axis=1, initial=0)


def prune(
    parents: np.ndarray,  # [num_seqs, width] int64
    num_nodes: np.ndarray,  # [num_seqs] int64 nodes offered
    max_depth: np.ndarray,  # [num_seqs] int64 deepest node allowed
) -> np.ndarray:
    """[num_seqs] int64 nodes kept: the longest prefix of each tree whose nodes are all within max_depth (a
    prefix keeps a tree; parents precede children)."""
    depth, _ = tree_layout(parents)
    deep = (depth[:, 1:] > max_depth[:, None]) | (np.arange(parents.shape[1])[None, :] >= num_nodes[:, None])
    return np.where(deep.any(axis=1), deep.argmax(axis=1), parents.shape[1]).astype(np.int64)


def walk(
    draft_ids: np.ndarray,  # [num_seqs, width] int64 node tokens
    parents: np.ndarray,  # [num_seqs, width] int64
    num_nodes: np.ndarray,  # [num_seqs] int64 nodes verified
    targets: np.ndarray | None,  # [num_seqs, width + 1] int64 the model's choice at each block index;
    # None: the first child wherever there is one (the tree's main chain)
) -> tuple[np.ndarray, np.ndarray]:
    """Down from the root: at each node take the model's own choice there and move to the first child holding
    that token, if any. Returns (accepted [num_seqs] int64 nodes on the path, path [num_seqs, width + 1] int64
    block index of the path's node at each depth: path[:, 0] = 0, entries past accepted 0)."""
    num_seqs, width = draft_ids.shape
    rows = np.arange(num_seqs)
    path = np.zeros((num_seqs, width + 1), np.int64)
    accepted = np.zeros(num_seqs, np.int64)
    valid = np.arange(width)[None, :] < num_nodes[:, None]  # [num_seqs, width]
    cur = np.zeros(num_seqs, np.int64)
    alive = num_nodes > 0
    for d in range(1, width + 1):
        if not alive.any():
            break
        child = valid & (parents == cur[:, None])  # [num_seqs, width] children of the current node
        if targets is not None:
            child &= draft_ids == targets[rows, cur][:, None]
        has = child.any(axis=1) & alive
        nxt = child.argmax(axis=1) + 1  # the first such child's block index
        cur = np.where(has, nxt, cur)
        path[:, d] = np.where(has, nxt, 0)
        accepted += has
        alive = has
    return accepted, path


def node_gains(
    parents: np.ndarray,  # [num_seqs, width] int64
    alpha: np.ndarray,  # [num_seqs] acceptance estimate of a slot's first-choice drafts (its main chain)
) -> np.ndarray:
    """[num_seqs, width] expected accepted tokens each node adds: the chance the walk reaches it, with each
    node taken to be right with chance alpha when the siblings drafted before it were wrong,
    (1 - alpha)^rank alpha, so a chain's gains are alpha^j as the controller prices chains. Made
    non-increasing along each row: a node budget keeps a prefix of the tree."""
    num_seqs, width = parents.shape
    a = np.clip(alpha, 1e-6, 1 - 1e-6)[:, None]  # [num_seqs, 1]
    col = np.arange(width)
    earlier = (parents[:, :, None] == parents[:, None, :]) & (col[None, None, :] < col[None, :, None])
    rank = earlier.sum(axis=2)  # [num_seqs, width] siblings before each node
    own = np.log(a) + rank * np.log1p(-a)  # [num_seqs, width] log chance the node is right given its parent
    logp = np.zeros((num_seqs, width + 1))
    rows = np.arange(num_seqs)
    for i in range(1, width + 1):
        logp[:, i] = logp[rows, np.clip(parents[:, i - 1], 0, i - 1)] + own[:, i - 1]
    return np.minimum.accumulate(np.exp(logp[:, 1:]), axis=1) if width else np.zeros((num_seqs, 0))


def offer(
    drafts: DraftTokens,  # a proposer's trees (parents set)
    max_depth: np.ndarray,  # [num_seqs] int64 deepest node a slot may verify
    # (what a chain's drafts could reach)
    rows_left: np.ndarray,  # [num_seqs] int64 cache rows before the context's end
    # (node i sits at root row + i)
) -> tuple[DraftTokens, np.ndarray]:
    """What a step may verify of each tree: at most MAX_TREE_NODES nodes, none deeper than max_depth, none
    past the rows left. Returns (the drafts cut to MAX_TREE_NODES columns, num_avail [num_seqs] int64 nodes
    offered: a prefix of each tree)."""
    width = min(drafts.draft_ids.shape[1], MAX_TREE_NODES)
    parents = drafts.parents[:, :width]
    num_avail = np.minimum(prune(parents, np.minimum(drafts.num_draft, width), max_depth), rows_left)
    scores = None if drafts.scores is None else drafts.scores[:, :width]
    return (DraftTokens(drafts.draft_ids[:, :width], drafts.num_draft, drafts.source, parents, scores),
            num_avail)


def node_values(
    drafts: DraftTokens,  # trees (parents set), as offer cut them
    alpha: np.ndarray,  # [num_seqs] each slot's acceptance estimate of its drafts' source
    calibrated: Callable[[np.ndarray], np.ndarray],  # the drafter's scores [n, width] ->
    # expected tokens per node
) -> np.ndarray:
    """[num_seqs, width] the expected tokens each node adds, as the controller prices a tree: from the
    drafter's own probabilities, calibrated, where the drafts are its own (source 0) and it rated them; else,
    and for copied chains, from the slot's acceptance so far (node_gains)."""
    if drafts.scores is None:
        return node_gains(drafts.parents, alpha)
    gains = calibrated(drafts.scores)
    copied = np.zeros(len(alpha), bool) if drafts.source is None else drafts.source != 0
    if copied.any():
        gains[copied] = node_gains(drafts.parents[copied], alpha[copied])
    return gains


def main_chain(
    draft_ids: np.ndarray,  # [num_seqs, width] int64 node tokens
    parents: np.ndarray,  # [num_seqs, width] int64
    num_nodes: np.ndarray,  # [num_seqs] int64 nodes offered
) -> tuple[np.ndarray, np.ndarray]:
    """Each tree's main chain (the first child at every node), whose acceptance the controller keeps for the
    slot: (its tokens [num_seqs, width] int64, entries past its length 0 or filler; its length
    [num_seqs] int64)."""
    length, chain = walk(draft_ids, parents, num_nodes, None)
    with_root = np.concatenate([np.zeros((len(draft_ids), 1), np.int64), draft_ids], axis=1)
    return np.take_along_axis(with_root, chain, axis=1)[:, 1:], length
