"""Logits and greedy tokens equal HF transformers' on tiny random checkpoints of every architecture."""
import numpy as np
import pytest
from conftest import TINY, TINY_ARCHS

from specgen import EngineConfig, SamplingParams, generate, load_model
from specgen.runtime.batch import build_forward_batch


@pytest.mark.parametrize("backend", ["fused", "reference"])
@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_logits_and_greedy_match_transformers(arch, backend):
    ref = np.load(TINY / arch / "parity.npz")
    lm = load_model(TINY / arch, backend=backend)
    prompts = [ref[f"prompt_{i}"].astype(np.int64) for i in range(3)]
    lens = np.array([len(p) for p in prompts])
    batch = build_forward_batch(np.arange(3), np.zeros(3, np.int64), lens, np.concatenate(prompts),
                                np.ones(3, bool))
    logits = lm.model.forward(batch, lm.model.new_cache(3, 256)).logits
    logits = logits.numpy()
    cu = np.concatenate([[0], np.cumsum(lens)])
    for i in range(3):
        assert np.abs(logits[cu[i] : cu[i + 1]] - ref[f"logits_{i}"]).max() <= 1e-4
    outs = generate([p.tolist() for p in prompts], model=lm,
                    sampling=SamplingParams(max_tokens=12, ignore_eos=True), engine=EngineConfig(batch_size=2,
                                                                                                 backend=backend))
    for i, out in enumerate(outs):
        assert out.token_ids == ref[f"greedy_{i}"].tolist()
        assert out.finish_reason == "length"


def test_packed_forward_equals_one_at_a_time_for_any_grouping(monkeypatch):
    """Mixed decode and prefill blocks, the reference backend's prefill groups split and reordered by length:
    same logits."""
    from specgen.layers import attention

    lm = load_model(TINY / "llama", dtype="float64", backend="reference")
    m = lm.model
    rng = np.random.default_rng(0)
    lens = np.array([30, 3, 50, 2, 40, 1, 20])
    starts = np.array([0, 10, 0, 10, 0, 10, 0])
    toks = rng.integers(3, 300, lens.sum())
    context = np.tile(np.arange(10) + 5, 7)

    def run(slots, budget):
        cache = m.new_cache(7, 256)
        m.forward(build_forward_batch(slots, np.zeros(7, np.int64), np.full(7, 10), context,
                                      np.zeros(7, bool)), cache)
        b = build_forward_batch(slots, starts, lens, toks, np.ones(7, bool))
        monkeypatch.setattr(attention, "GROUP_BUDGET", budget)
        groups = attention.attention_groups(starts, lens, attention.GROUP_THRESHOLD, budget)
        return m.forward(b, cache).logits.numpy(), len(groups)

    ref, _ = run(np.arange(7), 1 << 30)
    for slots in (np.arange(7), np.array([6, 0, 5, 1, 4, 2, 3])):
        for budget in (1 << 30, 3000):
            out, num_groups = run(slots, budget)
            assert np.abs(out - ref).max() < 1e-12
    assert num_groups == 4
    # prefill blocks alone (one group, reordered by length) must come back in packed order
    cache = m.new_cache(3, 256)
    pl = np.array([25, 40, 18])
    b = build_forward_batch(np.arange(3), np.zeros(3, np.int64), pl, toks[: pl.sum()], np.zeros(3, bool))
    together = m.forward(b, cache).logits.numpy()
    cu = np.concatenate([[0], np.cumsum(pl)])
    for i in range(3):
        one = build_forward_batch(np.array([0]), np.array([0]), pl[i:i + 1], toks[cu[i]:cu[i + 1]],
                                  np.zeros(1, bool))
        assert np.abs(m.forward(one, m.new_cache(1, 256)).logits.numpy()[0] - together[i]).max() < 1e-12
