"""Repetition, presence and frequency penalties, logit bias and min_tokens: greedy outputs equal a
step-by-step loop over the teacher-forced model's logits that applies them as transformers and OpenAI define
them, and speculation (chains and token trees, greedy and sampled, batch 1 and 4) changes no token."""
import numpy as np
import pytest
from conftest import TINY
from test_tree_exact import OracleTree, _run, speculated

from specgen import EngineConfig, SamplingParams, SpecConfig, generate, load_model
from specgen.runtime.batch import build_forward_batch

CASES = {
    "repetition": dict(repetition_penalty=1.3),
    "presence+frequency": dict(presence_penalty=0.5, frequency_penalty=0.3),
    "negative": dict(repetition_penalty=0.7, presence_penalty=-0.4, frequency_penalty=-0.2),
    "bias": dict(logit_bias={"65": 4.0, "141": -100.0}),
    "all": dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3, logit_bias={"7": 2.5},
                min_tokens=6),
}


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(3)
    return [[3 + i] + rng.integers(3, 250, int(n)).tolist() * 2 for i, n in enumerate(rng.integers(3, 20, 9))]


def _loop(lm, prompt: list[int], n: int, kw: dict, eos: int) -> list[int]:
    """Plain greedy decoding by hand: a whole forward over prompt + output each step, the penalties applied
    one token at a time as their definitions say; EOS and the stop token ids end it (kept)."""
    out: list[int] = []
    stops = {eos, *kw.get("stop_token_ids", ())}
    bias = {int(k): v for k, v in kw.get("logit_bias", {}).items()}
    for _ in range(n):
        ids = prompt + out
        batch = build_forward_batch(np.zeros(1, np.int64), np.zeros(1, np.int64), np.array([len(ids)]),
                                    np.array(ids, np.int64), np.ones(1, bool))
        row = lm.model.forward(batch, lm.model.new_cache(1, 256)).logits.numpy()[-1].astype(np.float64)
        if len(out) < kw.get("min_tokens", 0):
            row[list(stops)] = -np.inf
        for tok, b in bias.items():
            row[tok] += b
        p = kw.get("repetition_penalty", 1.0)
        for tok in set(ids):  # transformers' RepetitionPenaltyLogitsProcessor
            row[tok] = row[tok] / p if row[tok] > 0 else row[tok] * p
        for tok in set(out):  # OpenAI's: mu[j] - c[j] * alpha_frequency - (c[j] > 0) * alpha_presence
            row[tok] -= out.count(tok) * kw.get("frequency_penalty", 0.0) + kw.get("presence_penalty", 0.0)
        out.append(int(np.argmax(row)))
        if out[-1] in stops:
            break
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_equals_the_loop(tiny_models, prompts, case):
    """float64, fused and reference backends, batch 4; EOS set to a token the model emits often (so that
    min_tokens has something to hold back)."""
    kw, ref = CASES[case], tiny_models["reference64"]
    engine = EngineConfig(batch_size=4, dtype="float64")
    free = _run(ref, prompts, [SamplingParams(max_tokens=12, ignore_eos=True)] * len(prompts), engine)
    eos = int(np.bincount(np.array(sum((o.token_ids[2:] for o in free), []))).argmax())
    sp = [SamplingParams(max_tokens=12, **kw)] * len(prompts)
    want = [_loop(ref, p, 12, kw, eos) for p in prompts]
    for name in ("fused64", "reference64"):
        outs = _run(tiny_models[name], prompts, sp, EngineConfig(batch_size=4, dtype="float64",
                                                                 backend=name[:-2]), eos=eos)
        assert [o.token_ids for o in outs] == want, name
    assert [o.token_ids for o in free] != want  # the penalties changed something
    if "min_tokens" in kw:
        assert all(eos not in w[:6] for w in want) and any(eos in o.token_ids[:6] for o in free)


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_speculation_keeps_penalized_tokens(tiny_model64, prompts, mode):
    """n-gram chains and oracle token trees (most drafts right, so whole runs of drafts are verified at once
    and each position must see the drafts before it) give plain decoding's tokens."""
    kw = CASES["all"]
    sp = [SamplingParams(max_tokens=12, temperature=0.8 if mode == "sampled" else 0.0, seed=i, **kw)
          for i in range(len(prompts))]
    plain = _run(tiny_model64, prompts, sp, EngineConfig(batch_size=4, dtype="float64"))
    for _, tree, chain in speculated(tiny_model64, prompts, sp, plain):
        assert [o.token_ids for o in tree] == [o.token_ids for o in plain]
        assert [o.token_ids for o in chain] == [o.token_ids for o in plain]
        assert sum(o.stats.num_accepted_tokens for o in tree) > len(prompts)


def test_penalized_and_plain_requests_share_a_batch(tiny_model64, prompts):
    """A penalized request beside plain ones: each gets the tokens it gets alone; the plain ones keep the
    screened greedy path's tokens."""
    sp = [SamplingParams(max_tokens=10, **(CASES["all"] if i % 2 else {})) for i in range(len(prompts))]
    engine = EngineConfig(batch_size=4, dtype="float64")
    mixed = generate(prompts, model=tiny_model64, sampling=sp, engine=engine)
    for i, p in enumerate(prompts):
        alone = generate([p], model=tiny_model64, sampling=sp[i], engine=EngineConfig(batch_size=1,
                                                                                      dtype="float64"))
        assert mixed[i].token_ids == alone[0].token_ids


def test_float32_speculation_keeps_penalized_tokens(prompts):
    lm = load_model(TINY / "llama")
    sp = [SamplingParams(max_tokens=12, temperature=0.7, seed=i, **CASES["all"]) for i in range(len(prompts))]
    plain = generate(prompts, model=lm, sampling=sp, engine=EngineConfig(batch_size=4))
    chain = generate(prompts, model=lm, sampling=sp, engine=EngineConfig(batch_size=1),
                     speculative=SpecConfig(method="ngram", num_speculative_tokens=3, adaptive=False))
    assert [o.token_ids for o in chain] == [o.token_ids for o in plain]


@pytest.mark.parametrize("method", ["mtp", "eagle", "medusa"])
def test_learned_drafters_keep_penalized_tokens_and_logprobs(tiny_model64, prompts, method, tmp_path):
    """Random learned drafters (an MTP head's chain, EAGLE's dynamic trees, Medusa's static ones), every draft
    verified: penalized tokens and their log-probabilities equal plain decoding's, greedy and sampled."""
    from heads import learned_spec

    spec = learned_spec(method, tiny_model64, tmp_path)
    engine = EngineConfig(batch_size=3, dtype="float64")
    for temperature in (0.0, 0.8):
        sp = [SamplingParams(max_tokens=10, temperature=temperature, seed=i, logprobs=True, top_logprobs=2,
                             **CASES["all"]) for i in range(len(prompts))]
        plain = generate(prompts, model=tiny_model64, sampling=sp, engine=engine)
        spec_out = generate(prompts, model=tiny_model64, sampling=sp, engine=engine, speculative=spec)
        assert [o.token_ids for o in spec_out] == [o.token_ids for o in plain]
        assert [o.logprobs for o in spec_out] == [o.logprobs for o in plain]
        assert sum(o.stats.num_draft_tokens for o in spec_out) > 0


def test_stop_token_ids(tiny_models, prompts):
    """stop_token_ids end an output as EOS does (kept, finish_reason stop), min_tokens holds them back too;
    the same under speculation."""
    ref = tiny_models["reference64"]
    engine = EngineConfig(batch_size=4, dtype="float64")
    free = _run(ref, prompts, [SamplingParams(max_tokens=12, ignore_eos=True)] * len(prompts), engine)
    common = np.bincount(np.array(sum((o.token_ids[1:] for o in free), []))).argsort()[::-1]
    eos, stop = int(common[0]), int(common[1])
    kw = dict(stop_token_ids=(stop,), min_tokens=3)
    want = [_loop(ref, p, 12, kw, eos) for p in prompts]
    sp = [SamplingParams(max_tokens=12, **kw)] * len(prompts)
    for name in ("fused64", "reference64"):
        outs = _run(tiny_models[name], prompts, sp, EngineConfig(batch_size=4, dtype="float64",
                                                                 backend=name[:-2]), eos=eos)
        assert [o.token_ids for o in outs] == want, name
        assert [o.finish_reason for o in outs] == ["stop" if w[-1] in (eos, stop) else "length" for w in want]
    assert any(w[-1] == stop for w in want) and all(stop not in w[:3] for w in want)
    full = {tuple(p): list(p) + o.token_ids for p, o in zip(prompts, free)}
    tree = _run(tiny_models["fused64"], prompts, sp, engine, OracleTree(full, 2, p_right=0.9), eos=eos)
    assert [o.token_ids for o in tree] == want
    no_min = [SamplingParams(max_tokens=12, stop_token_ids=(stop,), ignore_eos=True)] * len(prompts)
    cut = _run(tiny_models["fused64"], prompts, no_min, engine)  # ignore_eos leaves stop ids working
    assert all(o.token_ids[-1] == stop or len(o.token_ids) == 12 for o in cut)
    assert any(o.finish_reason == "stop" for o in cut)


def test_api_checks_token_ids_and_min_tokens_holds_stop_strings(tiny_model64, prompts):
    """generate() refuses a logit bias or stop id outside the vocabulary (an error output, the others run);
    a stop string is not looked for before min_tokens (vLLM's rule)."""
    engine = EngineConfig(batch_size=4, dtype="float64")
    outs = generate(prompts[:3], model=tiny_model64, engine=engine,
                    sampling=[SamplingParams(max_tokens=4, logit_bias={"303": 5.0}),
                              SamplingParams(max_tokens=4, stop_token_ids=(300,)),
                              SamplingParams(max_tokens=4, repetition_penalty=1.2)])
    assert "token id 303 outside the vocabulary [0, 300)" in outs[0].error
    assert "token id 300 outside" in outs[1].error
    assert outs[2].error is None and len(outs[2].token_ids) == 4
    free = generate(prompts, model=tiny_model64, engine=engine,
                    sampling=SamplingParams(max_tokens=12, ignore_eos=True))
    i, o = next((i, o) for i, o in enumerate(free) if len(o.text) >= 2)
    stop = o.text[:2]  # in the output from its first tokens on
    early = generate([prompts[i]], model=tiny_model64, engine=engine,
                     sampling=SamplingParams(max_tokens=12, ignore_eos=True, stop=(stop,)))[0]
    held = generate([prompts[i]], model=tiny_model64, engine=engine,
                    sampling=SamplingParams(max_tokens=12, ignore_eos=True, stop=(stop,), min_tokens=6))[0]
    assert early.finish_reason == "stop" and len(early.token_ids) < 6
    assert len(held.token_ids) >= 6
