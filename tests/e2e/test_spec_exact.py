"""Speculation changes nothing: ngram and mtp outputs equal plain decoding on the real model (float64)."""
import pytest

from specgen import EngineConfig, MtpConfig, SamplingParams, SpecConfig, generate
from specgen.drafters.mtp import random_mtp_weights, save_mtp

pytestmark = [pytest.mark.realmodel, pytest.mark.slow]

SAMPLING = {
    "greedy": lambda i: SamplingParams(max_tokens=4 + (i * 5) % 17),
    "sampled": lambda i: SamplingParams(max_tokens=4 + (i * 5) % 17, temperature=0.8, top_p=0.9,
                                        seed=1000 + i),
}


@pytest.fixture(scope="module")
def prompts(real_model64, spec_bench):
    picked = spec_bench[::15][:32]  # every category, mixed lengths (~25-200 tokens)
    return [list(real_model64.tokenizer.encode_chat([{"role": "user",
                                                      "content": q["turns"][0][: 60 + 24 * i]}]))
            for i, q in enumerate(picked)]


@pytest.fixture(scope="module")
def plain(real_model64, prompts):
    return {mode: generate(prompts, model=real_model64, sampling=[f(i) for i in range(len(prompts))],
                           engine=EngineConfig(batch_size=32, dtype="float64"))
            for mode, f in SAMPLING.items()}


@pytest.fixture(scope="module")
def mtp_dir(real_model64, tmp_path_factory):
    d = tmp_path_factory.mktemp("mtp")
    save_mtp(d, random_mtp_weights(real_model64.config, seed=0, std=0.02))
    return str(d)


# Every k and every batch size (1, 7, 32) for both methods and both modes. The other k x batch pairs run
# the same code paths; leaving them out keeps the suite inside CI's time. Batch 1 runs every fourth prompt
# (8, all six categories, short to long): one slot runs them one after another, whose float64 steps each read
# the model's 1 GB of weights: the costliest case. "mtp" drafts with the head and copies
# (SpecConfig.mtp_copy's default), "mtp/head" with the head alone.
CASES = [("ngram", 1, 32), ("ngram", 3, 7), ("ngram", 5, 32), ("ngram", 5, 7), ("ngram", 5, 1),
         ("mtp", 1, 32), ("mtp/head", 2, 7), ("mtp", 2, 1)]


@pytest.mark.parametrize("mode", list(SAMPLING))
@pytest.mark.parametrize("method,k,batch_size", CASES)
def test_speculative_equals_plain(real_model64, prompts, plain, mtp_dir, mode, method, k, batch_size):
    mtp = method.startswith("mtp")
    spec = SpecConfig(method="mtp" if mtp else method, num_speculative_tokens=k, adaptive=False,
                      mtp=MtpConfig(model=mtp_dir if mtp else None, copy=0 if method == "mtp/head" else 2))
    picked = range(0, len(prompts), 4 if batch_size == 1 else 1)
    outs = generate([prompts[i] for i in picked], model=real_model64,
                    sampling=[SAMPLING[mode](i) for i in picked], ids=[str(i) for i in picked],
                    engine=EngineConfig(batch_size=batch_size, dtype="float64"), speculative=spec)
    ref = [plain[mode][i] for i in picked]
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert [o.finish_reason for o in outs] == [o.finish_reason for o in ref]
    drafted = sum(o.stats.num_draft_tokens for o in outs)
    assert drafted > 0
    for o in outs:
        s = o.stats
        assert s.num_emitted_tokens == s.num_accepted_tokens + s.num_steps == len(o.token_ids)
        assert sum(s.accepted_per_position) == s.num_accepted_tokens
    # copied drafts are accepted (the random head's are not)
    if method in ("ngram", "mtp") and mode == "greedy":
        assert sum(o.stats.num_accepted_tokens for o in outs) > 0


@pytest.fixture(scope="module")
def real_ref64():
    """The default model on the reference backend (Paddle's operators: a GPU user's path), float64."""
    from specgen import load_model

    return load_model(None, dtype="float64", backend="reference")


@pytest.mark.parametrize("mode", list(SAMPLING))
@pytest.mark.parametrize("method,k", [("ngram", 3), ("mtp", 2)])
def test_reference_backend_equals_plain(real_ref64, prompts, plain, mtp_dir, mode, method, k):
    """The reference backend: speculative outputs equal the fused backend's plain outputs (7 slots, every
    fourth prompt)."""
    spec = SpecConfig(method=method, num_speculative_tokens=k, adaptive=False,
                      mtp=MtpConfig(model=mtp_dir if method == "mtp" else None))
    picked = range(0, len(prompts), 4)
    outs = generate([prompts[i] for i in picked], model=real_ref64,
                    sampling=[SAMPLING[mode](i) for i in picked], ids=[str(i) for i in picked],
                    speculative=spec, engine=EngineConfig(batch_size=7, dtype="float64", backend="reference"))
    assert [o.token_ids for o in outs] == [plain[mode][i].token_ids for i in picked]
    assert sum(o.stats.num_draft_tokens for o in outs) > 0
