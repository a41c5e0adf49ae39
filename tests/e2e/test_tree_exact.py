"""Token trees change nothing: trees of mixed shapes (branches that share tokens, trees deeper than the
request's room, empty ones) verified in one forward give plain decoding's tokens, greedy and sampled, at batch
1 / 7 / 32, with chunked prefill and a shared prefix on and off, on both backends (float64)."""
import numpy as np
import pytest
from conftest import TINY

from specgen import EngineConfig, NgramConfig, SamplingParams, SpecConfig, generate, load_model
from specgen.engine.types import DraftTokens, Request
from specgen.io.schema import result_record


class OracleTree:
    """A test drafter that knows plain decoding's outputs: each step a random tree (up to max_nodes nodes,
    depth up to the engine's bound) whose nodes hold the right token with chance p_right, else a sibling's
    token (branches sharing tokens) or a random one. Node budgets of 0 come up too."""

    acceptance_hint = None

    def __init__(self, plain: dict[tuple, list[int]], seed: int, max_nodes: int = 12, p_right: float = 0.6):
        self.plain, self.rng, self.max_nodes, self.p_right = (plain, np.random.default_rng(seed), max_nodes,
                                                              p_right)

    def _full(self, row: np.ndarray) -> list[int]:
        for prompt, full in self.plain.items():
            if tuple(row[: len(prompt)]) == prompt:
                return full
        raise AssertionError("unknown prompt")

    def propose(self, view):
        n, w = len(view.slots), self.max_nodes
        ids, parents = np.zeros((n, w), np.int64), np.zeros((n, w), np.int64)
        num = np.zeros(n, np.int64)
        for s in range(n):
            seq_len = int(view.seq_lens[s])
            full = self._full(view.tokens[view.slots[s], :seq_len])
            count = int(self.rng.integers(0, w + 1))
            depth, right = [0], [True]  # block index 0: the root
            for i in range(count):
                p = int(self.rng.integers(0, len(depth)))
                d = depth[p] + 1
                if d > view.max_draft[s]:
                    continue
                j = len(depth) - 1  # this node's index among the nodes
                truth = full[seq_len - 1 + d] if seq_len - 1 + d < len(full) else 0
                r = self.rng.random()
                if right[p] and r < self.p_right:
                    tok = truth
                elif r < 0.8 and j > 0 and (parents[s, :j] == p).any():
                    tok = int(ids[s, :j][parents[s, :j] == p][0])  # a sibling's token again
                else:
                    tok = int(self.rng.integers(0, 250))
                ids[s, j], parents[s, j] = tok, p
                depth.append(d)
                right.append(right[p] and tok == truth)
            num[s] = len(depth) - 1
        return DraftTokens(ids, num, None, parents)

    def observe(self, update):
        return None


def _sampling(n, mode):
    return [SamplingParams(max_tokens=3 + (i * 5) % 14, temperature=0.9 if mode == "sampled" else 0.0,
                           top_p=0.95, seed=7 + i) for i in range(n)]


def speculated(model, prompts, sampling, plain, dtype="float64"):
    """(batch, oracle-tree outputs, n-gram chain outputs) at batch 1 and 4: the tree an oracle of `plain`'s
    outputs grows (p_right 0.8), the chain n-gram's (k 3, the controller off)."""
    full = {tuple(p): list(p) + o.token_ids for p, o in zip(prompts, plain)}
    for batch in (1, 4):
        engine = EngineConfig(batch_size=batch, dtype=dtype)
        tree = _run(model, prompts, sampling, engine, OracleTree(full, batch, p_right=0.8))
        chain = generate(prompts, model=model, sampling=sampling, engine=engine,
                         speculative=SpecConfig(method="ngram", num_speculative_tokens=3, adaptive=False))
        yield batch, tree, chain


def _run(model, prompts, sampling, engine, proposer=None, adaptive=False, ids=None, eos=None):
    from specgen.engine.engine import Engine

    eng = Engine(model.model, model.tokenizer, engine, proposer, adaptive=adaptive)
    if eos is not None:  # a token the model emits often stands for EOS
        eng.eos_ids = np.array([eos], np.int64)
    ids = ids or range(len(prompts))
    reqs = [Request(str(ids[i]), i, tuple(p), sampling[i]) for i, p in enumerate(prompts)]
    return sorted(eng.run(reqs), key=lambda o: o.index)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(1)
    prefix = rng.integers(3, 250, 40).tolist()
    # a unique first token per prompt (the oracle finds its request by it), a shared stretch, repeats for
    # n-grams
    return [[3 + i] + prefix + rng.integers(3, 250, int(n)).tolist() * 2
            for i, n in enumerate(rng.integers(3, 30, 32))]


@pytest.mark.parametrize("backend", ["fused", "reference"])
@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_trees_equal_plain(backend, mode, prompts):
    model = load_model(TINY / "llama", dtype="float64", backend=backend)
    sp = _sampling(len(prompts), mode)
    plain = _run(model, prompts, sp, EngineConfig(batch_size=32, dtype="float64", shared_prefix="off"))
    full = {tuple(p): list(p) + o.token_ids for p, o in zip(prompts, plain)}
    for batch, shared, chunk in [(1, "off", 0), (7, "auto", 16), (32, "off", 16), (32, "auto", 0)]:
        picked = range(0, len(prompts), 4) if batch == 1 else range(len(prompts))
        engine = EngineConfig(batch_size=batch, dtype="float64", shared_prefix=shared, prefill_chunk=chunk,
                              max_prefill_tokens=64)
        out = _run(model, [prompts[i] for i in picked], [sp[i] for i in picked], engine,
                   OracleTree(full, batch), ids=list(picked))
        assert [o.token_ids for o in out] == [plain[i].token_ids for i in picked], (batch, shared, chunk)
        assert [o.finish_reason for o in out] == [plain[i].finish_reason for i in picked]
        assert sum(o.stats.num_accepted_tokens for o in out) > 0
        for o in out:  # statistics: nodes verified, acceptance per depth
            s = o.stats
            assert s.num_emitted_tokens == s.num_accepted_tokens + s.num_steps == len(o.token_ids)
            assert sum(s.accepted_per_position) == s.num_accepted_tokens
            assert all(a <= d for a, d in zip(s.accepted_per_position, s.drafted_per_position))
            assert sum(s.drafted_per_position) <= s.num_draft_tokens  # nodes, every branch's
        record = result_record(out[0], SpecConfig(method="ngram", num_speculative_tokens=5))
        assert record["drafted_per_position"] == out[0].stats.drafted_per_position


@pytest.mark.parametrize("adaptive", [False, True])
def test_ngram_trees_equal_plain(tiny_model64, prompts, adaptive):
    """--ngram-branches 3 (and a static shape) through generate(): plain decoding's tokens, with the
    controller choosing node budgets (0 included) or every node verified."""
    sp = [SamplingParams(max_tokens=12, temperature=0.7 if i % 2 else 0.0, seed=i)
          for i in range(len(prompts))]
    engine = EngineConfig(batch_size=7, dtype="float64")
    plain = generate(prompts, model=tiny_model64, sampling=sp, engine=engine)
    for ngram in (NgramConfig(branches=3),
                  NgramConfig(branches=2, tree_choices=("0,0,0", "1", "1,0", "0,1"))):
        spec = SpecConfig(method="ngram", num_speculative_tokens=3, adaptive=adaptive, ngram=ngram)
        out = generate(prompts, model=tiny_model64, sampling=sp, engine=engine, speculative=spec)
        assert [o.token_ids for o in out] == [o.token_ids for o in plain]
        if not adaptive:  # (the tiny random model seldom repeats itself: acceptance is the oracle test's)
            assert sum(o.stats.num_draft_tokens for o in out) > 0


def test_tree_reaching_eos_and_max_tokens(tiny_model64, prompts):
    """Trees that run on past an EOS inside them (the oracle knows the text as if EOS were not one) and trees
    as deep as the tokens left: cut where plain decoding stops."""
    sp = [SamplingParams(max_tokens=8 + i % 9) for i in range(len(prompts))]
    engine = EngineConfig(batch_size=32, dtype="float64")
    free = _run(tiny_model64, prompts, sp, engine)
    eos = int(np.bincount(np.concatenate([o.token_ids[1:] for o in free])).argmax())  # inside many outputs
    plain = _run(tiny_model64, prompts, sp, engine, eos=eos)
    assert sum(o.finish_reason == "stop" for o in plain) >= 2
    full = {tuple(p): list(p) + o.token_ids for p, o in zip(prompts, free)}
    out = _run(tiny_model64, prompts, sp, engine, OracleTree(full, 5, p_right=0.9), eos=eos)
    assert [o.token_ids for o in out] == [o.token_ids for o in plain]
    assert [o.finish_reason for o in out] == [o.finish_reason for o in plain]


def test_budget_zero_keeps_the_tree_for_shadow_acceptance(tiny_model64, prompts):
    """A node budget of 0 verifies nothing, yet the controller still sees every offered node's main chain
    (else a slot whose budget fell to 0 would never be measured again)."""
    from specgen.engine.engine import Engine

    sp = [SamplingParams(max_tokens=6)] * 3
    plain = _run(tiny_model64, prompts[:3], sp, EngineConfig(batch_size=3, dtype="float64"))
    full = {tuple(p): list(p) + o.token_ids for p, o in zip(prompts, plain)}
    eng = Engine(tiny_model64.model, None, EngineConfig(batch_size=3, dtype="float64"),
                 OracleTree(full, 0, 12, 1.0), adaptive=True)
    reports = []

    class Zero:  # the controller's interface, choosing 0 nodes everywhere
        acceptance = type("A", (), {"rate": staticmethod(lambda source, slots: np.full(len(slots), 0.5))})()
        off = False  # speculation not ruled out

        def choose(self, slots, num_avail, other, source=None, gains=None):
            return np.zeros(len(slots), np.int64)

        def end_step(self, report):
            reports.append(report)

        def detached(self, slots):
            return np.zeros(len(slots), bool)

        def probing(self, all_detached, copies=False):
            return True

        def reset(self, slot):
            return None

    eng.controller = Zero()
    out = sorted(eng.run([Request(str(i), i, tuple(prompts[i]), sp[i]) for i in range(3)]),
                 key=lambda o: o.index)
    assert [o.token_ids for o in out] == [o.token_ids for o in plain]
    assert all(o.stats.num_draft_tokens == 0 for o in out)
    assert sum(int(r.num_avail.sum()) for r in reports) > 0  # main chains offered and scored
    assert any((r.draft_ids[:, :1] == r.emitted[:, :1]).any() for r in reports if r.draft_ids.shape[1])


def test_a_drafter_ruled_out_is_not_asked_for_drafts(tiny_model64, prompts):
    """Speculation ruled out before the first step (a held-out acceptance of 0 cannot pay): the engine steps
    as plain decoding and never asks the drafter, even one whose detached slots would still copy."""
    from specgen.engine.engine import Engine

    class Counting(OracleTree):
        acceptance_hint = 0.0
        idle_when_detached = False  # as MTP and EAGLE with copies
        calls = 0

        def propose(self, view):
            Counting.calls += 1
            return super().propose(view)

    sp = [SamplingParams(max_tokens=6) for _ in prompts]
    engine = EngineConfig(batch_size=8, dtype="float64")
    plain = _run(tiny_model64, prompts, sp, engine)
    full = {tuple(p): list(p) + o.token_ids for p, o in zip(prompts, plain)}
    eng = Engine(tiny_model64.model, tiny_model64.tokenizer, engine, Counting(full, 0), adaptive=True)
    out = sorted(eng.run([Request(str(i), i, tuple(p), sp[i]) for i, p in enumerate(prompts)]),
                 key=lambda o: o.index)
    assert eng.controller.off and Counting.calls == 0
    assert [o.token_ids for o in out] == [o.token_ids for o in plain]
