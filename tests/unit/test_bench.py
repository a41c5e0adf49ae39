"""`specgen bench`'s figures on the tiny Llama, each checked against a hand computation: a scripted drafter
whose drafts are always, never or half accepted (it knows plain decoding's outputs), at injected step
costs."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from specgen import generate
from specgen.app import bounds
from specgen.app.advice import advise
from specgen.app.bench import BenchInput, Choice, parse_batch_sizes, parse_methods, run_bench
from specgen.app.settings import load_yaml, resolve
from specgen.config import Method, SamplingParams
from specgen.engine.proposers import ngram
from specgen.engine.types import DraftTokens
from specgen.errors import ConfigError

PROMPTS = [[5, 6, 7, 8, 9], [20, 21, 22, 23, 24, 25, 26]]
K = 2


class ScriptedProposer:
    """Drafts plain decoding's next tokens: the first `right` of each draft are those tokens, the rest are
    wrong (the true token + 1). `texts`: each request's prompt + plain output."""

    acceptance_hint = None

    def __init__(self, texts: list[np.ndarray], right: int, vocab: int):
        self.texts, self.right, self.vocab = texts, right, vocab

    def propose(self, view) -> DraftTokens:
        n = len(view.slots)
        draft, num = np.zeros((n, K), np.int64), np.zeros(n, np.int64)
        for i in range(n):
            seq = view.tokens[view.slots[i], : view.seq_lens[i]]
            text = next(t for t in self.texts if len(t) >= len(seq) and np.array_equal(t[: len(seq)], seq))
            m = min(K, int(view.max_draft[i]), len(text) - len(seq))
            truth = text[len(seq): len(seq) + m]
            draft[i, :m] = np.where(np.arange(m) < self.right, truth, (truth + 1) % self.vocab)
            num[i] = m
        return DraftTokens(draft, num)

    def observe(self, update) -> None:
        return None


def costs(model, position, tokens, slots, repeats):
    """Injected step costs: c(T) = 1 + (T - 1) / 2 seconds."""
    return {t: 1.0 + 0.5 * (t - 1) for t in tokens}


def bench(tiny_model, tmp_path: Path, monkeypatch, max_tokens: int, right: int, sizes=(1,), repeats: int = 1):
    """none and the scripted drafter (as method ngram, drafts verified as offered) on PROMPTS."""
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    plain = generate(PROMPTS, model=tiny_model, sampling=sampling)
    texts = [np.array(p + o.token_ids) for p, o in zip(PROMPTS, plain)]
    vocab = tiny_model.config.vocab_size
    monkeypatch.setattr(ngram, "build_ngram_proposer", lambda d: ScriptedProposer(texts, right, vocab))
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"id": f"r{i}", "input_ids": p}) + "\n"
                            for i, p in enumerate(PROMPTS)))
    cfg = resolve(None, {"max_tokens": max_tokens, "ignore_eos": True, "adaptive": False, "method": "ngram",
                         "num_speculative_tokens": K}, None, {Method.NONE, Method.NGRAM})
    choices = [Choice(Method.NONE), Choice(Method.NGRAM)]
    rows = run_bench(BenchInput(path, "jsonl"), tiny_model, cfg, choices, list(sizes), warmup=False,
                     measure=costs, repeats=repeats)
    return cfg, rows


def check_rates(rows) -> None:
    """tok/s = output tokens / wall; speedup = tok/s over the first row's; both rows token-identical."""
    none, ngram = rows
    for r in rows:
        assert r.tok_s == pytest.approx(r.summary.num_output_tokens / r.summary.wall_time_s)
        assert r.identical
    assert none.speedup == pytest.approx(1.0) and ngram.speedup == pytest.approx(ngram.tok_s / none.tok_s)
    assert ngram.speedup_over_plain == pytest.approx(ngram.speedup)
    p = ngram.possible.prefill_share
    assert p == pytest.approx(min(none.prefill_wall_s / none.summary.wall_time_s, 0.99))
    assert 0 < p < 1
    assert none.possible is None and none.k is None and ngram.k == K


def check_bounds(row, steps_per_request: list[int], cost_sum: float) -> None:
    """ceiling = tokens / steps of the replay; decode bound = tokens x c(1) / sum of c(tokens of each step);
    oracle = 1 / (p + (1 - p) / decode bound); of oracle = speedup / oracle."""
    steps = steps_per_request * len(PROMPTS)
    p = row.possible
    assert p.ceiling == pytest.approx(sum(steps) / len(steps))
    assert p.decode_bound == pytest.approx(sum(steps) * 1.0 / (cost_sum * len(PROMPTS)))
    assert p.oracle == pytest.approx(1 / (p.prefill_share + (1 - p.prefill_share) / p.decode_bound))
    assert row.of_oracle == pytest.approx(row.speedup / p.oracle)


def test_drafts_always_accepted(tiny_model, tmp_path, monkeypatch):
    # 10 tokens: the prefill's first, then three steps of 2 accepted drafts + 1 (bonus) each
    _, rows = bench(tiny_model, tmp_path, monkeypatch, 10, right=K)
    check_rates(rows)
    none, ngram = rows
    s = ngram.summary
    assert (s.num_output_tokens, s.num_steps, s.num_draft_tokens, s.num_accepted_tokens) == (20, 8, 12, 12)
    assert s.acceptance_rate == 1.0 and s.mean_accepted_length == 2.5
    assert s.per_position_acceptance == [1.0, 1.0]  # both positions accepted in each of the 6 decode steps
    assert none.summary.mean_accepted_length == 1.0 and none.summary.acceptance_rate is None
    check_bounds(ngram, [1, 3, 3, 3], 1.0 + 3 * 2.0)  # c(1) + 3 c(3)
    # every draft accepted: the run reaches the ceiling
    assert ngram.possible.ceiling == s.mean_accepted_length


def test_drafts_never_accepted(tiny_model, tmp_path, monkeypatch):
    _, rows = bench(tiny_model, tmp_path, monkeypatch, 10, right=0)
    check_rates(rows)
    s = rows[1].summary
    # 1 token per step; each of the 9 decode steps verifies min(2, tokens left - 1) wrong drafts (the engine
    # leaves room for the step's own token): 7 x 2 + 1 + 0 per request
    assert (s.num_output_tokens, s.num_steps, s.num_draft_tokens, s.num_accepted_tokens) == (20, 20, 30, 0)
    assert s.acceptance_rate == 0.0 and s.mean_accepted_length == 1.0
    assert s.per_position_acceptance == [0.0, 0.0]
    check_bounds(rows[1], [1] * 10, 10 * 1.0)
    assert rows[1].possible.oracle == pytest.approx(1.0)  # nothing to gain: the bound is plain decoding


def test_drafts_half_accepted(tiny_model, tmp_path, monkeypatch):
    # 11 tokens: the first, then five steps of 1 accepted draft + 1; timed twice each, the fastest kept
    _, rows = bench(tiny_model, tmp_path, monkeypatch, 11, right=1, repeats=2)
    check_rates(rows)
    s = rows[1].summary
    # drafts per request: 2 in each of the first four decode steps, 1 in the last (2 tokens left: room for 1)
    assert (s.num_output_tokens, s.num_steps, s.num_draft_tokens, s.num_accepted_tokens) == (22, 12, 18, 10)
    assert s.acceptance_rate == pytest.approx(10 / 18) and s.mean_accepted_length == pytest.approx(11 / 6)
    assert s.per_position_acceptance == [1.0, 0.0]
    check_bounds(rows[1], [1, 2, 2, 2, 2, 2], 1.0 + 5 * 1.5)


def test_batch_sizes_each_and_advice(tiny_model, tmp_path, monkeypatch):
    """Two batch sizes: a row per (method, size), the bound at as many slots as there are requests; the advice
    names the fastest row, and its YAML loads with specgen's loader and resolves to that choice."""
    cfg, rows = bench(tiny_model, tmp_path, monkeypatch, 10, right=K, sizes=(1, 4))
    assert [(r.method, r.batch_size) for r in rows] == [("none", 1), ("ngram", 1), ("none", 4), ("ngram", 4)]
    at4 = rows[3].possible
    assert at4.slots == 2 and sorted(at4.costs) == [1, 2, 3]  # 2 requests; 2.5 tokens per step: c(1..3)
    assert at4.decode_bound == pytest.approx(2.5 * 1.0 / 1.75)  # c(2.5) interpolated
    advice = advise(rows, cfg)
    best = max(rows, key=lambda r: r.tok_s)
    assert (advice.method, advice.batch_size) == (best.method, best.batch_size)
    assert advice.k == (None if best.method == "none" else K)
    assert f"batch {best.batch_size}" in advice.headline and "batch sizes tried: 1, 4" in advice.headline
    path = tmp_path / "advised.yaml"
    path.write_text(advice.yaml)
    run = resolve(load_yaml(path), {})
    assert run.spec.method.value == best.method and run.engine.batch_size == best.batch_size
    assert run.sampling.max_tokens == 10 and run.sampling.ignore_eos
    assert run.spec.adaptive is (best.method == "none")  # --no-adaptive is carried where it applies
    assert yaml.safe_load(advice.yaml)["speculative"]["method"] == best.method


def test_advice_why(tiny_model, tmp_path, monkeypatch):
    """The why line: a drafter that wins says what it gains of what was possible; where none wins, that no
    drafter pays (figures forced by editing the rows' rates)."""
    import dataclasses

    cfg, rows = bench(tiny_model, tmp_path, monkeypatch, 10, right=K)
    none, ngram = rows

    def at(row, tok_s, over):
        s = dataclasses.replace(row.summary, output_tokens_per_s=tok_s)
        return dataclasses.replace(row, summary=s, speedup=over, speedup_over_plain=over)

    won = advise([at(none, 100.0, 1.0), at(ngram, 120.0, 1.2)], cfg)
    oracle = ngram.possible.oracle
    assert won.why.startswith(f"ngram gains 1.20x over none at batch 1 of a possible {oracle:.2f}x")
    assert "2.50 tokens per step if verifying were free" in won.why
    lost = advise([at(none, 100.0, 1.0), at(ngram, 90.0, 0.9)], cfg)
    assert lost.method == "none" and lost.why.startswith("no drafter pays at batch 1: run none (ngram 0.90x")
    assert lost.yaml.endswith("speculative:\n  method: none\n")
    # a drafter that verified no drafts ran as plain decoding: faster by noise alone, it is no choice
    idle = at(ngram, 130.0, 1.3)
    idle = dataclasses.replace(idle, summary=dataclasses.replace(idle.summary, num_draft_tokens=0))
    noise = advise([at(none, 100.0, 1.0), idle], cfg)
    assert noise.method == "none" and noise.why == ("no drafter pays at batch 1: run none "
                                                    "(ngram verified no drafts)")
    # plain decoding at 4 slots is fastest, but a job held to one slot gains from ngram: said too
    big = [dataclasses.replace(at(none, 300.0, 1.0), batch_size=4),
           dataclasses.replace(at(ngram, 291.0, 0.97), batch_size=4)]
    mixed = advise([at(none, 100.0, 1.0), at(ngram, 120.0, 1.2)] + big, cfg)
    assert (mixed.method, mixed.batch_size) == ("none", 4)
    assert mixed.why.startswith("no drafter pays at batch 4: run none (ngram 0.97x of a possible")
    assert f"; at batch 1 ngram gains 1.20x of a possible {oracle:.2f}x" in mixed.why


def test_parse_methods_with_k():
    assert parse_methods("none, ngram:2,ngram:5,mtp") == [Choice(Method.NONE), Choice(Method.NGRAM, 2),
                                                         Choice(Method.NGRAM, 5), Choice(Method.MTP)]
    assert [c.label for c in parse_methods("none,ngram:2")] == ["none", "ngram:2"]
    for bad, fragment in (("none,none", "twice"), ("ngram:2,ngram:2", "twice"), ("none:2", "takes no k"),
                          ("ngram:x", "k must be an integer"),
                          ("ngram:9", "num_speculative_tokens must be in 1..5"),
                          ("", "at least one"), ("lookahead", "unknown method")):
        with pytest.raises(ConfigError, match=fragment):
            parse_methods(bad)


def test_repeats_must_be_positive(tiny_model, tmp_path):
    with pytest.raises(ConfigError, match="--repeats must be >= 1"):
        run_bench(BenchInput(tmp_path / "in.jsonl", "jsonl"), tiny_model, resolve(None, {}),
                  [Choice(Method.NONE)], repeats=0)


def test_parse_batch_sizes():
    assert parse_batch_sizes("1,32,256") == [1, 32, 256]
    for bad in ("", "1,1", "0,4", "257", "a,b"):
        with pytest.raises(ConfigError):
            parse_batch_sizes(bad)


def test_possible_measures_only_the_counts_a_step_emits():
    """At one slot the bound needs c(T) only for the T some replayed step emits (and c(1))."""
    asked = []

    def measure(model, position, tokens, slots, repeats):
        asked.append((position, tokens, slots))
        return costs(model, position, tokens, slots, repeats)

    class Always:
        acceptance_hint = None

        def propose(self, view):
            seq = view.tokens[0, : view.seq_lens[0]]
            return DraftTokens(np.full((1, 3), seq[-1]), np.array([3]))

        def observe(self, update):
            return None

    got = bounds.possible(None, Always(), [[4, 4], [4, 4, 4, 4]], [[4] * 8, [4] * 5], 3, 1, 0.25, measure)
    # request 1: 1, then 4, 3 (7 left); request 2: 1, then 4 -> steps [1, 4, 3, 1, 4], 13 tokens
    assert asked == [(3, [1, 3, 4], 1)]
    assert got.ceiling == pytest.approx(13 / 5)
    assert got.decode_bound == pytest.approx(13 / (1 + 2.5 + 2.0 + 1 + 2.5))
    assert got.oracle == pytest.approx(1 / (0.25 + 0.75 / got.decode_bound))
