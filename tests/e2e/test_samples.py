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


@pytest.fixture(scope="module")
def drafter_specs(tmp_path_factory) -> dict[str, SpecConfig]:
    """Random drafters of every learned kind for the tiny model, each as its SpecConfig."""
    from heads import random_eagle, random_eagle3, random_hydra, random_medusa

    from specgen.config import EagleConfig, MtpConfig
    from specgen.drafters.eagle import save_eagle
    from specgen.drafters.eagle3 import save_eagle3
    from specgen.drafters.hydra import save_hydra
    from specgen.drafters.medusa import save_medusa
    from specgen.drafters.mtp import random_mtp_weights, save_mtp
    from specgen.models import load_checkpoint
    from specgen.models.export import first_layers, save_hf

    d = tmp_path_factory.mktemp("drafters")
    ckpt = load_checkpoint(TINY / "llama")
    save_mtp(d / "mtp", random_mtp_weights(ckpt.config, seed=0, std=0.02))
    save_hf(first_layers(ckpt, 1), d / "cut")
    save_medusa(d / "medusa", *random_medusa(ckpt.config, 3, 0))
    save_hydra(d / "hydra", *random_hydra(ckpt.config, 3, 0))
    save_eagle(d / "eagle", random_eagle(ckpt.config, 0), ckpt.config)
    lm = np.asarray(ckpt.weights["lm_head.weight"], np.float32)
    save_eagle3(d / "eagle3", random_eagle3(ckpt.config, 0, lm, np.arange(0, ckpt.config.vocab_size, 2)),
                ckpt.config, (0, 1, 2))
    common = dict(num_speculative_tokens=3, adaptive=False)
    tree = EagleConfig(topk=2, nodes=6, copy=0)
    return {"mtp": SpecConfig(method="mtp", mtp=MtpConfig(model=str(d / "mtp")), **common),
            "draft_model": SpecConfig(method="draft_model", draft_model=str(d / "cut"), **common),
            **{m: SpecConfig(method=m, draft_model=str(d / m), **common) for m in ("medusa", "hydra")},
            **{m: SpecConfig(method=m, draft_model=str(d / m), eagle=tree, **common)
               for m in ("eagle", "eagle3")}}


def _recording(eng) -> dict:
    """Record every draft the engine's proposer offers: {(request, sample, length): drafts}."""
    drafted, propose = {}, eng.proposer.propose

    def recording(view):
        d = propose(view)
        for i, slot in enumerate(view.slots):
            r = eng.requests[slot]
            drafted[(r.id, r.sample_index, int(view.seq_lens[i]))] = d.draft_ids[i, : d.num_draft[i]].tolist()
        return d

    eng.proposer.propose = recording
    return drafted


@pytest.mark.parametrize("method, window", [("mtp", 0), ("mtp", 8), ("draft_model", 0), ("draft_model", 8),
                                            ("medusa", 0), ("hydra", 0), ("eagle", 0), ("eagle3", 0)])
def test_drafters_with_prompt_state_share_the_prefill(tiny_model64, prompts, drafter_specs, method, window):
    """Drafters that keep state of the prompt (a head's or layer's cache, a draft model's, Medusa's guesses)
    copy sample 0's too: later samples prefill one token, and their tokens, every draft offered (the adaptive
    controller off: the drafts are the drafter's state alone) and drafting statistics equal those of samples
    that prefilled their whole prompt (batch 1), greedy (every sample the same tokens) and sampled, with
    chunked prefill; with a prompt window (the drafter reads a prompt's last 8 positions: its rows start
    there)."""
    from specgen.api import make_engine

    spec = drafter_specs[method]
    stats = ("num_draft_tokens", "num_accepted_tokens", "accepted_per_position", "drafted_per_position")

    def run(batch, temperature, chunk=0):
        eng = make_engine(tiny_model64, EngineConfig(batch_size=batch, dtype="float64", prefill_chunk=chunk),
                          spec)
        if window:
            eng.proposer.prompt_window = window
        drafted = _recording(eng)
        sp = SamplingParams(max_tokens=10, temperature=temperature, seed=5, n=3, ignore_eos=True)
        reqs = [Request(str(i), i, tuple(p), sp, sample_index=j) for i, p in enumerate(prompts)
                for j in range(3)]
        out = sorted(eng.run(reqs), key=lambda o: (o.index, o.sample_index))
        return out, [(o.token_ids, *(getattr(o.stats, k) for k in stats)) for o in out], drafted

    for temperature in (0.0, 0.9):
        shared, got, drafts = run(9, temperature)
        alone, want, drafts_alone = run(1, temperature)
        assert got == want
        assert drafts == drafts_alone and sum(map(len, drafts.values())) > 0
        assert [o.stats.num_cached_prompt_tokens for o in shared] == [
            len(prompts[o.index]) - 1 if o.sample_index else 0 for o in shared]
        assert all(o.stats.num_cached_prompt_tokens == 0 for o in alone)
        assert sum(o.stats.num_draft_tokens for o in shared) > 0
    assert run(6, 0.9, chunk=8)[1:] == (want, drafts_alone)


@pytest.mark.parametrize("method", ["mtp", "draft_model"])
def test_a_detached_sample_0_gives_no_drafter_state(tiny_model64, prompts, drafter_specs, method,
                                                    monkeypatch):
    """Under the adaptive controller, a sample 0 placed detached never caught its drafter up on the prompt:
    its later samples still copy its KV rows, and are placed detached too (the drafter has nothing of their
    prompt to draft from); one that prefills alone (batch 1) stays attached and drafts."""
    import dataclasses

    from specgen.api import make_engine
    from specgen.engine.adaptive.controller import Controller

    reset = Controller.reset
    spec = dataclasses.replace(drafter_specs[method], adaptive=True)

    def run(batch):
        eng = make_engine(tiny_model64, EngineConfig(batch_size=batch, dtype="float64"), spec)

        def detach_sample_0(self, slot):  # sample 0 placed detached, the others attached
            reset(self, slot)
            self.idle[slot] = self.DETACH_AFTER if eng.requests[slot].sample_index == 0 else 0

        monkeypatch.setattr(Controller, "reset", detach_sample_0)
        attached, propose = [], eng.proposer.propose

        def recording(view):  # (sample index, attached) of every decoding slot at every step
            attached.extend((eng.requests[s].sample_index, not eng.controller.detached(np.array([s]))[0])
                            for s in view.slots)
            return propose(view)

        eng.proposer.propose = recording
        sp = SamplingParams(max_tokens=8, temperature=0.9, seed=5, n=2, ignore_eos=True)
        reqs = [Request(str(i), i, tuple(p), sp, sample_index=j) for i, p in enumerate(prompts[:2])
                for j in range(2)]
        return sorted(eng.run(reqs), key=lambda o: (o.index, o.sample_index)), attached

    shared, attached = run(4)
    alone, attached_alone = run(1)
    assert [o.token_ids for o in shared] == [o.token_ids for o in alone]
    assert [o.stats.num_cached_prompt_tokens for o in shared] == [
        len(prompts[o.index]) - 1 if o.sample_index else 0 for o in shared]  # the KV rows still copied
    assert not any(a for _, a in attached)  # sample 1 placed detached beside sample 0 (if proposed for)
    assert any(a for j, a in attached_alone if j == 1)  # alone, it drafts
    assert sum(o.stats.num_draft_tokens for o in alone if o.sample_index) > 0


def test_drafters_that_keep_prompt_state_prefill_each_sample(tiny_model64, prompts):
    """A drafter that keeps state of the prompt and cannot copy it (clone_safe False: multi-module MTP) is not
    given copied rows: each sample prefills, with the same tokens."""
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
