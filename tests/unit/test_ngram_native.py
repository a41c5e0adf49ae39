"""ngram.cc against its numpy references: a slot's own-text match (ngram_match) and the job pool's lookup
(NgramPool.lookup_reference), on random text with a small vocabulary (many matches, overlaps and ties)."""
import numpy as np
import pytest

from specgen.engine.proposers.ngram import ngram_match, ngram_match_native
from specgen.engine.proposers.ngram_pool import NgramPool
from specgen.kernels import host_lib

LIB = host_lib()
pytestmark = pytest.mark.skipif(LIB is None, reason="no C++ compiler: the numpy reference is used")


@pytest.mark.parametrize("n_min,n_max,k", [(1, 3, 5), (2, 4, 3), (1, 1, 1), (3, 3, 2)])
def test_own_match_equals_reference(n_min, n_max, k):
    rng = np.random.default_rng(n_min * 100 + n_max * 10 + k)
    matched = 0
    for trial in range(40):
        num_slots, capacity = 12, 80
        # rows beyond each slot's length hold leftovers that must not be read
        table = rng.integers(0, 3 + trial % 5, (num_slots, capacity)).astype(np.int64)
        slots = rng.permutation(num_slots)[: rng.integers(1, num_slots + 1)].astype(np.int64)
        seq_lens = rng.integers(0, capacity + 1, len(slots)).astype(np.int64)
        width = max(int(seq_lens.max()), 1)
        ref, ref_len = ngram_match(table[slots, :width], seq_lens, k, n_min, n_max)
        got, got_len = ngram_match_native(LIB, table, slots, seq_lens, k, n_min, n_max)
        np.testing.assert_array_equal(got.num_draft, ref.num_draft)
        np.testing.assert_array_equal(got.draft_ids, ref.draft_ids)
        np.testing.assert_array_equal(got_len, ref_len)
        matched += int((ref.num_draft > 0).sum())
    assert matched > 40  # the cases exercise matches, not only misses


@pytest.mark.parametrize("capacity,n_min,n_max", [(10_000, 1, 3), (50, 1, 3), (300, 2, 4)])
def test_pool_lookup_equals_reference(capacity, n_min, n_max):
    rng = np.random.default_rng(capacity + n_max)
    pool = NgramPool(capacity, n_min, n_max, table_bits=6)  # a small table: collisions and overwrites
    hits = 0
    for step in range(30):
        seqs = [rng.integers(0, 6, rng.integers(1, 30)) for _ in range(rng.integers(1, 4))]
        width = max(map(len, seqs))
        tokens = np.zeros((len(seqs), width), np.int64)
        for i, s in enumerate(seqs):
            tokens[i, : len(s)] = s
        pool.add_batch(tokens, np.array([len(s) for s in seqs]))
        tails = rng.integers(0, 6, (16, n_max)).astype(np.int64)
        tail_lens = rng.integers(0, n_max + 2, 16).astype(np.int64)
        for k in (1, 5):
            ref = pool.lookup_reference(tails, tail_lens, k)
            got = pool.lookup(tails, tail_lens, k, LIB)
            for g, r in zip(got, ref):
                np.testing.assert_array_equal(g, r)
            hits += int(ref[1].astype(bool).sum())
    assert hits > 0


def test_proposer_with_a_pool_equals_its_numpy_reference_over_a_job():
    """NgramProposer.propose through specgen_ngram_propose (own match, pool lookup and the learnt choice
    between them in one call) against propose_reference, step by step over a simulated job: 6 slots whose
    texts repeat phrases of each other, requests finishing into the pool, slots taking new requests. Drafts,
    draft counts and the candidates scored after each step are identical."""
    from specgen.engine.proposers.base import SlotView
    from specgen.engine.proposers.ngram import NgramProposer
    from specgen.engine.types import StepUpdate

    rng = np.random.default_rng(5)
    phrases = [rng.integers(0, 40, rng.integers(3, 9)) for _ in range(12)]

    def text(n):
        return np.concatenate([phrases[i] for i in rng.integers(0, len(phrases), n)])[:200]

    native, ref = (NgramProposer(5, 1, 3, pool_capacity=600, lib=LIB),
                   NgramProposer(5, 1, 3, pool_capacity=600))
    assert native._lib is not None
    num_slots, capacity = 6, 260
    table = rng.integers(0, 40, (num_slots, capacity)).astype(np.int64)  # leftovers past each length
    lens = np.zeros(num_slots, np.int64)
    for s in range(num_slots):
        t = text(6)
        table[s, : len(t)] = t
        lens[s] = len(t)
    taken = pooled = 0  # steps with the pool on; slots given the pool's draft over a different own one
    for step in range(300):
        slots = np.nonzero(rng.random(num_slots) < 0.8)[0].astype(np.int64)
        if len(slots) == 0:
            continue
        view = SlotView(slots, table, lens[slots], rng.integers(0, 6, len(slots)).astype(np.int64))
        got, want = native.propose(view), ref.propose(view)
        np.testing.assert_array_equal(got.num_draft, want.num_draft)
        np.testing.assert_array_equal(got.draft_ids, want.draft_ids)
        assert (native._pending is None) == (ref._pending is None)
        if ref._pending is not None:
            for g, w in zip(native._pending, ref._pending):
                np.testing.assert_array_equal(g, w)
            pooled += 1
            first = ref._pending[1]  # [2, num_seqs] own and pool first drafts
            # the pool's won
            taken += int(((want.draft_ids[:, 0] == first[1]) & (first[0] != first[1])).sum())
        # commit: the draft's first tokens (often right) or a phrase's tokens; some requests finish
        emitted = [want.draft_ids[i, : rng.integers(1, 4)] if rng.random() < 0.6
                   else phrases[rng.integers(12)][:2]
                   for i in range(len(slots))]
        emitted = [e if len(e) else np.array([7]) for e in emitted]
        first_pos = lens[slots] - 1
        for i, s in enumerate(slots):
            table[s, lens[s]: lens[s] + len(emitted[i])] = emitted[i]
            lens[s] += len(emitted[i])
        done = (lens[slots] > 230) | (rng.random(len(slots)) < 0.03)
        update = StepUpdate(slots, np.zeros(len(slots), np.int64), first_pos,
                            np.array([len(e) for e in emitted]), done, table, None,
                            seq_lens=lens[slots].copy())
        native.observe(update)
        ref.observe(update)
        for s in slots[done]:  # a new request in the slot
            t = text(6)
            table[s, : len(t)] = t
            lens[s] = len(t)
    np.testing.assert_array_equal(native.sources.hits, ref.sources.hits)
    assert pooled > 100 and taken > 5
