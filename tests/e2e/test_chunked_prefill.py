"""Chunked prefill changes nothing: outputs with prompts cut into 16/64/512-token chunks equal whole-prompt prefill,
with plain decoding, n-gram and MTP drafting (float64), and the chunks are counted."""
import numpy as np
import pytest

from conftest import TINY
from specgen import EngineConfig, SamplingParams, SpecConfig, generate, load_model
from specgen.engine.proposers.mtp import random_mtp_weights, save_mtp


@pytest.fixture(scope="module")
def tiny64(tmp_path_factory):
    """The tiny Qwen2 checkpoint with its context raised to 2048 positions (room for a 500-token prefix)."""
    import json
    import shutil

    d = tmp_path_factory.mktemp("tiny_long")
    shutil.copytree(TINY / "qwen2", d, dirs_exist_ok=True)
    cfg = json.loads((d / "config.json").read_text())
    cfg["max_position_embeddings"] = 2048
    (d / "config.json").write_text(json.dumps(cfg))
    return load_model(d, dtype="float64")


@pytest.fixture(scope="module")
def shared_prefix_prompts():
    """32 prompts sharing a 500-token system prefix, with their own tails of 3-60 tokens."""
    rng = np.random.default_rng(0)
    prefix = rng.integers(3, 250, 500).tolist()
    return [prefix + rng.integers(3, 250, int(n)).tolist() for n in rng.integers(3, 60, 32)]


def _sampling(n):
    return [SamplingParams(max_tokens=6 + i % 11, temperature=0.8 if i % 2 else 0.0, top_p=0.9, seed=i)
            for i in range(n)]


@pytest.mark.parametrize("method", ["none", "ngram", "mtp"])
def test_chunked_prefill_is_token_identical(tiny64, shared_prefix_prompts, method, tmp_path):
    spec = SpecConfig()
    if method == "ngram":
        spec = SpecConfig(method="ngram", num_speculative_tokens=3)
    elif method == "mtp":
        save_mtp(tmp_path, random_mtp_weights(tiny64.config, seed=3, std=0.3))
        spec = SpecConfig(method="mtp", num_speculative_tokens=2, mtp_model=str(tmp_path))
    sp = _sampling(len(shared_prefix_prompts))
    whole = generate(shared_prefix_prompts, model=tiny64, sampling=sp,
                     engine=EngineConfig(batch_size=8, dtype="float64"), speculative=spec)
    assert all(o.stats.num_prefill_chunks == 1 for o in whole)
    for chunk in (16, 64, 512):
        out = generate(shared_prefix_prompts, model=tiny64, sampling=sp, speculative=spec,
                       engine=EngineConfig(batch_size=8, dtype="float64", prefill_chunk=chunk, max_prefill_tokens=700))
        assert [o.token_ids for o in out] == [o.token_ids for o in whole], f"chunk {chunk}"
        for o in out:
            assert o.stats.num_prefill_chunks == -(-o.num_prompt_tokens // chunk)
            assert o.stats.num_emitted_tokens == o.stats.num_accepted_tokens + o.stats.num_steps


def test_step_budget_limits_prefill_tokens(tiny64):
    """With chunking, a step feeds at most max_prefill_tokens prompt tokens (but always at least one chunk)."""
    from specgen.engine.runner import Engine
    from specgen.engine.types import Request

    eng = Engine(tiny64.model, None, EngineConfig(batch_size=4, dtype="float64", prefill_chunk=32,
                                                  max_prefill_tokens=50))
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    for slot, n in enumerate((100, 40, 10, 5)):
        eng._place(slot, Request(str(slot), slot, tuple(range(3, 3 + n)), sp))
    new, chunk = eng._prefill_chunks()
    assert new.tolist() == [0] and chunk.tolist() == [32]  # 32 + 32 > 50
    eng.table.prefill_pos[0] = 96
    new, chunk = eng._prefill_chunks()
    assert new.tolist() == [0, 1, 2] and chunk.tolist() == [4, 32, 10]  # + 5 would make 51
