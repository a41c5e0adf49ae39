"""Structured output (response_format, guided_*): greedy constrained outputs equal a step-by-step loop that
masks the teacher-forced model's logits with llguidance's own matcher, and speculation (n-gram chains with
forced drafts ahead, n-gram token trees, oracle token trees, learned drafters; greedy and sampled; batch 1 and
4) changes no token."""
import json

import llguidance
import numpy as np
import pytest
from conftest import TINY
from test_tree_exact import OracleTree, _run

from specgen import EngineConfig, SamplingParams, SpecConfig, generate, load_model
from specgen.config import NgramConfig, response_format
from specgen.engine.grammar import ForcedDrafts, ahead, grammar_of
from specgen.engine.types import DraftTokens
from specgen.runtime.batch import build_forward_batch

SCHEMA = {"type": "object", "properties": {"kind": {"enum": ["alpha", "beta"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}},
          "required": ["kind", "n", "ok"], "additionalProperties": False}
CASES = {
    "json_schema": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}},
    "choice": {"type": "choice", "choice": ["alpha", "beta gamma", "delta"]},
    "regex": {"type": "regex", "regex": "[a-d]{2,6}-[0-9]{1,3}"},
    "grammar": {"type": "grammar", "grammar": 'start: "(" item (", " item)* ")"\nitem: /[a-c]+/'},
}


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(5)
    return [[3 + i] + rng.integers(3, 250, int(n)).tolist() * 2 for i, n in enumerate(rng.integers(3, 16, 7))]


def _loop(lm, prompt: list[int], n: int, spec: str) -> list[int]:
    """Plain constrained greedy decoding by hand: a whole forward over prompt + output each step, the row
    masked by llguidance's matcher (its own logit-bias mask), argmax, EOS ends it (kept)."""
    vocab = lm.model.config.vocab_size
    tok = llguidance.LLTokenizer(lm.tokenizer.tokenizer.to_str(), n_vocab=vocab,
                                 eos_token=list(lm.model.config.eos_token_ids))
    m = llguidance.LLMatcher(tok, grammar_of(spec))
    out: list[int] = []
    for _ in range(n):
        ids = prompt + out
        batch = build_forward_batch(np.zeros(1, np.int64), np.zeros(1, np.int64), np.array([len(ids)]),
                                    np.array(ids, np.int64), np.ones(1, bool))
        row = lm.model.forward(batch, lm.model.new_cache(1, 256)).logits.numpy()[-1]
        allowed = np.frombuffer(m.compute_logit_bias(), np.uint8)[:vocab] > 0
        out.append(int(np.argmax(np.where(allowed, row, -np.inf))))
        assert m.consume_token(out[-1])
        if out[-1] in lm.model.config.eos_token_ids:
            break
    return out


def _matches(lm, spec: str, token_ids: list[int]) -> bool:
    tok = llguidance.LLTokenizer(lm.tokenizer.tokenizer.to_str(), n_vocab=lm.model.config.vocab_size,
                                 eos_token=list(lm.model.config.eos_token_ids))
    m = llguidance.LLMatcher(tok, grammar_of(spec))
    return all(m.consume_token(t) for t in token_ids)


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_equals_the_loop(tiny_models, prompts, case):
    """float64, fused and reference backends, batch 4, plain decoding with and without forced drafts."""
    spec = response_format(CASES[case])
    ref = tiny_models["reference64"]
    want = [_loop(ref, p, 40, spec) for p in prompts]
    free = generate(prompts, model=ref, sampling=SamplingParams(max_tokens=40),
                    engine=EngineConfig(batch_size=4, dtype="float64", backend="reference"))
    assert [o.token_ids for o in free] != want  # the grammar changed something
    assert sum(w[-1] in ref.model.config.eos_token_ids for w in want) >= 1  # and some outputs end by it
    sp = SamplingParams(max_tokens=40, response_format=CASES[case])
    for name in ("fused64", "reference64"):
        for forced in (False, True):
            outs = generate(prompts, model=tiny_models[name], sampling=sp,
                            engine=EngineConfig(batch_size=4, dtype="float64", backend=name[:-2],
                                                forced_drafts=forced))
            assert [o.token_ids for o in outs] == want, (name, forced)
            assert all(o.finish_reason == ("stop" if o.token_ids[-1] == 299 else "length") for o in outs)
            num_forced = sum(o.stats.num_forced_tokens for o in outs)
            assert num_forced > 0 if forced and case in ("json_schema", "choice") else num_forced >= 0
            assert forced or num_forced == 0


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
@pytest.mark.parametrize("case", ["json_schema", "grammar"])
def test_speculation_keeps_constrained_tokens(tiny_model64, prompts, mode, case):
    """n-gram chains (forced drafts ahead of them, and without), n-gram trees (forced nodes as their trunk)
    and oracle trees (most nodes right, some the grammar rejects: the tree is cut there) give plain
    constrained decoding's tokens, at batch 1 and 4."""
    sp = [SamplingParams(max_tokens=40, temperature=0.8 if mode == "sampled" else 0.0, seed=i,
                         response_format=CASES[case]) for i in range(len(prompts))]
    plain = _run(tiny_model64, prompts, sp, EngineConfig(batch_size=4, dtype="float64", forced_drafts=False))
    spec = response_format(CASES[case])
    assert all(_matches(tiny_model64, spec, o.token_ids) for o in plain)
    full = {tuple(p): list(p) + o.token_ids for p, o in zip(prompts, plain)}
    for batch in (1, 4):
        engine = EngineConfig(batch_size=batch, dtype="float64")
        tree = _run(tiny_model64, prompts, sp, engine, OracleTree(full, batch, p_right=0.7))
        assert [o.token_ids for o in tree] == [o.token_ids for o in plain]
        assert sum(o.stats.num_accepted_tokens for o in tree) > len(prompts)
        for ngram in (NgramConfig(), NgramConfig(branches=3)):
            for forced in (True, False):
                out = generate(prompts, model=tiny_model64, sampling=sp,
                               engine=EngineConfig(batch_size=batch, dtype="float64", forced_drafts=forced),
                               speculative=SpecConfig(method="ngram", num_speculative_tokens=3,
                                                      adaptive=False, ngram=ngram))
                assert [o.token_ids for o in out] == [o.token_ids for o in plain], (ngram.branches, forced)
                num_forced = sum(o.stats.num_forced_tokens for o in out)
                assert num_forced > 0 if forced and case == "json_schema" else forced or num_forced == 0


def test_constrained_and_free_requests_share_a_batch(tiny_model64, prompts):
    """Constrained requests beside free ones (and of different grammars): each gets its tokens alone."""
    sp = [SamplingParams(max_tokens=16, response_format=list(CASES.values())[i % 4] if i % 3 else "")
          for i in range(len(prompts))]
    mixed = generate(prompts, model=tiny_model64, sampling=sp, engine=EngineConfig(batch_size=4,
                                                                                   dtype="float64"))
    for i, p in enumerate(prompts):
        alone = generate([p], model=tiny_model64, sampling=sp[i],
                         engine=EngineConfig(batch_size=1, dtype="float64", forced_drafts=False))
        assert mixed[i].token_ids == alone[0].token_ids


def test_float32_sampled_speculation_and_penalties(prompts):
    """float32, sampled, with penalties and min_tokens beside the grammar: n-gram speculation changes no
    token; min_tokens never leaves a row with nothing allowed (the grammar wins)."""
    lm = load_model(TINY / "llama")
    sp = [SamplingParams(max_tokens=20, temperature=0.7, seed=i, repetition_penalty=1.2, min_tokens=30,
                         response_format=CASES["choice"]) for i in range(len(prompts))]
    plain = generate(prompts, model=lm, sampling=sp, engine=EngineConfig(batch_size=4, forced_drafts=False))
    chain = generate(prompts, model=lm, sampling=sp, engine=EngineConfig(batch_size=1),
                     speculative=SpecConfig(method="ngram", num_speculative_tokens=3, adaptive=False))
    assert [o.token_ids for o in chain] == [o.token_ids for o in plain]
    spec = response_format(CASES["choice"])
    texts = {lm.tokenizer.decode(o.token_ids) for o in plain}
    assert texts <= {"alpha", "beta gamma", "delta"} and all(_matches(lm, spec, o.token_ids) for o in plain)


def test_forced_drafts_go_ahead_of_the_drafters():
    """ahead(): a chain continues the forced tokens; a tree hangs from the last one, its nodes shifted."""
    forced = ForcedDrafts(np.array([[7, 8], [0, 0]]), np.array([2, 0]))
    chain = ahead(forced, DraftTokens(np.array([[1, 2, 3], [4, 5, 6]]), np.array([2, 3])))
    assert chain.num_draft.tolist() == [4, 3]
    assert chain.draft_ids[0, :4].tolist() == [7, 8, 1, 2] and chain.draft_ids[1, :3].tolist() == [4, 5, 6]
    tree = ahead(forced, DraftTokens(np.array([[1, 2, 3], [4, 5, 6]]), np.array([3, 2]),
                                     parents=np.array([[0, 0, 1], [0, 1, 0]]),
                                     scores=np.array([[0.9, 0.5, 0.4], [0.8, 0.6, 0.0]])))
    assert tree.parents[0, :5].tolist() == [0, 1, 2, 2, 3]  # forced trunk, then the tree below node 2
    assert tree.parents[1, :2].tolist() == [0, 1]
    assert tree.scores[0, :5].tolist() == [1.0, 1.0, 0.9, 0.5, 0.4]


def test_bad_constraints_are_error_records(tiny_model):
    """An invalid schema, regex or grammar is the request's error; ignore_eos with a grammar is refused."""
    from specgen.errors import ConfigError

    bad = [{"type": "regex", "regex": "a(b"},
           {"type": "json_schema", "json_schema": {"schema": {"type": "x"}}},
           {"type": "grammar", "grammar": "start: nothing_defined"},
           {"type": "grammar", "grammar": 'start: "a" <[5000]>'}]  # a token id past this vocabulary
    outs = generate([[5, 6, 7]] * 4, model=tiny_model,
                    sampling=[SamplingParams(max_tokens=4, response_format=b) for b in bad])
    assert all(o.error and o.error.startswith("response_format: ") for o in outs)
    assert "unclosed group" in outs[0].error
    with pytest.raises(ConfigError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, response_format={"type": "json_object"})
    with pytest.raises(ConfigError, match="schema object"):
        SamplingParams(response_format={"type": "json_schema", "json_schema": {"schema": True}})
    with pytest.raises(ConfigError, match="choice"):
        SamplingParams(response_format={"type": "choice", "choice": []})
    assert SamplingParams(response_format={"type": "text"}).response_format == ""
    bare = SamplingParams(response_format=json.dumps(SCHEMA)).response_format
    assert bare == SamplingParams(response_format=CASES["json_schema"]).response_format


@pytest.mark.parametrize("method", ["mtp", "eagle", "medusa"])
def test_learned_drafters_keep_constrained_tokens(tiny_model64, prompts, method, tmp_path):
    """Random learned drafters (an MTP head's chain, EAGLE's dynamic trees, Medusa's static ones; no forced
    drafts: they draft from their own state), every draft verified, greedy and sampled: cut at the first
    token the grammar rejects, they give plain constrained decoding's tokens and log-probabilities."""
    from heads import learned_spec

    spec = learned_spec(method, tiny_model64, tmp_path)
    engine = EngineConfig(batch_size=3, dtype="float64")
    for temperature in (0.0, 0.8):
        # tokens holding an a or an e refused: random drafters' drafts pass and fail it
        fmt = {"type": "regex", "regex": "[^ae]*"}
        sp = [SamplingParams(max_tokens=20, temperature=temperature, seed=i, logprobs=True,
                             response_format=fmt) for i in range(len(prompts))]
        plain = generate(prompts, model=tiny_model64, sampling=sp, engine=engine)
        spec_out = generate(prompts, model=tiny_model64, sampling=sp, engine=engine, speculative=spec)
        assert [o.token_ids for o in spec_out] == [o.token_ids for o in plain]
        assert [o.logprobs for o in spec_out] == [o.logprobs for o in plain]
        assert sum(o.stats.num_draft_tokens for o in spec_out) > 0
        assert all(not {"a", "e"} & set(tiny_model64.tokenizer.decode(o.token_ids)) for o in plain)
