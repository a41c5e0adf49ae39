"""Hand-worked n-gram drafting cases, each checked on the numpy reference and on ngram.cc."""
import numpy as np

from specgen.engine.proposers.ngram import ngram_match_native, ngram_propose
from specgen.kernels import host_lib

LIB = host_lib()


def run(seq, k=3, n_min=1, n_max=3):
    d = ngram_propose(np.array([seq]), np.array([len(seq)]), k, n_min, n_max)
    want = d.draft_ids[0, : d.num_draft[0]].tolist()
    if LIB is not None:  # the host kernels are built (a compiler is present)
        got = ngram_match_native(LIB, np.array([seq + [99] * 3]), np.array([0]), np.array([len(seq)]),
                                 k, n_min, n_max)[0]
        assert got.draft_ids[0, : got.num_draft[0]].tolist() == want
    return want


def test_match_at_prompt_start():
    assert run([7, 8, 9, 10, 11, 7, 8]) == [9, 10, 11]


def test_match_at_end_is_cut_by_what_follows():
    # tail [3, 4] occurs at 2..3; only [5, 3, 4] follows it, which is the tail itself (overlap allowed)
    assert run([1, 2, 3, 4, 5, 3, 4], k=5) == [5, 3, 4]


def test_overlapping_occurrences_use_the_most_recent():
    assert run([1, 1, 1, 1], k=3) == [1]  # tail [1,1,1] last occurs at 0, followed by one token


def test_no_match():
    assert run([1, 2, 3, 4]) == []


def test_several_candidates_most_recent_wins_and_longer_n_first():
    # tail (n=2) [1, 2] occurs at 0 (-> 3) and at 3 (-> 4): most recent wins
    assert run([1, 2, 3, 1, 2, 4, 9, 1, 2], k=1, n_max=2) == [4]
    # a 3-gram match beats a more recent 1-gram match
    assert run([5, 1, 2, 7, 0, 2, 8, 5, 1, 2], k=1) == [7]


def test_batched_equals_one_by_one():
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 4, rng.integers(1, 40)).tolist() for _ in range(50)]
    width = max(map(len, seqs))
    tokens = np.zeros((len(seqs), width), np.int64)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)] = s
    d = ngram_propose(tokens, np.array([len(s) for s in seqs]), 4, 1, 3)
    for i, s in enumerate(seqs):
        assert d.draft_ids[i, : d.num_draft[i]].tolist() == run(s, k=4)
