"""The two backends compute the same model: the fused CPU kernels and the Paddle reference (the path a GPU
user runs), on every tiny architecture. In float64 every method, batch size and prompt layout gives plain
decoding's tokens on both, and the two give each other's tokens; their logits agree to float64 rounding."""
import numpy as np
import pytest
from conftest import TINY, TINY_ARCHS

from specgen import EngineConfig, MtpConfig, SamplingParams, SpecConfig, generate, load_model
from specgen.drafters.mtp import random_mtp_weights, save_mtp
from specgen.runtime.batch import build_forward_batch

BACKENDS = ("fused", "reference")


@pytest.fixture(scope="module", params=TINY_ARCHS)
def pair(request):
    """The architecture's tiny checkpoint in float64 on each backend."""
    return {b: load_model(TINY / request.param, dtype="float64", backend=b) for b in BACKENDS}


def test_logits_and_hidden_states_agree(pair):
    rng = np.random.default_rng(0)
    lens = np.array([17, 1, 6])
    batch = build_forward_batch(np.arange(3), np.array([0, 0, 0]), lens, rng.integers(3, 250, lens.sum()),
                                np.ones(3, bool))
    outs = {b: lm.model.forward(batch, lm.model.new_cache(3, 64)) for b, lm in pair.items()}
    for field in ("logits", "hidden"):
        a, b = (getattr(outs[k], field).numpy() for k in BACKENDS)
        assert np.abs(a - b).max() <= 1e-10 * max(1.0, np.abs(b).max()), field
    assert np.array_equal(outs["fused"].greedy, outs["reference"].greedy)


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_every_method_gives_plain_tokens_on_both_backends(pair, mode, tmp_path):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 250, int(n)).tolist() for n in rng.integers(2, 40, 9)]
    prompts += [p[:12] + p for p in prompts[:3]]  # text that repeats: n-gram and MTP copies find drafts
    sp = [SamplingParams(max_tokens=6 + i % 9, temperature=0.8 if mode == "sampled" else 0.0, top_p=0.9,
                         seed=i, ignore_eos=True) for i in range(len(prompts))]
    cfg = next(iter(pair.values())).config
    save_mtp(tmp_path, random_mtp_weights(cfg, seed=2, std=0.3))
    methods = [SpecConfig(), SpecConfig(method="ngram", num_speculative_tokens=3, adaptive=False),
               SpecConfig(method="mtp", num_speculative_tokens=2, adaptive=False,
                          mtp=MtpConfig(model=str(tmp_path)))]
    runs = {}
    for backend, lm in pair.items():
        for spec in methods:
            for bs in (7, 1):
                outs = generate(prompts, model=lm, sampling=sp, speculative=spec,
                                engine=EngineConfig(batch_size=bs, dtype="float64", backend=backend))
                runs[backend, spec.method.value, bs] = [o.token_ids for o in outs]
                if spec.method.value != "none":
                    assert sum(o.stats.num_draft_tokens for o in outs) > 0
    want = runs["fused", "none", 7]
    assert all(r == want for r in runs.values()), [k for k, r in runs.items() if r != want]


def test_mtp_drafts_agree_between_backends(pair, tmp_path):
    """The head's pass (catch-up, chained drafts over a draft vocabulary) on the fused kernels and on Paddle's
    operators: the same drafts in float64."""
    from specgen.backends.base import MtpPass
    from specgen.drafters.mtp import MtpHeadWeights

    cfg = next(iter(pair.values())).config
    weights = random_mtp_weights(cfg, seed=5, std=0.3)
    vocab = np.arange(2, cfg.vocab_size, 3)
    rng = np.random.default_rng(4)
    seqs = [rng.integers(3, 250, 8 + trial).tolist() for trial in range(6)]
    drafts = {}
    for backend, lm in pair.items():
        m = lm.model
        runner = m.backend.prepare_drafter(m, MtpHeadWeights.read(weights, "random", m, vocab), quantize=True)
        got = []
        for seq in seqs:
            n = len(seq) - 1
            hidden = m.forward(build_forward_batch(np.array([0]), np.array([0]), np.array([n]),
                                                   np.array(seq[:-1]), np.array([True])),
                               m.new_cache(1, 64)).hidden
            cache = m.backend.new_cache(m, 1, m.max_len, "auto", num_layers=1)
            got.append(runner.run(cache, MtpPass(
                token_slots=np.zeros(n, np.int64), positions=np.arange(n), token_ids=np.array(seq[1:]),
                rows=np.arange(n), hidden=hidden, seq_lens=np.array([n]), last_rows=np.array([n - 1]),
                depth=3))[0].tolist())
        drafts[backend] = got
    assert drafts["fused"] == drafts["reference"]
