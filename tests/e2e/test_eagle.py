"""EAGLE layers (issue 44): the public layout loads (a wrong one is refused); a dynamic tree's nodes are the
layer's own top-k choices along their paths, scored as a chain recomputed from scratch (the draft cache's tree
masks and positions); trees from random layers give plain decoding's tokens on both backends (float64, greedy
and sampled, batch 1 / 7 / 32, chunked prefill and shared prefix on and off, dynamic and static trees, the
controller on and off, copies on and off); copies replace a slot's tree where its text repeats; the shipped
layer loads for the default model."""
import dataclasses

import numpy as np
import pytest
from conftest import TINY
from heads import random_eagle

from specgen import EngineConfig, SamplingParams, SpecConfig, generate, load_model
from specgen.config import EagleConfig
from specgen.drafters.eagle import load_eagle, read_eagle, save_eagle, shipped_eagle
from specgen.drafters.eagle_pass import EaglePass
from specgen.engine.proposers.eagle import EagleProposer, TreeShape, prepare_eagle
from specgen.errors import CheckpointError


@pytest.fixture(scope="module")
def model64():
    return load_model(TINY / "llama", dtype="float64", backend="reference")


def test_load_checks_the_layout(model64, tmp_path):
    cfg = model64.config
    save_eagle(tmp_path / "ok", random_eagle(cfg, 0), cfg)
    w = load_eagle(tmp_path / "ok", model64.model)
    assert w.block.attn_norm is None and w.norm is None and w.fc.bias is not None
    assert w.lm_head.weight.shape == [cfg.hidden_size, cfg.vocab_size]
    np.save(tmp_path / "ok" / "draft_vocab.npy", np.arange(10, 60))
    w = load_eagle(tmp_path / "ok", model64.model)  # a draft vocabulary: its LM-head columns only
    assert w.token_ids(np.array([0, 49])).tolist() == [10, 59]
    assert EaglePass(model64.model, w).lm_head.weight.shape == [cfg.hidden_size, 50]
    good = random_eagle(cfg, 0, input_norm=True, norm=True)
    assert read_eagle(good, "x", model64.model).block.attn_norm is not None
    with pytest.raises(CheckpointError, match="not an EAGLE layer"):
        read_eagle({k: v for k, v in good.items() if k != "fc.weight"}, "x", model64.model)
    with pytest.raises(CheckpointError, match="past the first"):
        read_eagle({**good, "layers.1.mlp.up_proj.weight": good["layers.0.mlp.up_proj.weight"]}, "x",
                   model64.model)
    with pytest.raises(CheckpointError, match="own LM head"):
        read_eagle({**good, "lm_head.weight": np.zeros((cfg.vocab_size, cfg.hidden_size))}, "x",
                   model64.model)
    with pytest.raises(CheckpointError, match="shape"):
        read_eagle({**good, "fc.weight": good["fc.weight"][:, :-1]}, "x", model64.model)
    with pytest.raises(CheckpointError, match="no EAGLE checkpoint"):
        load_eagle(tmp_path / "missing", model64.model)


def _chain_scores(proposer: EagleProposer, tokens: list[int], features,
                  paths: list[list[int]]) -> list[float]:
    """Each path's cumulative log-probability with the layer run as a plain causal chain from scratch: the
    context's features at positions 0..n - 2 (token i + 1 each), then the path's tokens on the layer's own
    output features."""
    runner = proposer.runner
    out = []
    for path in paths:
        cache = runner.new_cache(1)
        n = len(tokens)
        feat, vals, ids = runner.run(cache, np.zeros(1, np.int64), np.zeros(1, np.int64), np.array([n - 1]),
                                     np.array(tokens[1:]), features, np.arange(n - 1), np.array([n - 2]), 20)
        score, last, row = 0.0, feat, n - 2
        for d, tok in enumerate(path):
            score += float(vals[0][list(ids[0]).index(tok)])
            last, vals, ids = runner.run(cache, np.zeros(1, np.int64), np.array([n - 1 + d]),
                                         np.ones(1, np.int64), np.array([tok]), last, np.array([row]),
                                         np.zeros(1, np.int64), 20)
            row = 0
        out.append(score)
    return out


@pytest.mark.parametrize("backend", ["fused", "reference"])
def test_dynamic_tree_is_the_layers_own_top_k(model64, backend, tmp_path):
    """Every node of a grown tree (3 slots at once, scratch rows past different lengths) is one of the top-k
    children of its parent, and its score, summed along its path, equals a from-scratch chain's: the tree
    masks hide siblings and other branches, positions follow depth."""
    import paddle

    cfg = model64.config
    save_eagle(tmp_path, random_eagle(cfg, 3, norm=True), cfg)
    m = load_model(TINY / "llama", dtype="float64", backend=backend).model
    k, depth = 3, 4
    prop = EagleProposer(m, prepare_eagle(m, tmp_path), depth, TreeShape(topk=k, nodes=32))
    ref = EagleProposer(model64.model, prepare_eagle(model64.model, tmp_path), depth,
                        TreeShape(topk=k, nodes=32))
    prop._ensure(3)
    rng = np.random.default_rng(0)
    lens = [7, 12, 9]
    toks = [rng.integers(3, 250, n).tolist() for n in lens]
    feats = [paddle.to_tensor(rng.normal(0, 1, (n, cfg.hidden_size))) for n in lens]
    slots, roots, tops, vals, ids = np.array([2, 0, 1]), np.array(lens) - 2, [], [], []
    for s, t, f in zip(slots, toks, feats):  # catch up each slot
        n = len(t)
        feat, v, i = prop.runner.run(prop.cache, np.array([s]), np.zeros(1, np.int64), np.array([n - 1]),
                                     np.array(t[1:]), f, np.arange(n - 1), np.array([n - 2]), k)
        tops.append(feat[n - 2: n - 1])
        vals.append(v[0])
        ids.append(i[0])
    tree_ids, parents, num, scores = prop._grow(slots, roots, paddle.concat(tops), np.arange(3),
                                                np.array(vals), np.array(ids), depth)
    assert (num == min(32, k + (depth - 1) * k * k)).all()
    for s in range(3):
        paths = []
        for j in range(int(num[s])):
            path, p = [int(tree_ids[s, j])], int(parents[s, j])
            assert p <= j  # parents first
            while p:
                path.insert(0, int(tree_ids[s, p - 1]))
                p = int(parents[s, p - 1])
            paths.append(path)
        chain = _chain_scores(ref, toks[s], feats[s], paths)  # the reference layer's, from scratch
        np.testing.assert_allclose(scores[s, :num[s]], chain, rtol=1e-9, atol=1e-9)
        # best first, distinct
        assert np.all(np.diff(chain) <= 1e-9) and len(set(map(tuple, paths))) == len(paths)


def test_static_tree_keeps_its_shape(model64, tmp_path):
    cfg = model64.config
    save_eagle(tmp_path, random_eagle(cfg, 4), cfg)
    m = model64.model
    shape = TreeShape(topk=2, nodes=32, paths=((0, 0, 0), (1,), (0, 1), (1, 0)))
    prop = EagleProposer(m, prepare_eagle(m, tmp_path), 3, shape)
    assert prop.width == 6  # (0) (1) (0,0) (0,1) (1,0) (0,0,0)
    prompts = [[5, 9, 13, 5, 9, 13, 5, 9]]
    spec = SpecConfig(method="eagle", draft_model=str(tmp_path), adaptive=False, num_speculative_tokens=3,
                      eagle=EagleConfig(topk=2, tree_choices=("0,0,0", "1", "0,1", "1,0")))
    out = generate(prompts, model=model64, sampling=SamplingParams(max_tokens=10), speculative=spec,
                   engine=EngineConfig(batch_size=1, dtype="float64"))
    plain = generate(prompts, model=model64, sampling=SamplingParams(max_tokens=10),
                     engine=EngineConfig(batch_size=1, dtype="float64"))
    assert out[0].token_ids == plain[0].token_ids
    # (nothing accepted:) 6 whole trees while 3+ tokens are left, then the 5 nodes of depth <= 2, then the 2
    # of depth 1
    assert out[0].stats.num_accepted_tokens == 0 and out[0].stats.num_draft_tokens == 6 * 6 + 5 + 2


@pytest.mark.parametrize("backend", ["fused", "reference"])
def test_eagle_equals_plain(backend, tmp_path):
    model = load_model(TINY / "llama", dtype="float64", backend=backend)
    cfg = model.config
    save_eagle(tmp_path, random_eagle(cfg, 1), cfg)
    rng = np.random.default_rng(2)
    prefix = rng.integers(3, 250, 40).tolist()
    prompts = [prefix + rng.integers(3, 250, int(n)).tolist() for n in rng.integers(2, 30, 32)]
    for mode in ("greedy", "sampled"):
        sp = [SamplingParams(max_tokens=3 + (i * 5) % 14, temperature=0.8 if mode == "sampled" else 0.0,
                             seed=i) for i in range(len(prompts))]
        plain = generate(prompts, model=model, sampling=sp,
                         engine=EngineConfig(batch_size=32, dtype="float64", shared_prefix="off"))
        runs = [(1, "off", 0, False, (), 2), (7, "auto", 16, False, ("0,0", "1", "0,1"), 0),
                (32, "off", 16, True, (), 2), (32, "auto", 0, False, (), 0), (32, "auto", 0, True, (), 1)]
        for batch, shared, chunk, adaptive, choices, copy in runs:
            picked = range(0, len(prompts), 5) if batch == 1 else range(len(prompts))
            spec = SpecConfig(method="eagle", draft_model=str(tmp_path), adaptive=adaptive,
                              num_speculative_tokens=4,
                              eagle=EagleConfig(topk=3, nodes=10, tree_choices=choices, copy=copy))
            engine = EngineConfig(batch_size=batch, dtype="float64", shared_prefix=shared,
                                  prefill_chunk=chunk, max_prefill_tokens=64)
            out = generate([prompts[i] for i in picked], model=model, sampling=[sp[i] for i in picked],
                           ids=list(picked), engine=engine, speculative=spec)
            assert [o.token_ids for o in out] == [plain[i].token_ids for i in picked], (mode, batch, shared,
                                                                                       chunk)
            if not adaptive:
                assert sum(o.stats.num_draft_tokens for o in out) > 0


def test_copies_replace_the_tree_where_the_text_repeats(model64, tmp_path):
    """With --eagle-copy N a slot whose last N+ tokens occurred before drafts what followed there, as a chain
    of source 1 (priced from the slot's acceptance of copies, not the layer's probabilities); another slot
    keeps its tree."""
    from specgen.engine.proposers import build_proposer
    from specgen.engine.proposers.base import SlotView

    cfg = model64.config
    save_eagle(tmp_path, random_eagle(cfg, 3), cfg)
    spec = SpecConfig(method="eagle", draft_model=str(tmp_path), num_speculative_tokens=3,
                      eagle=EagleConfig(topk=2, nodes=6, copy=2))
    p = build_proposer(spec, model64.model)
    p._ensure(2)
    (p.tree_ids[1, :3], p.tree_parents[1, :3], p.num_drafts[1],
     p.tree_probs[1, :3]) = [40, 41, 42], [0, 0, 1], 3, .5
    p.drafts_at[:] = 6  # grown for the committed text
    tokens = np.zeros((2, 16), np.int64)
    tokens[0, :6], tokens[1, :6] = [5, 6, 7, 8, 5, 6], [9, 10, 11, 12, 13, 14]
    d = p.propose(SlotView(np.array([0, 1]), tokens, np.array([6, 6]), np.array([3, 3])))
    assert d.source.tolist() == [1, 0]
    assert d.draft_ids[0, :3].tolist() == [7, 8, 5] and d.num_draft.tolist() == [3, 3]
    assert d.parents[0].tolist() == list(range(6)) and not d.scores[0].any()
    assert d.draft_ids[1, :3].tolist() == [40, 41, 42] and d.parents[1, :3].tolist() == [0, 0, 1]
    p.num_drafts[1] = 0  # no tree this step (slot 1 detached): the copies alone, as a plain chain
    d = p.propose(SlotView(np.array([0, 1]), tokens, np.array([6, 6]), np.array([3, 3])))
    assert d.parents is None and d.source.tolist() == [1, 0] and d.num_draft.tolist() == [3, 0]
    assert d.draft_ids[0].tolist() == [7, 8, 5]
    # state untouched
    assert p.tree_ids[1, :3].tolist() == [40, 41, 42] and p.tree_parents[0].tolist() == [0] * 6
    p.num_drafts[1] = 3  # a tree grown for another length (a step the proposer was not told of): not offered
    d = p.propose(SlotView(np.array([0, 1]), tokens, np.array([6, 7]), np.array([3, 3])))
    assert d.parents is None and d.num_draft[1] == 0
    off = build_proposer(dataclasses.replace(spec, eagle=EagleConfig(topk=2, nodes=6, copy=0)),
                               model64.model)
    off._ensure(2)
    assert off.propose(SlotView(np.array([0]), tokens, np.array([6]), np.array([3]))).source is None


def test_shipped_layer_runs_alone_on_the_default_model(real_model):
    """`--method eagle` alone: the package's trained layer grows dynamic trees for the default model (greedy
    and sampled, batch 1 and 2), plain decoding's tokens, and its drafts are accepted."""
    path = shipped_eagle(str(real_model.model.source))
    assert path is not None and (path / "model.safetensors").stat().st_size < 12 << 20
    prompts = [real_model.tokenizer.encode_chat([{"role": "user", "content": q}])
               for q in ("What is 12 times 7? Explain step by step.", "Write a haiku about the sea.")]
    for temperature in (0.0, 0.8):
        sp = SamplingParams(max_tokens=20, temperature=temperature, seed=3)
        plain = generate(prompts, model=real_model, sampling=sp)
        for batch in (1, 2) if temperature == 0.0 else (2,):
            out = generate(prompts, model=real_model, sampling=sp, engine=EngineConfig(batch_size=batch),
                           speculative=SpecConfig(method="eagle", adaptive=False))
            assert [o.token_ids for o in out] == [o.token_ids for o in plain], (temperature, batch)
            if temperature == 0.0:
                steps = sum(o.stats.num_steps for o in out)
                assert sum(len(o.token_ids) for o in out) / steps > 1.2  # a trained layer: trees are accepted


@pytest.mark.parametrize("backend", ["fused", "reference"])
def test_a_prepared_layer_is_reused_and_does_not_keep_its_model_alive(backend, tmp_path):
    """The layer is prepared once per model (a second proposer gets the same runner), and the per-model cache
    holds the model weakly: once the model is dropped it is freed."""
    import gc
    import weakref

    m = load_model(TINY / "llama", dtype="float64", backend=backend).model
    save_eagle(tmp_path, random_eagle(m.config, 5), m.config)
    spec = SpecConfig(method="eagle", draft_model=str(tmp_path), num_speculative_tokens=2)
    from specgen.engine.proposers import build_proposer

    first, second = build_proposer(spec, m), build_proposer(spec, m)
    assert first.runner is second.runner and first is not second
    alive = weakref.ref(m)
    del m, first, second
    gc.collect()
    assert alive() is None
