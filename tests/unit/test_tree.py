"""Token trees on constructed inputs: layouts, the acceptance walk (a chain gives accept_lengths' answer),
node gains, and tree-masked attention against each branch run as a causal chain, on both backends."""
import numpy as np
import pytest

from specgen.engine.tree import (
    CAUSAL,
    MAX_TREE_NODES,
    main_chain,
    node_gains,
    node_values,
    offer,
    prune,
    reach,
    tree_layout,
    walk,
)
from specgen.engine.types import DraftTokens
from specgen.engine.verify import accept_lengths
from specgen.runtime.batch import build_forward_batch

# root -> 1 (a) -> 3 (c) -> 5 (e); root -> 2 (b) -> 4 (d); 1 -> 6 (a again: a branch sharing a token)
PARENTS = np.array([[0, 0, 1, 2, 3, 1]])
IDS = np.array([[10, 11, 12, 13, 14, 10]])


def test_layout_depths_and_masks():
    depth, mask = tree_layout(PARENTS)
    assert depth.tolist() == [[0, 1, 1, 2, 2, 3, 2]]
    bits = mask.view(np.uint64)[0]
    assert bits[0] == CAUSAL.astype(np.uint64)
    # node 5 (block index 5) sees itself (0 back), node 3 (2 back), node 1 (4 back), the root and all before
    # it
    visible = [b for b in range(64) if (int(bits[5]) >> b) & 1]
    assert visible[:4] == [0, 2, 4, 5] and visible[4:] == list(range(6, 64))
    chain_depth, chain_mask = tree_layout(np.array([[0, 1, 2]]))  # a chain: causal, depth = index
    assert chain_depth.tolist() == [[0, 1, 2, 3]] and (chain_mask == CAUSAL).all()


def test_walk_follows_the_models_choices_and_stops():
    # the model picks 10 at the root, then 12, then 99: path root -> 1 -> 3, accepted 2
    targets = np.array([[10, 12, 0, 99, 0, 0, 0]])
    accepted, path = walk(IDS, PARENTS, np.array([6]), targets)
    assert accepted.tolist() == [2] and path[0, :3].tolist() == [0, 1, 3]
    # 11 at the root: the other branch; a budget of 0 accepts nothing; a budget of 2 cuts node 3 off
    targets = np.array([[11, 0, 13, 0, 7, 0, 0]])
    assert walk(IDS, PARENTS, np.array([6]), targets)[0].tolist() == [2]
    assert walk(IDS, PARENTS, np.array([0]), targets)[0].tolist() == [0]
    assert walk(IDS, PARENTS, np.array([2]), np.array([[10, 12, 0, 0, 0, 0, 0]]))[0].tolist() == [1]


def test_walk_of_chains_equals_accept_lengths():
    rng = np.random.default_rng(0)
    drafts = rng.integers(0, 3, (50, 5))
    targets = rng.integers(0, 3, (50, 6))
    num = rng.integers(0, 6, 50)
    parents = np.broadcast_to(np.arange(5), (50, 5))
    accepted, path = walk(drafts, parents, num, targets)
    assert accepted.tolist() == accept_lengths(drafts, num, targets).tolist()
    assert (np.where(np.arange(6) <= accepted[:, None], path, 0)
            == np.where(np.arange(6) <= accepted[:, None], np.arange(6), 0)).all()


def test_next_depth_is_one_past_the_deepest_verified_node_of_the_drafters_own_trees():
    """What the engine asks a tree drafter to prepare after a step: one past the deepest verified node (three
    siblings verified reach depth 1, a chain of two depth 2), not the node count; a copied chain (source 1)
    does not count; chains: one past the most drafts verified."""
    import types

    from specgen.engine.engine import Engine
    from specgen.engine.types import DraftTokens

    siblings, chain = np.array([[0, 0, 0]]), np.array([[0, 1, 2]])
    both = np.concatenate([siblings, chain])
    depth = tree_layout(both)[0]
    assert reach(depth, np.array([3, 2])).tolist() == [1, 2]
    assert reach(depth, np.array([0, 0])).tolist() == [0, 0]

    def plan(num, source, tree=True):
        drafts = DraftTokens(np.zeros((2, 3), np.int64), np.array(num), source, both if tree else None)
        return types.SimpleNamespace(depth=depth if tree else None, num_draft=np.array(num), drafts=drafts)

    assert Engine._next_depth(plan([3, 2], None)) == 3
    assert Engine._next_depth(plan([3, 0], None)) == 2  # before: node count + 1 = 4
    assert Engine._next_depth(plan([3, 2], np.array([0, 1]))) == 2  # the copied chain of 2 is left out
    assert Engine._next_depth(plan([3, 2], np.array([0, 1]), tree=False)) == 4


def test_prune_and_gains():
    assert prune(PARENTS, np.array([6]), np.array([2])).tolist() == [4]  # node 5 is at depth 3
    assert prune(PARENTS, np.array([3]), np.array([5])).tolist() == [3]
    g = node_gains(np.array([[0, 1, 2]]), np.array([0.5]))
    assert np.allclose(g, [[0.5, 0.25, 0.125]])  # a chain: alpha^j
    g = node_gains(PARENTS, np.array([0.5]))
    assert (np.diff(g[0]) <= 0).all() and g[0, 0] == 0.5 and g[0, 1] == 0.25  # the second child: (1 - a) a


def test_offer_cuts_trees_to_depth_rows_and_width():
    """What a step may verify: a prefix of each tree, within the depth a chain could reach, the rows left
    before the context's end, and MAX_TREE_NODES columns."""
    parents = np.concatenate([PARENTS, PARENTS])
    drafts = DraftTokens(np.concatenate([IDS, IDS]), np.array([6, 6]), None, parents)
    cut, num_avail = offer(drafts, np.array([2, 5]), np.array([10, 3]))
    assert num_avail.tolist() == [4, 3]  # node 5 is at depth 3; three rows left
    assert cut.draft_ids.shape == (2, 6) and cut.parents is not None and cut.scores is None
    wide = np.zeros((1, MAX_TREE_NODES + 8), np.int64)  # a star of MAX_TREE_NODES + 8 children under the root
    cut, num_avail = offer(DraftTokens(wide, np.array([MAX_TREE_NODES + 8]), None, wide), np.array([5]),
                           np.array([100]))
    assert cut.draft_ids.shape == (1, MAX_TREE_NODES) and num_avail.tolist() == [MAX_TREE_NODES]


def test_node_values_take_the_drafters_scores_for_its_own_trees_and_acceptance_for_copies():
    parents = np.array([[0, 1, 2], [0, 1, 2]])
    scores = np.array([[0.9, 0.5, 0.2], [0.0, 0.0, 0.0]])
    drafts = DraftTokens(np.zeros((2, 3), np.int64), np.array([3, 3]), np.array([0, 1]), parents, scores)
    gains = node_values(drafts, np.array([0.3, 0.5]), lambda s: s * 0.5)
    assert np.allclose(gains, [[0.45, 0.25, 0.1], [0.5, 0.25, 0.125]])
    unscored = DraftTokens(drafts.draft_ids, drafts.num_draft, None, parents)
    half = np.array([0.5, 0.5])
    assert np.allclose(node_values(unscored, half, None), node_gains(parents, half))


def test_main_chain_is_the_first_child_at_every_node():
    chain, length = main_chain(IDS, PARENTS, np.array([6]))
    assert length.tolist() == [3] and chain[0, :3].tolist() == [10, 12, 14]  # root -> 1 -> 3 -> 5
    chain, length = main_chain(IDS, PARENTS, np.array([2]))  # nodes 1 and 2 only: siblings, depth 1
    assert length.tolist() == [1] and chain[0, 0] == 10


@pytest.mark.parametrize("name", ["fused32", "fused64", "reference64"])
def test_tree_attention_equals_each_branch_as_a_chain(tiny_models, name):
    """Every node's hidden state in one tree forward equals the last one of its branch (root .. node) fed as a
    causal chain after the same context: bit for bit on the fused kernels, float32 included (a node off its
    tree's first branch takes its keys in position order), so a path accepted from any branch is plain
    decoding's."""
    model = tiny_models[name].model
    rng = np.random.default_rng(3)
    context = rng.integers(3, 250, 20)
    depth, mask = tree_layout(PARENTS)
    n = PARENTS.shape[1] + 1

    def prefilled():
        cache = model.new_cache(1, 64)
        model.forward(build_forward_batch(np.zeros(1, np.int64), np.zeros(1, np.int64), np.array([19]),
                                          context[:19], np.zeros(1, bool)), cache)
        return cache

    block = np.concatenate([[context[19]], IDS[0]])
    out = model.forward(build_forward_batch(np.zeros(1, np.int64), np.array([19]), np.array([n]), block,
                                            np.ones(1, bool), tree_depth=depth[0], tree_mask=mask[0]),
                        prefilled())
    tree_hidden = out.hidden.numpy()
    for i in range(n):
        branch, j = [i], i
        while j:
            j = int(PARENTS[0, j - 1])
            branch.insert(0, j)
        chain = model.forward(build_forward_batch(np.zeros(1, np.int64), np.array([19]),
                                                  np.array([len(branch)]), block[branch], np.ones(1, bool)),
                              prefilled())
        if name.startswith("fused"):
            assert np.array_equal(chain.hidden.numpy()[-1], tree_hidden[i]), i
        else:  # Paddle's own kernels: the same keys, summed in another order
            assert np.allclose(chain.hidden.numpy()[-1], tree_hidden[i], rtol=0, atol=1e-12), i


def test_ngram_tree_hand_worked():
    """Tail "1 2" occurs three times: 3 7 1 (most recent), 5 6 1, 3 4 1; the first and last share their 3."""
    from specgen.engine.proposers.ngram_tree import ngram_tree, path_keys

    text = np.array([[1, 2, 3, 4, 1, 2, 5, 6, 1, 2, 3, 7, 1, 2, 0, 0]])
    d = ngram_tree(text, np.array([14]), np.array([5]), 3, 1, 3, 3)
    assert d.num_draft.tolist() == [8]
    assert d.draft_ids[0, :8].tolist() == [3, 7, 1, 5, 6, 1, 4, 1]
    assert d.parents[0, :8].tolist() == [0, 1, 2, 0, 4, 5, 1, 7]
    # chain
    assert ngram_tree(text, np.array([14]), np.array([5]), 3, 1, 3, 1).parents[0, :3].tolist() == [0, 1, 2]
    d = ngram_tree(text, np.array([14]), np.array([1]), 3, 1, 3, 3)  # depth 1 only: two distinct first tokens
    assert d.draft_ids[0, : d.num_draft[0]].tolist() == [3, 5]
    d = ngram_tree(text, np.array([14]), np.array([5]), 3, 1, 3, 3, path_keys(((0, 0), (1,))))
    assert (d.draft_ids[0, :3].tolist() == [3, 7, 5] and d.parents[0, :3].tolist() == [0, 1, 0]
            and d.num_draft[0] == 3)


def test_tree_choices_are_checked():
    from specgen.config import NgramConfig
    from specgen.errors import ConfigError

    assert NgramConfig(branches=2, tree_choices=("0", "1,0")).tree_paths() == ((0,), (1, 0))
    for bad in (("2",), ("0,x",), ("0,0,0,0,0,0",)):
        with pytest.raises(ConfigError, match="tree_choices"):
            NgramConfig(branches=2, tree_choices=bad)


def test_the_drafters_calibration_counts_its_own_rows_only():
    """Engine._rated: drafts accepted against the drafter's expected count over its own verified nodes; a
    copied chain (source 1, scores 0) adds neither (its accepted tokens would overrate the layer's
    probabilities)."""
    import types

    from specgen.engine.engine import Engine
    from specgen.engine.types import DraftTokens

    scores = np.array([[0.5, 0.25, 0.1], [0.0, 0.0, 0.0]])
    drafts = DraftTokens(np.zeros((2, 3), np.int64), np.array([2, 3]), np.array([0, 1]),
                         np.zeros((2, 3), np.int64), scores)
    plan = types.SimpleNamespace(drafts=drafts, dec=np.array([4, 5]), num_draft=np.array([2, 3]))
    assert Engine._rated(plan, np.array([1, 3])) == (1.0, 0.75)
    plan.drafts = DraftTokens(drafts.draft_ids, drafts.num_draft, None, drafts.parents, scores)
    assert Engine._rated(plan, np.array([1, 3])) == (4.0, 0.75)

