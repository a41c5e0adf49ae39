"""Chunked prefill and the shared prefix change nothing: outputs with prompts cut into 16/64/512-token chunks,
and with a 500-token prefix computed once (cascade attention), equal whole-prompt prefill, with plain
decoding, n-gram and MTP drafting (float64), on both backends; chunks and reused prefix tokens are counted,
and memory shrinks."""
import numpy as np
import pytest
from conftest import TINY

from specgen import EngineConfig, MtpConfig, SamplingParams, SpecConfig, generate, load_model
from specgen.drafters.mtp import random_mtp_weights, save_mtp


@pytest.fixture(scope="module", params=["fused", "reference"])
def tiny64(tmp_path_factory, request):
    """The tiny Qwen2 checkpoint with its context raised to 2048 positions (room for a 500-token prefix), on
    each backend."""
    import json
    import shutil

    d = tmp_path_factory.mktemp("tiny_long")
    shutil.copytree(TINY / "qwen2", d, dirs_exist_ok=True)
    cfg = json.loads((d / "config.json").read_text())
    cfg["max_position_embeddings"] = 2048
    (d / "config.json").write_text(json.dumps(cfg))
    return load_model(d, dtype="float64", backend=request.param)


@pytest.fixture(scope="module")
def shared_prefix_prompts():
    """32 prompts sharing a 500-token system prefix, with their own tails of 3-60 tokens."""
    rng = np.random.default_rng(0)
    prefix = rng.integers(3, 250, 500).tolist()
    return [prefix + rng.integers(3, 250, int(n)).tolist() for n in rng.integers(3, 60, 32)]


def _sampling(n):
    return [SamplingParams(max_tokens=6 + i % 11, temperature=0.8 if i % 2 else 0.0, top_p=0.9, seed=i)
            for i in range(n)]


VARIANTS = [("off", 16), ("off", 64), ("off", 512), ("auto", 0), ("auto", 16), ("auto", 64)]


@pytest.mark.parametrize("method", ["none", "ngram", "mtp", "draft_model"])
def test_chunked_prefill_and_shared_prefix_are_token_identical(tiny64, shared_prefix_prompts, method,
                                                               tmp_path):
    spec = SpecConfig()
    if method == "draft_model":  # a 1-layer cut of the model (its drafts often right, often not)
        from specgen.models import load_checkpoint
        from specgen.models.export import first_layers, save_hf

        save_hf(first_layers(load_checkpoint(tiny64.source), 1), tmp_path / "draft")
        spec = SpecConfig(method="draft_model", num_speculative_tokens=3, draft_model=str(tmp_path / "draft"))
    elif method == "ngram":
        spec = SpecConfig(method="ngram", num_speculative_tokens=3)
    elif method == "mtp":
        # as if trained on 64-position windows: the head sees each prompt's last 128 positions (chunks and the
        # shared prefix before them get no head pass)
        save_mtp(tmp_path, random_mtp_weights(tiny64.config, seed=3, std=0.3),
                 extra={"specgen_training": {"seq_len": 64}})
        spec = SpecConfig(method="mtp", num_speculative_tokens=2, mtp=MtpConfig(model=str(tmp_path)))
    sp = _sampling(len(shared_prefix_prompts))
    whole = generate(shared_prefix_prompts, model=tiny64, sampling=sp, speculative=spec,
                     engine=EngineConfig(batch_size=8, dtype="float64", shared_prefix="off"))
    assert all(o.stats.num_prefill_chunks == 1 and o.stats.num_cached_prompt_tokens == 0 for o in whole)
    for shared, chunk in VARIANTS:
        engine = EngineConfig(batch_size=8, dtype="float64", prefill_chunk=chunk, max_prefill_tokens=700,
                              shared_prefix=shared)
        out = generate(shared_prefix_prompts, model=tiny64, sampling=sp, speculative=spec, engine=engine)
        assert [o.token_ids for o in out] == [o.token_ids for o in whole], f"shared {shared} chunk {chunk}"
        for o in out:
            cached = 500 if shared == "auto" else 0
            assert o.stats.num_cached_prompt_tokens == cached
            own = o.num_prompt_tokens - cached
            assert o.stats.num_prefill_chunks == (-(-own // chunk) if chunk else 1)
            assert o.stats.num_emitted_tokens == o.stats.num_accepted_tokens + o.stats.num_steps
            assert sum(o.stats.drafted_per_position) == o.stats.num_draft_tokens
            assert all(a <= d for a, d in zip(o.stats.accepted_per_position, o.stats.drafted_per_position))


def test_shared_prefix_saves_cache_memory(tiny64, shared_prefix_prompts):
    """With 32 slots sharing the 500-token prefix, the slots' own rows cover only tails and outputs."""
    from specgen.api import make_engine
    from specgen.engine.types import Request

    def run(shared):
        eng = make_engine(tiny64, EngineConfig(batch_size=32, dtype="float64", shared_prefix=shared),
                          SpecConfig())
        reqs = [Request(str(i), i, tuple(p), SamplingParams(max_tokens=8, ignore_eos=True))
                for i, p in enumerate(shared_prefix_prompts)]
        outs = list(eng.run(reqs))
        return eng.memory(), sorted((o.id, o.token_ids) for o in outs)

    (mem_shared, out_shared), (mem_plain, out_plain) = run("auto"), run("off")
    assert out_shared == out_plain
    assert mem_plain["kv_cache_bytes"] == mem_plain["kv_cache_bytes_unshared"]
    assert mem_shared["kv_cache_bytes_unshared"] == mem_plain["kv_cache_bytes"]
    assert mem_shared["kv_cache_bytes"] * 4 < mem_plain["kv_cache_bytes"]


def test_no_sharing_below_the_minimum_or_for_prompts_without_the_prefix(tiny64):
    from specgen.api import make_engine
    from specgen.engine.slots import common_prefix

    assert common_prefix([[1, 2, 3, 4], [1, 2, 5], [1, 2, 3]]) == [1, 2]
    assert common_prefix([[1, 2, 3]]) == []
    eng = make_engine(tiny64, EngineConfig(batch_size=4, dtype="float64"), SpecConfig())
    assert eng.share_prefix(list(range(3, 40))) == 0  # 37 < min_shared_prefix (64)
    assert eng.share_prefix(list(range(3, 103))) == 100
    from specgen.engine.types import Request

    sp = SamplingParams(max_tokens=2)
    eng._place(0, Request("a", 0, tuple(range(3, 103)) + (7, 8), sp))
    eng._place(1, Request("b", 1, tuple(range(4, 110)), sp))
    eng._place(2, Request("c", 2, tuple(range(3, 103)), sp))  # the prefix itself: keeps one token to prefill
    assert eng.table.prefix_len[:3].tolist() == [100, 0, 99]


def test_step_budget_limits_prefill_tokens(tiny64):
    """With chunking, a step feeds at most max_prefill_tokens prompt tokens (but always at least
    one chunk)."""
    from specgen.engine.engine import Engine
    from specgen.engine.types import Request

    eng = Engine(tiny64.model, None, EngineConfig(batch_size=4, dtype="float64", prefill_chunk=32,
                                                  max_prefill_tokens=50, shared_prefix="off"))
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    for slot, n in enumerate((100, 40, 10, 5)):
        eng._place(slot, Request(str(slot), slot, tuple(range(3, 3 + n)), sp))
    new, chunk = eng._prefill_chunks()
    assert new.tolist() == [0] and chunk.tolist() == [32]  # 32 + 32 > 50
    eng.table.prefill_pos[0] = 96
    new, chunk = eng._prefill_chunks()
    assert new.tolist() == [0, 1, 2] and chunk.tolist() == [4, 32, 10]  # + 5 would make 51


def test_mtp_drafts_are_the_same_with_chunks_and_a_shared_prefix(tiny64, shared_prefix_prompts, tmp_path,
                                                                 monkeypatch):
    """The head's window (a prompt's last 128 positions here) holds the same entries whether the prompt was
    prefilled whole, in chunks, or read from the shared prefix: every draft offered for the same text is the
    same (every draft verified, so that each variant drafts at the same points)."""
    from specgen.engine.proposers.mtp import MtpProposer

    drafts: dict[tuple, tuple] = {}
    propose = MtpProposer.propose

    def logged(self, view):
        d = propose(self, view)
        for i, s in enumerate(view.slots):
            drafts[tuple(view.tokens[s, : view.seq_lens[i]].tolist())] = tuple(
                d.draft_ids[i, : d.num_draft[i]])
        return d

    monkeypatch.setattr(MtpProposer, "propose", logged)
    save_mtp(tmp_path, random_mtp_weights(tiny64.config, seed=3, std=0.3),
             extra={"specgen_training": {"seq_len": 64}})
    spec = SpecConfig(method="mtp", num_speculative_tokens=2, adaptive=False,
                      mtp=MtpConfig(model=str(tmp_path), copy=0))
    prompts = shared_prefix_prompts[:16]
    logs = []
    for shared, chunk in [("off", 0), ("auto", 0), ("auto", 16), ("off", 64)]:
        drafts.clear()
        generate(prompts, model=tiny64, sampling=SamplingParams(max_tokens=12, ignore_eos=True),
                 speculative=spec,
                 engine=EngineConfig(batch_size=8, dtype="float64", shared_prefix=shared, prefill_chunk=chunk,
                                     max_prefill_tokens=700))
        logs.append(dict(drafts))
    common = set(logs[0]).intersection(*logs[1:])
    assert len(common) >= 100
    assert all(log[text] == logs[0][text] for log in logs[1:] for text in common)


def test_slots_with_and_without_the_shared_prefix_decode_together(tiny64):
    """A slot reading a 200-token shared prefix deep into its output (absolute positions past its own rows'
    capacity) decodes beside a slot placed later without the prefix: the same tokens as without sharing."""
    rng = np.random.default_rng(5)
    prefix = rng.integers(3, 250, 200).tolist()
    prompts = [prefix + rng.integers(3, 250, 8).tolist(), prefix + rng.integers(3, 250, 5).tolist(),
               rng.integers(3, 250, 140).tolist()]
    sp = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (120, 2, 60)]
    runs = [generate(prompts, model=tiny64, sampling=sp,
                     engine=EngineConfig(batch_size=2, dtype="float64", shared_prefix=shared,
                                         min_shared_prefix=64))
            for shared in ("auto", "off")]
    assert [o.stats.num_cached_prompt_tokens for o in runs[0]] == [200, 200, 0]
    assert [o.token_ids for o in runs[0]] == [o.token_ids for o in runs[1]]
