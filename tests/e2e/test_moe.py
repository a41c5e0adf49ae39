"""Mixture-of-experts models (qwen3_moe, ernie4_5_moe): the router's math, a row's bits independent of its
batch on the fused kernels, tokens per expert counted alike on both backends, and every speculative method
giving plain decoding's tokens (greedy and sampled, batch 1 / 7 / 32, float64). Parity with transformers and
the two backends' agreement run in tests/unit/test_parity.py and tests/e2e/test_backends.py (both cover the
MoE fixtures)."""
import numpy as np
import paddle
import pytest
from conftest import TINY
from heads import random_eagle, random_hydra, random_medusa

from specgen import EngineConfig, MtpConfig, SamplingParams, SpecConfig, generate, load_model
from specgen.drafters.eagle import save_eagle
from specgen.drafters.hydra import save_hydra
from specgen.drafters.medusa import save_medusa
from specgen.drafters.mtp import random_mtp_weights, save_mtp
from specgen.layers.linear import Linear
from specgen.layers.moe import MoeExperts, route
from specgen.runtime.batch import build_forward_batch

MOE_ARCHS = ["qwen3_moe", "ernie4_5_moe"]


@pytest.mark.parametrize("norm", [False, True])
def test_router_picks_by_biased_score_and_weights_by_probability(norm):
    """The top-k by softmax + selection bias, weighted by the plain softmax, renormalised only with norm."""
    rng = np.random.default_rng(0)
    h, w, bias = rng.standard_normal((6, 8)), rng.standard_normal((8, 5)), rng.standard_normal(5) * 0.3
    m = MoeExperts(router=Linear(paddle.to_tensor(w)), experts=[], num_experts=5, top_k=2,
                   norm_topk_prob=norm, norm_min=1e-12, selection_bias=paddle.to_tensor(bias))
    ids, weights = route(paddle.to_tensor(h), m)
    logits = h @ w
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    want = np.argsort(-(probs + bias), axis=1, kind="stable")[:, :2]
    want_w = np.take_along_axis(probs, want, 1)
    if norm:
        want_w /= want_w.sum(1, keepdims=True)
    assert np.array_equal(ids.numpy(), want)
    assert np.allclose(weights.numpy(), want_w, rtol=1e-12, atol=0)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_a_rows_bits_do_not_depend_on_its_batch(arch):
    """float32, fused: each slot's verify block computed alone, and in one batch with the others (in another
    slot order): identical logits, bit for bit, though the experts then multiply different sets of tokens."""
    m = load_model(TINY / arch, dtype="float32", backend="fused").model
    rng = np.random.default_rng(3)
    prompt_lens, block_lens = np.array([9, 14, 5, 20, 7, 11, 3]), np.array([1, 6, 3, 4, 1, 2, 5])
    prompts, blocks = rng.integers(3, 297, prompt_lens.sum()), rng.integers(3, 297, block_lens.sum())
    cu = np.concatenate([[0], np.cumsum(block_lens)])
    pcu = np.concatenate([[0], np.cumsum(prompt_lens)])

    def verify(slots, order):
        cache = m.new_cache(7, 64)
        m.forward(build_forward_batch(slots, np.zeros(7, np.int64), prompt_lens, prompts, np.zeros(7, bool)),
                  cache)
        toks = np.concatenate([blocks[cu[i]:cu[i + 1]] for i in order])
        out = m.forward(build_forward_batch(slots[order], prompt_lens[order], block_lens[order], toks,
                                            np.ones(len(order), bool)), cache).logits.numpy()
        ends = np.concatenate([[0], np.cumsum(block_lens[order])])
        return {int(i): out[ends[j]:ends[j + 1]] for j, i in enumerate(order)}

    together = verify(np.arange(7), np.arange(7))
    shuffled = verify(np.array([3, 6, 0, 5, 1, 4, 2]), np.array([4, 0, 6, 2, 5, 1, 3]))
    for i in range(7):
        alone = build_forward_batch(np.array([0]), np.array([0]), prompt_lens[i:i + 1],
                                    prompts[pcu[i]:pcu[i + 1]], np.array([False]))
        cache = m.new_cache(1, 64)
        m.forward(alone, cache)
        one = m.forward(build_forward_batch(np.array([0]), prompt_lens[i:i + 1], block_lens[i:i + 1],
                                            blocks[cu[i]:cu[i + 1]], np.array([True])), cache).logits.numpy()
        assert np.array_equal(one, together[i]) and np.array_equal(one, shuffled[i])


def test_expert_counts_agree_between_backends():
    rng = np.random.default_rng(5)
    lens = np.array([12, 1, 7])
    batch = build_forward_batch(np.arange(3), np.zeros(3, np.int64), lens, rng.integers(3, 297, lens.sum()),
                                np.ones(3, bool))
    counts = {}
    for backend in ("fused", "reference"):
        m = load_model(TINY / "ernie4_5_moe", dtype="float64", backend=backend).model
        counts[backend] = m.forward(batch, m.new_cache(3, 64)).expert_counts
    moe = m.config.moe
    assert counts["fused"].shape == (len(moe.layers), moe.num_experts) == (2, 8)
    assert np.array_equal(counts["fused"], counts["reference"])
    assert (counts["fused"].sum(axis=1) == lens.sum() * moe.top_k).all()


def test_wint8_quantizes_every_expert_and_the_backends_agree():
    """--quantization wint8 puts each expert (and the shared experts) in Q8_0 blocks, not the router; the
    fused backend multiplies the blocks, the reference dequantizes them a layer at a time: the same logits up
    to float32 rounding."""
    rng = np.random.default_rng(6)
    lens = np.array([9, 3])
    batch = build_forward_batch(np.arange(2), np.zeros(2, np.int64), lens, rng.integers(3, 297, lens.sum()),
                                np.ones(2, bool))
    logits = {}
    for backend in ("fused", "reference"):
        m = load_model(TINY / "ernie4_5_moe", backend=backend, quantization="wint8").model
        logits[backend] = m.forward(batch, m.new_cache(2, 64)).logits.numpy()
        if backend == "fused":
            moe = m.weights.blocks[1].moe
            # packed from their blocks as read (the router from its float weights)
            assert (moe.experts[5].down.weight.kind == "Q8_0"
                    and m.weights.blocks[1].gate_up.weight.kind == "Q8_0")
            assert moe.router.weight.kind in ("F32", "BF16", "F16")
    assert np.abs(logits["fused"] - logits["reference"]).max() < 1e-4


def test_summary_of_expert_load():
    """Tokens per expert summed over the routed blocks; the load: busiest / mean expert per block,
    averaged."""
    from specgen.io.summary import SummaryAccumulator

    s = SummaryAccumulator().summary(1.0, expert_tokens=np.array([[3, 1, 2, 2], [0, 4, 4, 0]]))
    assert s.expert_tokens == [3, 5, 6, 2]
    assert s.expert_load_max_over_mean == pytest.approx((3 / 2 + 4 / 2) / 2)
    assert SummaryAccumulator().summary(1.0).expert_tokens is None


@pytest.fixture(scope="module")
def main64():
    return load_model(TINY / "ernie4_5_moe", dtype="float64")  # shared experts, selection bias, a dense layer


SAMPLING = {
    "greedy": lambda i: SamplingParams(max_tokens=5 + i % 11, ignore_eos=True),
    "sampled": lambda i: SamplingParams(max_tokens=5 + i % 11, temperature=0.8, top_p=0.9, seed=i,
                                        ignore_eos=True),
}


@pytest.mark.parametrize("mode", list(SAMPLING))
def test_every_method_gives_plain_tokens_at_every_batch_size(main64, mode, tmp_path):
    """ngram, mtp (a random head over the MoE model), draft_model (the Qwen3-MoE fixture as drafter, same
    vocabulary) and random Medusa, Hydra and EAGLE heads at batch 1, 7 and 32: plain decoding's tokens."""
    rng = np.random.default_rng(11)
    prompts = [rng.integers(3, 297, int(n)).tolist() for n in rng.integers(3, 30, 30)]
    prompts += [p[:10] + p + p[:10] for p in prompts[:4]]  # repeated text: n-gram and the head's copies draft
    sp = [SAMPLING[mode](i) for i in range(len(prompts))]
    save_mtp(tmp_path, random_mtp_weights(main64.config, seed=3, std=0.3))
    methods = {
        "ngram": SpecConfig(method="ngram", num_speculative_tokens=3, adaptive=False),
        "mtp": SpecConfig(method="mtp", num_speculative_tokens=2, adaptive=False,
                          mtp=MtpConfig(model=str(tmp_path))),
        "draft_model": SpecConfig(method="draft_model", num_speculative_tokens=3, adaptive=False,
                                  draft_model=str(TINY / "qwen3_moe")),
        # token trees: each node routed on its own inside the verify block
        **{m: SpecConfig(method=m, adaptive=False, draft_model=str(tmp_path / m))
           for m in ("medusa", "hydra", "eagle")},
    }
    cfg = main64.config
    save_medusa(tmp_path / "medusa",
                *random_medusa(cfg, 3, 1, main64.model.weights.lm_head.dense().numpy().T))
    save_hydra(tmp_path / "hydra", *random_hydra(cfg, 3, 1))
    save_eagle(tmp_path / "eagle", random_eagle(cfg, 1), cfg)
    ids = [str(i) for i in range(len(prompts))]  # a sampled token's random number depends on its request's id
    plain = [o.token_ids for o in generate(prompts, model=main64, sampling=sp, ids=ids,
                                           engine=EngineConfig(batch_size=32, dtype="float64"))]
    for name, spec in methods.items():
        for bs in (1, 7, 32):
            picked = range(0, len(prompts), 5 if bs == 1 else 1)  # one slot runs them one after another
            outs = generate([prompts[i] for i in picked], model=main64, sampling=[sp[i] for i in picked],
                            ids=[ids[i] for i in picked], engine=EngineConfig(batch_size=bs, dtype="float64"),
                            speculative=spec)
            assert [o.token_ids for o in outs] == [plain[i] for i in picked], (name, bs)
            assert sum(o.stats.num_draft_tokens for o in outs) > 0, (name, bs)
