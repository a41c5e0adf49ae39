"""The job's n-gram pool: hand-worked lookups, ring overwrite, and how the proposer combines it with a slot's
own text."""
import numpy as np

from specgen.engine.adaptive.estimator import PRIOR_HITS, PRIOR_SEEN, AcceptanceEstimator
from specgen.engine.proposers.base import SlotView
from specgen.engine.proposers.ngram import NgramProposer
from specgen.engine.proposers.ngram_pool import NgramPool


def lookup(pool, tail, k=3):
    tails = np.zeros((1, pool.n_max), np.int64)
    tails[0, pool.n_max - min(len(tail), pool.n_max):] = tail[-pool.n_max:]
    ids, num, n = pool.lookup(tails, np.array([len(tail)]), k)
    return ids[0, : num[0]].tolist(), int(n[0])


def test_latest_occurrence_and_longest_n_win():
    pool = NgramPool(1000, 1, 3)
    pool.add(np.array([5, 6, 7, 1, 2, 3]))
    pool.add(np.array([9, 6, 7, 4, 4]))
    assert lookup(pool, [6, 7]) == ([4, 4], 2)  # the later request's continuation of [6, 7]
    assert lookup(pool, [5, 6, 7]) == ([1, 2, 3], 3)  # a 3-gram beats the later 2-gram
    assert lookup(pool, [0, 8]) == ([], 0)  # no n-gram of the tail occurs


def test_drafts_stop_at_the_end_of_a_request():
    pool = NgramPool(1000, 1, 3)
    pool.add(np.array([1, 2, 3, 4]))
    pool.add(np.array([8, 8, 8, 8]))
    assert lookup(pool, [2, 3], k=5) == ([4], 2)  # not running on into the next request's text
    assert lookup(pool, [4]) == ([], 0)  # a request's last token has no follower and is not indexed


def test_text_the_ring_overwrote_is_a_miss():
    pool = NgramPool(12, 1, 2)
    pool.add(np.array([1, 2, 3, 4, 5]))
    assert lookup(pool, [1, 2]) == ([3, 4, 5], 2)
    pool.add(np.array([20, 21, 22, 23, 24, 25, 26]))  # 14 tokens written into a ring of 12
    assert lookup(pool, [1, 2]) == ([], 0)
    assert lookup(pool, [21, 22]) == ([23, 24, 25], 2)


def test_random_lookups_equal_a_scan():
    rng = np.random.default_rng(1)
    seqs = [rng.integers(0, 6, rng.integers(2, 30)) for _ in range(40)]
    pool = NgramPool(1 << 12, 1, 3, table_bits=16)
    for s in seqs:
        pool.add(s)
    text = np.concatenate([np.append(s, -1) for s in seqs]).tolist()
    for _ in range(200):
        tail = rng.integers(0, 6, 3).tolist()
        want = ([], 0)
        for n in (3, 2, 1):  # the longest n, and its latest occurrence that has a follower
            ends = [i + n for i in range(len(text) - n)
                    if text[i:i + n] == tail[3 - n:] and text[i + n] != -1]
            if ends:
                e = ends[-1]
                cont = text[e:e + 4]
                want = ((cont[: cont.index(-1)] if -1 in cont else cont), n)
                break
        assert lookup(pool, tail, k=4) == want


def test_adding_a_step_s_requests_at_once_equals_adding_them_one_by_one():
    rng = np.random.default_rng(2)
    seqs = [rng.integers(0, 6, rng.integers(1, 30)) for _ in range(24)]
    one, batched = NgramPool(200, 1, 3, table_bits=12), NgramPool(200, 1, 3, table_bits=12)  # the ring wraps
    for s in seqs:
        one.add(s)
    for lo in range(0, len(seqs), 5):
        group = seqs[lo:lo + 5]
        tokens = np.zeros((len(group), 40), np.int64)
        for i, s in enumerate(group):
            tokens[i, : len(s)] = s
        batched.add_batch(tokens, np.array([len(s) for s in group]))
    assert one.written == batched.written
    np.testing.assert_array_equal(one.ring, batched.ring)
    np.testing.assert_array_equal(one.keys, batched.keys)
    np.testing.assert_array_equal(one.ends, batched.ends)


def propose(proposer, seq, k=3):
    view = SlotView(np.zeros(1, np.int64), np.array([seq]), np.array([len(seq)]), np.array([k]))
    d = proposer.propose(view)
    return d.draft_ids[0, : d.num_draft[0]].tolist()


def step_update(seq, emitted, finished=False):
    """The StepUpdate of a one-slot decode step that emitted `emitted` after `seq`."""
    from specgen.engine.types import StepUpdate

    tokens = np.array([seq + emitted])
    return StepUpdate(np.zeros(1, np.int64), np.zeros(1, np.int64), np.array([len(seq) - 1]),
                      np.array([len(emitted)]), np.array([finished]), tokens, None,
                      seq_lens=np.array([len(seq) + len(emitted)]))


def test_proposer_learns_which_source_to_follow():
    proposer = NgramProposer(3, 1, 3, pool_capacity=1000)
    proposer.pool.add(np.array([1, 2, 3, 50, 51, 52]))
    seq = [9, 2, 3, 60, 1, 2, 3]  # own text: [2, 3] -> 60 (n=2); pool: [1, 2, 3] -> 50 (n=3)
    # no history: equal estimates, the slot's own text wins the tie
    assert propose(proposer, seq) == [60, 1, 2]
    assert propose(proposer, [7, 1, 2, 3]) == [50, 51, 52]  # no own match: the pool's draft
    for _ in range(3):  # the pool's n=3 drafts turn out right, the own n=2 ones wrong
        propose(proposer, seq)
        proposer.observe(step_update(seq, [50]))
    assert proposer.sources.rate(1, np.array([3]))[0] > 0.5 > proposer.sources.rate(0, np.array([2]))[0]
    assert propose(proposer, seq) == [50, 51, 52]
    assert propose(NgramProposer(3, 1, 3), seq) == [60, 1, 2]  # no pool: own text only


def test_source_statistics_count_every_scored_candidate_once():
    """AcceptanceEstimator.add against np.add.at over (source, n) cells, with several slots scoring the same
    cell in a step; rates are (hits + PRIOR_HITS) / (seen + PRIOR_SEEN)."""
    rng = np.random.default_rng(3)
    decay = NgramProposer.SOURCE_DECAY
    stats, hits, seen = AcceptanceEstimator(2, 5, decay), np.zeros((2, 5)), np.zeros((2, 5))
    for _ in range(20):
        match_len = rng.integers(0, 5, (2, 9))  # 9 slots, n in 0..4 (0: no candidate): cells repeat
        hit = rng.random((2, 9)) < 0.5
        m = match_len > 0
        source = np.broadcast_to(np.arange(2)[:, None], match_len.shape)[m]
        stats.add(source, match_len[m], hit[m])
        hits *= decay
        seen *= decay
        np.add.at(hits, (source, match_len[m]), hit[m].astype(np.float64))
        np.add.at(seen, (source, match_len[m]), 1.0)
    np.testing.assert_allclose(stats.hits, hits, rtol=1e-12)
    np.testing.assert_allclose(stats.seen, seen, rtol=1e-12)
    assert (stats.seen[:, 0] == 0).all()  # n = 0: never scored
    np.testing.assert_allclose(stats.rate(1, np.arange(5)), (hits[1] + PRIOR_HITS) / (seen[1] + PRIOR_SEEN))


def test_finished_requests_enter_the_pool():
    proposer = NgramProposer(3, 1, 3, pool_capacity=1000)
    proposer.observe(step_update([7, 8, 9, 7], [8], finished=True))
    assert proposer.pool.written == 6  # the slot's 5 tokens and a separator
    assert propose(proposer, [5, 7, 8, 9]) == [7, 8]
    proposer.observe(step_update([1, 2, 3], [4], finished=False))
    assert proposer.pool.written == 6  # a running request is not in the pool


def test_a_repeated_request_drafts_from_the_pool_in_the_engine(tiny_model64):
    """Through the engine: the same prompt six times, one slot. With the pool, requests 2-6 find their whole
    output in it; the outputs are those of plain decoding either way, and the pool's drafts are accepted."""
    from specgen import EngineConfig, NgramConfig, SamplingParams, SpecConfig, generate

    prompts = [[5, 6, 7, 8, 9]] * 6
    sp = SamplingParams(max_tokens=24, ignore_eos=True)
    engine = EngineConfig(batch_size=1, dtype="float64")
    plain = generate(prompts, model=tiny_model64, sampling=sp, engine=engine)
    runs = {pool: generate(prompts, model=tiny_model64, sampling=sp, engine=engine,
                           speculative=SpecConfig(method="ngram", num_speculative_tokens=5, adaptive=False,
                                                  ngram=NgramConfig(pool=pool))) for pool in (0, 1 << 16)}
    for outs in runs.values():
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    own, pooled = ([o.stats.num_accepted_tokens for o in runs[p]] for p in (0, 1 << 16))
    assert pooled[0] == own[0]  # the first request has an empty pool
    assert sum(pooled[1:]) > sum(own[1:])
    assert min(pooled[1:]) >= 18  # 24 tokens in 6 or fewer steps: most drafts accepted
