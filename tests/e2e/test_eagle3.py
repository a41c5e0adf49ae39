"""EAGLE-3 (issue 60): the layer in its public layout loads, reads the main model's features at the depths its
config names (fused and reference forwards capture the same ones), drafts what an independent numpy version of
the layer computes, and its trees give plain decoding's tokens on both backends, greedy and sampled, with a
shared prefix and prompt chunks."""
import json

import numpy as np
import pytest
from conftest import TINY
from heads import random_eagle, random_eagle3

from specgen import EngineConfig, SamplingParams, SpecConfig, generate, load_model
from specgen.config import EagleConfig
from specgen.drafters.eagle import load_eagle, save_eagle
from specgen.drafters.eagle3 import default_features, save_eagle3
from specgen.errors import CheckpointError
from specgen.layers.rotary import inv_freq
from specgen.runtime.batch import build_forward_batch

FEATURES = (0, 1, 2)  # the tiny model's block inputs 0 and 1, and its last block's output


def _save(model, path, seed=1, features=FEATURES):
    cfg = model.config
    lm = model.model.weights.lm_head.dense().numpy().T  # [vocab, hidden]
    vocab = np.sort(np.random.default_rng(seed).permutation(cfg.vocab_size)[: cfg.vocab_size * 2 // 3])
    weights = random_eagle3(cfg, seed, lm, vocab)
    save_eagle3(path, weights, cfg, features)
    return weights, vocab


def _rms(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _rope(x, pos, cfg):
    """Rotate-half RoPE of x [n, heads, D] at positions pos [n] (float64)."""
    ang = pos[:, None] * inv_freq(cfg)[None, :]  # [n, D / 2]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    a, b = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def numpy_eagle3(w, cfg, feats, next_ids, embed):
    """The layer over positions 0..n-1 of one sequence from scratch, in numpy float64: features feats
    [n, 3 hidden], token i + 1 at position i (next_ids [n]); -> log-probabilities over the draft vocabulary
    [n, draft]."""
    eps, H, KV, D = cfg.rms_norm_eps, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    w = {k: np.asarray(v, np.float64) for k, v in w.items()}
    n = len(next_ids)
    h = feats @ w["fc.weight"].T
    inp = np.concatenate([_rms(embed[next_ids], w["midlayer.input_layernorm.weight"], eps),
                          _rms(h, w["midlayer.hidden_norm.weight"], eps)], axis=-1)
    a = "midlayer.self_attn."
    q = _rope((inp @ w[a + "q_proj.weight"].T).reshape(n, H, D), np.arange(n), cfg)
    k = _rope((inp @ w[a + "k_proj.weight"].T).reshape(n, KV, D), np.arange(n), cfg)
    v = (inp @ w[a + "v_proj.weight"].T).reshape(n, KV, D)
    k, v = np.repeat(k, H // KV, axis=1), np.repeat(v, H // KV, axis=1)
    s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(D) + np.triu(np.full((n, n), -np.inf), 1)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    x = h + np.einsum("hqk,khd->qhd", p, v).reshape(n, H * D) @ w[a + "o_proj.weight"].T
    m = _rms(x, w["midlayer.post_attention_layernorm.weight"], eps)
    gate, up = m @ w["midlayer.mlp.gate_proj.weight"].T, m @ w["midlayer.mlp.up_proj.weight"].T
    x = x + (gate / (1 + np.exp(-gate)) * up) @ w["midlayer.mlp.down_proj.weight"].T
    logits = _rms(x, w["norm.weight"], eps) @ w["lm_head.weight"].T
    return logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)


@pytest.fixture(scope="module")
def model():
    return load_model(TINY / "llama", dtype="float64")


def test_features_are_the_blocks_inputs_on_both_backends(model):
    outs = []
    for backend in ("fused", "reference"):
        m = load_model(TINY / "llama", dtype="float64", backend=backend).model
        ids = np.array([5, 9, 31, 7, 5, 9, 44, 12, 3, 4], np.int64)
        batch = build_forward_batch(np.array([0, 1]), np.array([0, 0]), np.array([6, 4]), ids,
                                    np.array([True, True]))
        outs.append(m.forward(batch, m.new_cache(2, 64), features=(2, 0, 1)))
    fused, ref = outs
    assert fused.features.shape == [10, 3 * model.config.hidden_size]
    np.testing.assert_allclose(fused.features.numpy(), ref.features.numpy(), rtol=0, atol=1e-12)
    # block 0's input is the embedding; block L's (2) the last block's output, whose norm is the hidden state
    h = model.config.hidden_size
    emb = model.model.weights.embed.numpy()[ids]
    np.testing.assert_array_equal(ref.features.numpy()[:, h: 2 * h], emb)
    last = ref.features.numpy()[:, :h]
    w = model.model.weights.final_norm.numpy()
    np.testing.assert_allclose(_rms(last, w, model.config.rms_norm_eps), ref.hidden.numpy(), atol=1e-12)


@pytest.mark.parametrize("backend", ["fused", "reference"])
def test_the_layer_drafts_as_the_numpy_layer(backend, tmp_path):
    """The layer's top-k at every position of a sequence (one pass from an empty cache, as the proposer's
    catch-up makes it) are the numpy version's, mapped through d2t."""
    lm = load_model(TINY / "llama", dtype="float64", backend=backend)
    m, cfg = lm.model, lm.config
    weights, vocab = _save(lm, tmp_path)
    runner = m.backend.prepare_drafter(m, load_eagle(tmp_path, m), True)
    assert runner.features == FEATURES
    seq = np.array([5, 9, 31, 7, 5, 9, 44, 12, 3, 4, 17], np.int64)
    n = len(seq) - 1
    batch = build_forward_batch(np.array([0]), np.array([0]), np.array([n]), seq[:-1], np.array([True]))
    feats = m.forward(batch, m.new_cache(1, 64), features=FEATURES).features
    cache = runner.new_cache(1)
    _, vals, ids = runner.run(cache, np.array([0]), np.array([0]), np.array([n]), seq[1:], feats,
                              np.arange(n), np.arange(n), 4)
    want = numpy_eagle3(weights, cfg, feats.numpy(), seq[1:], m.weights.embed.numpy())
    top = np.argsort(-want, axis=1, kind="stable")[:, :4]
    np.testing.assert_array_equal(ids, vocab[top])
    np.testing.assert_allclose(vals, np.take_along_axis(want, top, axis=1), atol=1e-9)


@pytest.mark.parametrize("backend", ["fused", "reference"])
def test_eagle3_equals_plain(backend, tmp_path):
    model = load_model(TINY / "llama", dtype="float64", backend=backend)
    _save(model, tmp_path)
    rng = np.random.default_rng(2)
    prefix = rng.integers(3, 250, 40).tolist()
    prompts = [prefix + rng.integers(3, 250, int(n)).tolist() for n in rng.integers(2, 30, 12)]
    for mode in ("greedy", "sampled"):
        sp = [SamplingParams(max_tokens=3 + (i * 5) % 14, temperature=0.8 if mode == "sampled" else 0.0,
                             seed=i) for i in range(len(prompts))]
        plain = generate(prompts, model=model, sampling=sp,
                         engine=EngineConfig(batch_size=12, dtype="float64", shared_prefix="off"))
        for batch, shared, chunk, adaptive in ((1, "off", 0, False), (12, "auto", 16, False),
                                               (12, "off", 0, True)):
            picked = range(0, len(prompts), 4) if batch == 1 else range(len(prompts))
            spec = SpecConfig(method="eagle3", draft_model=str(tmp_path), adaptive=adaptive,
                              num_speculative_tokens=4, eagle=EagleConfig(topk=3, nodes=10, copy=0))
            engine = EngineConfig(batch_size=batch, dtype="float64", shared_prefix=shared,
                                  prefill_chunk=chunk, max_prefill_tokens=64)
            out = generate([prompts[i] for i in picked], model=model, sampling=[sp[i] for i in picked],
                           ids=list(picked), engine=engine, speculative=spec)
            assert [o.token_ids for o in out] == [plain[i].token_ids for i in picked], (mode, batch, shared)
            if not adaptive:
                assert sum(o.stats.num_draft_tokens for o in out) > 0


def test_checkpoint_checks(model, tmp_path):
    cfg = model.config
    weights, vocab = _save(model, tmp_path / "ok")
    # --method eagle takes it too (detected from its midlayer.*); eagle3 refuses an EAGLE-1 layer
    out = generate([[5, 6, 7, 8]], model=model, sampling=SamplingParams(max_tokens=6),
                   speculative=SpecConfig(method="eagle", draft_model=str(tmp_path / "ok")))
    assert len(out[0].token_ids) == 6
    save_eagle(tmp_path / "eagle1", random_eagle(cfg, 1), cfg)
    with pytest.raises(CheckpointError, match="use --method eagle"):
        generate([[5, 6]], model=model, sampling=SamplingParams(max_tokens=2),
                 speculative=SpecConfig(method="eagle3", draft_model=str(tmp_path / "eagle1")))
    bad = dict(weights, d2t=weights["d2t"][:-1])
    save_eagle3(tmp_path / "d2t", bad, cfg, FEATURES)
    with pytest.raises(CheckpointError, match="d2t has"):
        load_eagle(tmp_path / "d2t", model.model)
    no_map = {k: v for k, v in weights.items() if k != "d2t"}
    save_eagle3(tmp_path / "nomap", no_map, cfg, FEATURES)
    with pytest.raises(CheckpointError, match="needs d2t"):
        load_eagle(tmp_path / "nomap", model.model)
    save_eagle3(tmp_path / "deep", weights, cfg, (0, 7))
    with pytest.raises(CheckpointError, match="block indices"):
        load_eagle(tmp_path / "deep", model.model)
    config = json.loads((tmp_path / "ok" / "config.json").read_text())
    del config["eagle_config"]
    (tmp_path / "ok" / "config.json").write_text(json.dumps(config))
    assert load_eagle(tmp_path / "ok", model.model).features == default_features(cfg.num_layers)
    assert default_features(32) == (2, 16, 29)
    save_eagle3(tmp_path / "order", weights, cfg, (2, 0, 1))  # listed out of order: fc reads them ascending
    assert load_eagle(tmp_path / "order", model.model).features == (0, 1, 2)
    biased = {**weights, "midlayer.self_attn.q_proj.bias": np.zeros(cfg.num_heads * cfg.head_dim, np.float32)}
    save_eagle3(tmp_path / "bias", biased, cfg, FEATURES)
    with pytest.raises(CheckpointError, match="not a weight of an EAGLE-3 layer"):
        load_eagle(tmp_path / "bias", model.model)


@pytest.mark.parametrize("backend, shared, chunk", [("fused", "off", 0), ("fused", "auto", 5),
                                                     ("reference", "auto", 0)])
def test_engine_hands_the_layer_its_features(backend, shared, chunk, tmp_path, monkeypatch):
    """In the engine (catch-up after each step, a shared prefix, prompt chunks, accepted side branches), every
    tree's depth-1 nodes are the numpy layer's top-k after the slot's committed tokens, with its
    probabilities."""
    from specgen.engine.proposers.eagle import EagleProposer

    lm = load_model(TINY / "llama", dtype="float64", backend=backend)
    m, cfg = lm.model, lm.config
    weights, vocab = _save(lm, tmp_path)
    seen = []
    propose = EagleProposer.propose

    def recording(self, view):
        d = propose(self, view)
        for i, s in enumerate(view.slots):
            if d.num_draft[i] and (d.source is None or d.source[i] == 0):
                n = d.num_draft[i]
                root = d.parents[i, :n] == 0
                seen.append((view.tokens[s, : view.seq_lens[i]].copy(), d.draft_ids[i, :n][root],
                             d.scores[i, :n][root]))
        return d

    monkeypatch.setattr(EagleProposer, "propose", recording)
    rng = np.random.default_rng(5)
    prefix = rng.integers(3, 250, 12).tolist()
    prompts = [prefix + rng.integers(3, 250, int(n)).tolist() for n in (3, 9, 14)]
    spec = SpecConfig(method="eagle3", draft_model=str(tmp_path), adaptive=False, num_speculative_tokens=3,
                      eagle=EagleConfig(topk=3, nodes=64, copy=0))
    generate(prompts, model=lm, sampling=SamplingParams(max_tokens=8), speculative=spec,
             engine=EngineConfig(batch_size=2, dtype="float64", shared_prefix=shared, prefill_chunk=chunk,
                                 min_shared_prefix=8))
    assert len(seen) >= 6
    for seq, ids, probs in seen:
        n = len(seq) - 1  # positions 0..n-1 caught up, the last one with token seq[n]
        batch = build_forward_batch(np.array([0]), np.array([0]), np.array([n]), seq[:-1], np.array([True]))
        feats = m.forward(batch, m.new_cache(1, 64), features=FEATURES).features.numpy()
        want = numpy_eagle3(weights, cfg, feats, seq[1:], m.weights.embed.numpy())[-1]
        top = np.argsort(-want, kind="stable")[:3]
        assert sorted(ids.tolist()) == sorted(vocab[top].tolist())
        np.testing.assert_allclose(np.sort(probs), np.sort(np.exp(want[top])), atol=1e-9)
