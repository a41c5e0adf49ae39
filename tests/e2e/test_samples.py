"""n samples per prompt: sample j draws from its own stream (seed, request, j, position), so its tokens do not
depend on the batch, the placement, the method or whether its prompt's rows were copied from sample 0's
prefill; sample 0 is the request as n = 1 runs it."""
import numpy as np
import pytest
from conftest import TINY

from specgen import EngineConfig, SamplingParams, SpecConfig, load_model
from specgen.engine.engine import Engine
from specgen.engine.proposers import build_proposer
from specgen.engine.types import Request


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(3, 250, int(k)).tolist() * 2 for k in (15, 6, 25, 9)]


def _run(lm, prompts, n, batch, method="none", dtype="float64", proposer=None, **kw):
    engine = EngineConfig(batch_size=batch, dtype=dtype, prefill_chunk=kw.pop("prefill_chunk", 0))
    spec = SpecConfig(method=method, num_speculative_tokens=3, adaptive=False)
    if method != "none":
        proposer = build_proposer(spec, lm.model)
    eng = Engine(lm.model, lm.tokenizer, engine, proposer)
    sp = SamplingParams(max_tokens=10, temperature=0.9, seed=5, n=n, ignore_eos=True, **kw)
    reqs = [Request(str(i), i, tuple(p), sp, sample_index=j) for i, p in enumerate(prompts) for j in range(n)]
    return sorted(eng.run(reqs), key=lambda o: (o.index, o.sample_index))


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_samples_do_not_depend_on_batch_method_or_shared_prefill(prompts, dtype):
    lm = load_model(TINY / "llama", dtype=dtype)
    shared = _run(lm, prompts, 4, 16, dtype=dtype)  # every later sample copies sample 0's prompt rows
    alone = _run(lm, prompts, 4, 1, dtype=dtype)  # one slot: each sample prefills its own prompt
    tokens = [o.token_ids for o in shared]
    assert tokens == [o.token_ids for o in alone]
    assert [o.token_ids for o in _run(lm, prompts, 4, 5, "ngram", dtype=dtype)] == tokens
    assert [o.token_ids for o in _run(lm, prompts, 4, 6, dtype=dtype, prefill_chunk=8)] == tokens
    for o in shared:  # later samples prefilled one token of their own; none did alone
        assert o.stats.num_cached_prompt_tokens == (len(prompts[o.index]) - 1 if o.sample_index else 0)
    assert all(o.stats.num_cached_prompt_tokens == 0 for o in alone)
    one = _run(lm, prompts, 1, 4, dtype=dtype)  # n = 1: sample 0's stream
    assert [o.token_ids for o in one] == [o.token_ids for o in shared if o.sample_index == 0]
    for i in range(len(prompts)):  # sampled at T 0.9: the samples differ
        assert len({tuple(o.token_ids) for o in shared if o.index == i}) > 1


def test_greedy_samples_agree_and_penalties_hold(tiny_model64, prompts):
    """Greedy samples are the same tokens; per-sample processing (penalties, logprobs) follows each slot."""
    eng = Engine(tiny_model64.model, None, EngineConfig(batch_size=8, dtype="float64"))
    sp = SamplingParams(max_tokens=8, n=3, repetition_penalty=1.3, logprobs=True, top_logprobs=2)
    out = sorted(eng.run([Request("a", 0, tuple(prompts[0]), sp, sample_index=j) for j in range(3)]),
                 key=lambda o: o.sample_index)
    assert out[0].token_ids == out[1].token_ids == out[2].token_ids
    assert out[0].logprobs == out[2].logprobs
    assert out[1].stats.num_cached_prompt_tokens == len(prompts[0]) - 1


def test_drafters_that_keep_prompt_state_prefill_each_sample(tiny_model64, prompts):
    """A drafter that keeps state of the prompt (here a head drafting from hidden states) is not given copied
    rows: each sample prefills, with the same tokens."""
    from specgen.engine.proposers.base import NoProposer

    class Stateful(NoProposer):
        clone_safe = False

    out = _run(tiny_model64, prompts, 3, 8, proposer=Stateful())
    assert all(o.stats.num_cached_prompt_tokens == 0 for o in out)
    assert [o.token_ids for o in out] == [o.token_ids for o in _run(tiny_model64, prompts, 3, 8)]


def test_samples_enter_together_and_ids_may_repeat(tiny_model64, prompts):
    """Once sample 0 is prefilled its n - 1 siblings enter in one step (not one a step); two prompts under one
    id each copy their own rows."""
    eng = Engine(tiny_model64.model, None, EngineConfig(batch_size=8, dtype="float64"))
    sp = SamplingParams(max_tokens=6, temperature=0.9, n=4, ignore_eos=True)
    outs = list(eng.run([Request("a", 0, tuple(prompts[0]), sp, sample_index=j) for j in range(4)]))
    assert eng.num_steps == 7  # sample 0's prefill, then 6 steps with all four (three prefill 1 token)
    assert sorted(o.stats.num_cached_prompt_tokens for o in outs) == [0] + [len(prompts[0]) - 1] * 3
    from specgen import generate

    same_id = generate(prompts[:2], model=tiny_model64, sampling=sp, ids=["q", "q"],
                       engine=EngineConfig(batch_size=8, dtype="float64"))
    apart = [generate([p], model=tiny_model64, sampling=sp, ids=["q"],
                      engine=EngineConfig(batch_size=8, dtype="float64")) for p in prompts[:2]]
    assert [o.token_ids for o in same_id] == [o.token_ids for o in apart[0] + apart[1]]
