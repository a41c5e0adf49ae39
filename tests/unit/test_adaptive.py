"""The adaptive controller's per-slot choices: drafts that stop paying detach the slot from its drafter."""
import dataclasses
import types

import numpy as np
import pytest

from specgen.config import EngineConfig
from specgen.engine.adaptive import Controller, CostModel, StepReport, choose_drafts
from specgen.engine.adaptive import calibrate as calibration
from specgen.engine.adaptive import costs as cost_cache


def expected_emitted(a: float, k: int) -> float:
    """E[tokens per step] = 1 + a + ... + a^k."""
    return sum(a ** j for j in range(k + 1))


def _set(ctl: Controller, hits: float, seen: float, source: int = 0) -> None:
    ctl.acceptance.hits[source], ctl.acceptance.seen[source] = hits, seen


def _report(slots, drafts, avail, emitted, kept, source=None) -> StepReport:
    n = len(slots)
    return StepReport(slots=slots, draft_ids=drafts, num_avail=avail, num_draft=avail, source=source,
                      emitted=emitted, kept=kept, num_tokens=n, forward_seconds=1.0, draft_seconds=0.0)


def test_slot_detaches_after_drafts_stop_paying_and_reattaches_on_reset():
    # each extra verified token costs 10% of a 2-token step
    ctl = Controller(CostModel(np.array([2, 4, 12]), np.array([1.0, 1.2, 2.0])), max_draft=5, num_slots=2)
    slots = np.array([0, 1])
    ctl.acceptance.hits[0] = [0.0, 40.0]  # slot 0 never accepted; slot 1 always did
    ctl.acceptance.seen[0] = [40.0, 40.0]
    for _ in range(Controller.DETACH_AFTER):
        k = ctl.choose(slots, np.array([5, 5]), 0)
    assert ctl.idle[0] == Controller.DETACH_AFTER and ctl.idle[1] == 0
    assert ctl.detached(slots).tolist() == [True, False]
    assert k[0] == 0
    ctl.reset(0)
    assert ctl.detached(slots).tolist() == [False, False]


@pytest.mark.parametrize("num_slots", [1, 2])
def test_each_source_of_drafts_has_its_own_acceptance_and_only_source_0_detaches(num_slots):
    """An MTP slot's copies (source 1) accepted 0.9 and its head's drafts (source 0) 0.05: the choice follows
    the source offered this step, the copies' results do not move the head's estimate, and steps that offer
    copies leave the idle count (the head's detach) alone."""
    ctl = Controller(CostModel(np.array([1, 2, 6]), np.array([1.0, 1.1, 1.5])), max_draft=3,
                     num_slots=num_slots)
    slots = np.arange(num_slots)
    _set(ctl, 90.0, 100.0, source=1)
    _set(ctl, 5.0, 100.0, source=0)
    copy, head = np.ones(num_slots, np.int64), np.zeros(num_slots, np.int64)
    avail = np.full(num_slots, 3)
    assert (ctl.choose(slots, avail, 0, copy) >= 2).all()
    assert (ctl.idle[slots] == 0).all()
    assert (ctl.choose(slots, avail, 0, head) == 0).all() and (ctl.idle[slots] == 1).all()
    assert (ctl.choose(slots, avail, 0, copy) >= 2).all() and (ctl.idle[slots] == 1).all()  # untouched
    before = ctl.acceptance.rate(0, slots).copy()
    drafts = np.tile([7, 8, 9], (num_slots, 1))
    ctl.end_step(_report(slots, drafts, avail, np.tile([7, 8, 9, 1], (num_slots, 1)), np.full(num_slots, 4),
                         copy))
    assert np.allclose(ctl.acceptance.rate(0, slots), before)  # the head's estimate
    acc = ctl.acceptance
    assert (acc.hits[1, slots] == 0.9 * 90 + 3).all() and (acc.seen[1, slots] == 0.9 * 100 + 3).all()
    ctl.reset(0)
    assert acc.hits[:, 0].tolist() == [0.0, 0.0] and acc.seen[:, 0].tolist() == [0.0, 0.0]


def test_drafter_time_is_charged_and_idle_slots_detach():
    """A slot at acceptance 0.3: verifying one draft pays when drafting is free, not when the drafter (an MTP
    head's pass) takes 30% of a step. The drafter's time is spent this step whatever is chosen, so the slot
    still verifies a draft (1.3 / 1.35 beats 1 / 1.3), but it counts the steps that do not pay for the drafter
    and detaches from it: a choice flipping between 0 and 1 draft does not keep the drafter running."""
    cost = CostModel(np.array([1, 2, 6]), np.array([1.0, 1.05, 1.25]))
    ctl = Controller(cost, max_draft=2, num_slots=1)
    slot = np.array([0])
    _set(ctl, 30.0, 100.0)
    assert ctl.choose(slot, np.array([2]), 0)[0] >= 1  # E = 1.3 per 1.05 or better: pays
    assert ctl.idle[0] == 0
    ctl._drafting(0.3)
    for step in range(Controller.DETACH_AFTER):
        assert not ctl.detached(slot)[0]
        assert ctl.choose(slot, np.array([2]), 0)[0] >= 1  # 1.3 / (1.05 + 0.3) > 1 / (1 + 0.3), < 1 / 1
        assert ctl.idle[0] == step + 1
    assert ctl.detached(slot).tolist() == [True]
    ctl.reset(0)
    ctl.idle[0] = Controller.DETACH_AFTER - 1
    _set(ctl, 90.0, 100.0)  # drafts that pay for the drafter: the count goes down one a step
    assert ctl.choose(slot, np.array([2]), 0)[0] == 2 and ctl.idle[0] == Controller.DETACH_AFTER - 2
    for _ in range(Controller.DETACH_AFTER):
        ctl.choose(slot, np.array([2]), 0)
    assert ctl.idle[0] == 0


def test_drafts_that_pay_now_and_then_still_detach():
    """A slot whose drafts pay on one step in three (a draft right a third of the time) and not on the others
    detaches: the count is not reset by each paying step."""
    cost = CostModel(np.array([1, 2, 6]), np.array([1.0, 1.05, 1.25]))
    ctl = Controller(cost, max_draft=2, num_slots=1)
    ctl._drafting(0.3)
    slot = np.array([0])
    for step in range(3 * Controller.DETACH_AFTER):
        _set(ctl, 95.0 if step % 3 == 0 else 5.0, 100.0)
        ctl.choose(slot, np.array([2]), 0)
    assert ctl.detached(slot).tolist() == [True]


def test_rule_out_turns_a_drafter_off_where_one_draft_cannot_pay():
    """With the drafter's held-out acceptance 0.4 (x1.5 headroom = 0.6): at 1.7x for a second token per slot
    speculation is ruled out (every slot detached, k = 0); at 1.07x it stays on; without a hint nothing
    changes."""
    slots = np.arange(4)
    dear = Controller(CostModel(np.array([4, 8, 24]), np.array([1.0, 1.7, 4.0])), max_draft=5, num_slots=4)
    dear.rule_out(0.4)
    assert dear.off and dear.detached(slots).all()
    assert dear.choose(slots, np.full(4, 5), 0).tolist() == [0, 0, 0, 0]
    cheap = Controller(CostModel(np.array([4, 8, 24]), np.array([1.0, 1.07, 1.3])), max_draft=5, num_slots=4)
    cheap.rule_out(0.4)
    assert not cheap.off and not cheap.detached(slots).any()
    assert cheap.choose(slots, np.full(4, 5), 0).sum() > 0
    dear2 = Controller(CostModel(np.array([4, 8, 24]), np.array([1.0, 1.7, 4.0])), max_draft=5, num_slots=4)
    dear2.rule_out(None)
    assert not dear2.off


def test_a_stalled_step_counts_at_most_outlier_times_its_prediction():
    """A step the machine stalled in (~100 ms of hypervisor steal against 6-9 ms steps): the cost model and
    the drafter's time take it as OUTLIER (DRAFT_OUTLIER) x their prediction; a lasting change of level is
    still followed."""
    cost = CostModel(np.array([1, 2, 6]), np.array([0.006, 0.007, 0.011]))
    ctl = Controller(cost, max_draft=3, num_slots=1)
    for _ in range(40):  # the table right
        cost.observe(1, 0.006)
        cost.observe(4, 0.009)
    assert ctl.cost.scale == pytest.approx(1.0)
    predicted = ctl.cost.at(4)
    ctl.cost.observe(4, 0.110)
    assert ctl.cost.scale == pytest.approx(0.9 + 0.1 * CostModel.OUTLIER * predicted / ctl.cost.table_at(4))
    for _ in range(100):  # a real change of level, every step 2.5x the table: followed
        ctl.cost.observe(1, 0.015)
    assert ctl.cost.at(1) == pytest.approx(0.015, rel=0.02)

    ctl._drafting(0.0005)
    ctl._drafting(0.100)  # stalled while drafting
    assert ctl.draft_cost == pytest.approx(0.8 * 0.0005 + 0.2 * Controller.DRAFT_OUTLIER * 0.0005)
    for _ in range(30):  # the drafter's time rising 4.7x (a catch-up alone -> three chained drafts): followed
        ctl._drafting(0.0033)
    assert ctl.draft_cost == pytest.approx(0.0033, rel=0.01)


def test_scalar_cost_equals_the_interpolated_table():
    cost = CostModel(np.array([1.0, 2.0, 6.0]), np.array([0.0059, 0.0071, 0.011]))
    cost.scale = 1.13
    counts = np.arange(-2, 20)  # below, on, between and beyond the measured points
    assert [cost.at(int(t)) for t in counts] == cost(counts).tolist()
    one = CostModel(np.array([4.0]), np.array([0.02]))
    assert [one.at(t) for t in (1, 4, 9)] == one(np.array([1, 4, 9])).tolist()


def _stub_model(monkeypatch, seconds_of):
    """A model whose forward advances a fake clock (the calibration's time.perf_counter) by seconds_of(call
    number, tokens), and its cost key."""
    clock = {"t": 0.0, "calls": 0}
    monkeypatch.setattr(calibration.time, "perf_counter", lambda: clock["t"])

    class Stub:
        key = "model A"
        backend = types.SimpleNamespace(engine=EngineConfig())  # the settings it was loaded with
        config = types.SimpleNamespace(vocab_size=300)
        samples_in_forward = False  # (a backend whose forward samples rows: the sampled table's test below)

        def cost_key(self):
            return self.key

        def forward(self, batch, cache, logits=True):
            clock["calls"] += 1
            clock["t"] += seconds_of(clock["calls"], len(batch.token_ids))

    return Stub(), clock


class _Cache:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.dtype = "float32"


NO_DISK = EngineConfig(cost_cache=False)


def test_calibration_takes_the_median_of_repeated_timings(monkeypatch):
    """One slow timing (another process took the core) does not become the table's cost: each point is the
    median of its repeats, taken round robin."""
    # call 4 (3 tokens) is slow
    stub, clock = _stub_model(monkeypatch,
                              lambda call, tokens: 0.010 + 0.002 * (tokens - 1) + 0.050 * (call == 4))
    controller = calibration.controller_for(stub, _Cache(1), 2, NO_DISK)
    tokens, seconds = calibration.measured(stub)[(1, 2)]
    assert tokens.tolist() == [1, 2, 3]
    np.testing.assert_allclose(seconds, [0.010, 0.012, 0.014])
    # a warm-up, then rounds until 0.15 s are spent: 0.086 + 0.036 + 0.036 s
    assert clock["calls"] == 1 + 3 * 3
    assert controller.cost.at(3) == seconds[2]


def test_calibration_anchors_steps_of_few_slots(monkeypatch):
    """A memory-bound step costs about the same for 1 token as for 8; verifying drafts of 8 slots is
    compute-bound (2 ms a token). The table gets a one-token point, so a 2-token step (slots drained at the
    end of a job) is not extrapolated from the compute-bound slope to almost nothing."""
    stub, _ = _stub_model(monkeypatch, lambda call, tokens: 0.010 + 0.002 * max(0, tokens - 8))
    controller = calibration.controller_for(stub, _Cache(8), 5, NO_DISK)
    tokens, seconds = calibration.measured(stub)[(8, 5)]
    assert tokens.tolist() == [1, 8, 16, 48]
    np.testing.assert_allclose(seconds, [0.010, 0.010, 0.026, 0.090])
    assert controller.cost.at(2) == pytest.approx(0.010)  # extrapolated from 8 tokens: 0.010 - 6 * 0.0023 < 0


def test_calibration_times_blocks_of_distinct_tokens(monkeypatch):
    """A mixture-of-experts step costs more the more experts its tokens touch: a block of one repeated id
    routes every token alike (one token's experts), a verify block's tokens spread. The table's blocks hold
    distinct ids, so its 4-token point is a real verify block's cost, not one token's."""
    clock = {"t": 0.0}
    monkeypatch.setattr(calibration.time, "perf_counter", lambda: clock["t"])

    class Moe:  # 1 ms a step plus 1 ms per distinct token id in the step (an expert's weights read)
        backend = types.SimpleNamespace(engine=EngineConfig())
        config = types.SimpleNamespace(vocab_size=50_000)

        def cost_key(self):
            return "moe"

        def forward(self, batch, cache, logits=True):
            clock["t"] += 0.001 * (1 + len(np.unique(batch.token_ids)))

    moe = Moe()
    calibration.controller_for(moe, _Cache(1), 3, NO_DISK)
    tokens, seconds = calibration.measured(moe)[(1, 3)]
    assert tokens.tolist() == [1, 2, 4]
    np.testing.assert_allclose(seconds, [0.002, 0.003, 0.005])  # one id per block would give 0.002 throughout


def test_costs_are_measured_with_the_slots_the_job_fills(tiny_dir):
    """3 requests in an 8-slot engine: the start-up timings use 3 slots (the steps the job will run, at 3/8 of
    the cost of timing 8), and a job that fills the batch uses all 8."""
    from specgen import SamplingParams, SpecConfig, generate, load_model

    lm = load_model(tiny_dir, dtype="float32")
    spec = SpecConfig(method="ngram", num_speculative_tokens=3)
    sp = SamplingParams(max_tokens=4)
    generate([[5, 6, 7]] * 3, model=lm, sampling=sp, engine=EngineConfig(batch_size=8), speculative=spec)
    tables = calibration.measured(lm.model)
    assert list(tables) == [(3, 3)]
    tokens, seconds = tables[(3, 3)]
    assert tokens.tolist() == [3, 6, 12]  # 1, 2 and 4 tokens for each of 3 slots
    generate([[5, 6, 7]] * 20, model=lm, sampling=sp, engine=EngineConfig(batch_size=8), speculative=spec)
    assert list(tables) == [(3, 3), (8, 3)]
    tokens, seconds = tables[(8, 3)]
    assert tokens.tolist() == [1, 8, 16, 32]  # 8 slots: one slot's single token anchors the table too
    assert (np.diff(seconds) >= 0).all()


def test_cost_tables_are_kept_on_disk_between_runs(monkeypatch, tmp_path):
    """A table timed once is stored under <cache_dir>/costs and found by the next model of the same key on
    this machine (a later run), which times only the check of its first point; another key, an entry past
    MAX_AGE_S, a malformed file or cost_cache off times the table again."""
    import json

    disk = EngineConfig(cache_dir=str(tmp_path))

    def cost(call: int, tokens: int) -> float:
        return 0.010 + 0.002 * (tokens - 1)

    def fresh(key: str = "model A"):
        stub, clock = _stub_model(monkeypatch, cost)
        stub.key = key
        return stub, clock

    first, clock = fresh()
    calibration.controller_for(first, _Cache(2), 3, disk)
    assert clock["calls"] > 0
    files = list((tmp_path / "costs").glob("*.json"))
    assert len(files) == 1
    again, clock = fresh()
    controller = calibration.controller_for(again, _Cache(2), 3, disk)
    assert clock["calls"] == 1 + calibration.CHECKS  # only the check of its first point
    for a, b in zip(calibration.measured(again)[(2, 3)], calibration.measured(first)[(2, 3)]):
        np.testing.assert_array_equal(a, b)
    assert controller.cost.at(8) == calibration.measured(first)[(2, 3)][1][-1]

    other, clock = fresh("model B")
    calibration.controller_for(other, _Cache(2), 3, disk)
    assert clock["calls"] > 0 and len(list((tmp_path / "costs").glob("*.json"))) == 2

    entry = json.loads(files[0].read_text())
    entry["measured_at"] -= cost_cache.MAX_AGE_S + 1
    files[0].write_text(json.dumps(entry))
    stale, clock = fresh()
    calibration.controller_for(stale, _Cache(2), 3, disk)
    assert clock["calls"] > 0  # timed again, and stored afresh
    assert json.loads(files[0].read_text())["measured_at"] > entry["measured_at"] + cost_cache.MAX_AGE_S

    files[0].write_text("{not json")
    broken, clock = fresh()
    calibration.controller_for(broken, _Cache(2), 3, disk)
    assert clock["calls"] > 0

    off, clock = fresh("model C")
    calibration.controller_for(off, _Cache(2), 3, EngineConfig(cache_dir=str(tmp_path), cost_cache=False))
    assert clock["calls"] > 0 and len(list((tmp_path / "costs").glob("*.json"))) == 2


def test_speculation_needs_a_predicted_gain_of_min_gain():
    """One slot, a second token per step costs 10% more. At acceptance 0.13 one draft is predicted to emit 3%
    more tokens per second than plain decoding, inside the cost model's error: the step stays plain. At 0.25
    (14% more) it verifies the draft; with MIN_GAIN 0 the 3% one is verified too."""
    cost = CostModel(np.array([1, 2]), np.array([1.0, 1.1]))
    slot, avail = np.array([0]), np.array([1])

    def choice(accepted: float, min_gain: float = Controller.MIN_GAIN) -> int:
        ctl = Controller(cost, max_draft=1, num_slots=1)
        ctl.MIN_GAIN = min_gain
        _set(ctl, accepted * 102 - 1, 100.0)  # alpha = (hits + 1) / (seen + 2)
        return int(ctl.choose(slot, avail, 0)[0])

    assert Controller.MIN_GAIN == 0.05
    assert choice(0.13) == 0
    assert choice(0.25) == 1
    assert choice(0.13, min_gain=0.0) == 1


def test_one_slot_takes_the_best_draft_count_of_the_objective():
    """With one decoding slot the choice maximises E(k) / (c(1 + k) + d) over k >= 1 (brute force here), and
    is verified only when that beats k = 0, at 1 / (c(1) + d), by MIN_GAIN; the slot's idle count grows unless
    it also beats plain decoding without the drafter, 1 / c(1)."""
    cost = CostModel(np.array([1, 2, 4, 8, 16]), np.array([1.0, 1.06, 1.3, 1.9, 3.5]))
    for acc in (0.05, 0.3, 0.6, 0.8, 0.95):
        for avail in (1, 3, 5):
            for d in (0.0, 0.05):
                ctl = Controller(cost, max_draft=5, num_slots=2)
                _set(ctl, acc * 102 - 1, 100.0)
                ctl.draft_cost = d or None
                got = int(ctl.choose(np.array([0]), np.array([avail]), 0)[0])
                a = float(ctl.acceptance.rate(0, 0))
                rates = {k: expected_emitted(a, k) / (cost.at(1 + k) + d)
                         for k in range(1, avail + 1)}
                k_best = max(rates, key=rates.get)
                want = k_best if rates[k_best] > (1 + Controller.MIN_GAIN) / (cost.at(1) + d) else 0
                pays = rates[k_best] > (1 + Controller.MIN_GAIN) / cost.at(1)
                assert got == want, (acc, avail, d)
                assert ctl.idle[0] == (1 if want == 0 or not pays else 0)


def _stale_and_true():
    """A table whose shape is off (a 2-token step priced at 1.39x a 1-token one, a 6-token step at 2.28x: one
    unlucky timing kept on disk), and the step costs a job then measures (1.15x and 2.01x, all 1.3x the
    table's level: deeper contexts than the table's position 0)."""
    table = CostModel(np.array([1, 2, 6]), np.array([0.010, 0.0139, 0.0228]))
    true = {1: 0.013, 2: 0.013 * 1.15, 6: 0.013 * 2.01}
    return table, true


def test_cost_points_the_steps_contradict_are_corrected():
    cost, true = _stale_and_true()
    for step in range(60):  # mostly plain steps, now and then a 2- or 6-token verify
        t = 2 if step % 5 == 1 else 6 if step % 5 == 3 else 1
        cost.observe(t, true[t])
    assert cost.at(1) == pytest.approx(true[1], rel=0.02)
    # each point's own ratio, shrunk toward the global one by POINT_PRIOR observations' worth: within 4% here
    assert cost.at(2) / cost.at(1) == pytest.approx(1.15, rel=0.04)
    assert cost.at(6) / cost.at(1) == pytest.approx(2.01, rel=0.04)
    assert [cost.at(t) for t in range(-1, 12)] == cost(np.arange(-1, 12)).tolist()  # the two paths agree
    # between points: the corrected points' interpolation (a 4-token step here: halfway from 2 to 6)
    assert cost.at(4) == pytest.approx((cost.at(2) + cost.at(6)) / 2, rel=1e-12)


def test_a_cost_point_no_step_comes_near_follows_the_global_ratio():
    cost, _ = _stale_and_true()
    for _ in range(80):
        cost.observe(1, 0.02)  # only plain steps, at twice the table's cost
    assert cost.scale == pytest.approx(2.0, rel=1e-3)
    assert cost.at(6) == pytest.approx(2.0 * 0.0228, rel=1e-3)  # the table's shape, at the measured level
    assert cost.at(2) == pytest.approx(2.0 * 0.0139, rel=1e-3)


def test_a_cost_point_the_job_stops_using_drifts_back_to_the_global_ratio():
    """Evidence decays: 2-token steps measured cheap early on, then only 1-token steps at a new level
    (contexts grew): the 2-token point moves from its own old ratio toward the global one."""
    cost, true = _stale_and_true()
    for _ in range(30):
        cost.observe(2, true[2])
    early = cost.at(2) / cost.table_at(2)
    for _ in range(300):
        cost.observe(1, 0.026)  # 2.6x the table
    late = cost.at(2) / cost.table_at(2)
    assert early == pytest.approx(true[2] / 0.0139, rel=0.02)
    assert late == pytest.approx(2.6, rel=0.02)


def test_the_controller_drafts_once_its_steps_show_the_table_overpriced_verifying():
    """Acceptance 0.35, one slot: under the stale table a draft does not pay (1.35 / 1.39 < 1.05); the job's
    own steps show a 2-token step at 1.15x, and then it does."""
    cost, true = _stale_and_true()
    ctl = Controller(cost, max_draft=5, num_slots=1)
    _set(ctl, 0.35 * 102 - 1, 100.0)
    slot, avail = np.array([0]), np.array([5])
    assert int(ctl.choose(slot, avail, 0)[0]) == 0
    for step in range(40):
        t = 2 if step % 4 == 1 else 1
        cost.observe(t, true[t])
    assert int(ctl.choose(slot, avail, 0)[0]) >= 1


def test_many_slots_get_the_best_split_of_the_drafts():
    """Three slots at acceptance 0.9, 0.5 and 0.05: the choice maximises sum E_s(k_s) / c(3 + sum k) over
    every split of up to 3 drafts each (brute force), and the surest slot gets the most drafts."""
    import itertools

    cost = CostModel(np.array([3, 6, 12]), np.array([1.0, 1.25, 1.9]))
    alpha = np.array([0.9, 0.5, 0.05])
    avail = np.array([3, 3, 3])
    k, pays = choose_drafts(alpha, avail, 0, 0.0, cost, 0.05)
    assert pays
    best = max(itertools.product(range(4), repeat=3),
               key=lambda ks: sum(expected_emitted(a, j) for a, j in zip(alpha, ks)) / cost.at(3 + sum(ks)))
    assert tuple(k.tolist()) == best
    assert k[0] >= k[1] >= k[2]


def test_new_requests_start_detached_while_the_jobs_drafts_cannot_pay():
    """32 slots where a second token per slot costs 1.7x: while the job's drafts are accepted 0.1 of the time,
    a new request starts detached from the drafter, but for one in EXPLORE_EVERY; once the job's drafts are
    accepted 0.95 of the time, new requests draft again. Only source 0's drafts count toward the job's
    rate."""
    n = 32
    ctl = Controller(CostModel(np.array([32, 64, 128]), np.array([1.0, 1.7, 3.0])), max_draft=3, num_slots=n)
    slots = np.arange(n)
    drafts, avail, kept = np.tile([7, 8, 9], (n, 1)), np.full(n, 3), np.full(n, 4)
    miss, hit = np.tile([1, 2, 3, 4], (n, 1)), np.tile([7, 8, 9, 4], (n, 1))
    for _ in range(30):
        ctl.end_step(_report(slots, drafts, avail, miss, kept))
        # copies: not counted
        ctl.end_step(_report(slots, drafts, avail, hit, kept, source=np.ones(n, np.int64)))
    assert ctl.job.rate(0, 0) < 0.1
    for slot in range(n):
        ctl.reset(slot)
    detached = ctl.detached(slots)
    assert detached.sum() == n - n // Controller.EXPLORE_EVERY
    assert not detached[:: Controller.EXPLORE_EVERY].any()
    for _ in range(60):
        ctl.end_step(_report(slots, drafts, avail, hit, kept))
    for slot in range(n):
        ctl.reset(slot)
    assert not ctl.detached(slots).any()


def test_a_new_slots_acceptance_starts_from_the_jobs():
    """One slot, a 2-token step at 1.34x one (an MoE verify block at batch 1). A new request with no drafts of
    its own yet is estimated at the job's acceptance so far: after requests whose drafts all missed it
    verifies nothing (from a fixed 1 in 2 it would draft: 1.5 tokens for 1.34x); after drafts that hit, it
    drafts. Copies (source 1) keep the fixed prior."""
    ctl = Controller(CostModel(np.array([1, 2, 4]), np.array([1.0, 1.34, 1.96])), max_draft=3, num_slots=1)
    slot, avail = np.array([0]), np.array([3])
    assert int(ctl.choose(slot, avail, 0)[0]) >= 1  # no history anywhere: 1 in 2
    for _ in range(40):  # every draft misses
        ctl.end_step(_report(slot, np.array([[7, 8, 9]]), avail, np.array([[1, 2, 3, 4]]), np.array([4])))
    ctl.reset(0)  # a new request
    assert ctl.rates(0, slot)[0] < 0.15 and int(ctl.choose(slot, avail, 0)[0]) == 0
    assert ctl.rates(np.array([1]), slot)[0] == 0.5
    for _ in range(40):  # every draft hits
        ctl.end_step(_report(slot, np.array([[7, 8, 9]]), avail, np.array([[7, 8, 9, 4]]), np.array([4])))
    ctl.reset(0)
    assert ctl.rates(0, slot)[0] > 0.8 and int(ctl.choose(slot, avail, 0)[0]) == 3



def test_rated_drafts_are_priced_by_their_probabilities_calibrated_by_the_job():
    """A drafter that rates its tree nodes (EAGLE: the probability of each node's path): before any step the
    controller takes the probabilities as they are; once its drafts were accepted half as often as it
    expected, every node is worth half; gains stay at most 1 and non-increasing along a row."""
    ctl = Controller(CostModel(np.array([1, 2, 6]), np.array([1.0, 1.1, 1.5])), max_draft=5, num_slots=2)
    scores = np.array([[0.9, 0.6, 0.3, 0.0], [0.5, 0.5, 0.2, 0.1]])
    assert np.allclose(ctl.calibrated(scores), scores, atol=1e-12)
    for _ in range(200):
        ctl.end_step(dataclasses.replace(_report(np.array([0]), np.zeros((1, 0), np.int64), np.array([0]),
                                                 np.zeros((1, 1), np.int64), np.array([1])),
                                         rated=(1.0, 2.0)))
    assert np.allclose(ctl.calibrated(scores), scores / 2, atol=0.02)
    for _ in range(200):  # accepted 3x what it expected: capped at 1
        ctl.end_step(dataclasses.replace(_report(np.array([0]), np.zeros((1, 0), np.int64), np.array([0]),
                                                 np.zeros((1, 1), np.int64), np.array([1])),
                                         rated=(3.0, 1.0)))
    got = ctl.calibrated(scores)
    assert got.max() == 1.0 and (np.diff(got, axis=1) <= 0).all()
    # a budget from the calibrated gains: the most probable nodes first, none where nothing is expected
    k = ctl.choose(np.array([0, 1]), np.array([4, 4]), 0, None,
                   ctl.calibrated(np.array([[0.0] * 4, [0.9] * 4])))
    assert k[0] == 0 and k[1] >= 1


def test_a_stall_while_timing_does_not_become_the_table(monkeypatch):
    """Large steps (past the timing budget in one round) are still timed MIN_REPEATS times: the first round's
    stalled forward (1.2 s where steps take 0.1-0.2 s) is outvoted by the median."""
    stub, _ = _stub_model(monkeypatch, lambda call, tokens: 0.1 + 0.02 * tokens + 1.2 * (call == 2))
    calibration.controller_for(stub, _Cache(1), 3, NO_DISK)
    tokens, seconds = calibration.measured(stub)[(1, 3)]
    np.testing.assert_allclose(seconds, [0.12, 0.14, 0.18])


def test_a_stored_table_that_no_longer_fits_is_timed_again(monkeypatch, tmp_path):
    """A table on disk whose first point is 100x what its step takes now (timed while the machine stalled) is
    timed again and replaced; one within 2x is kept."""
    import json

    disk = EngineConfig(cache_dir=str(tmp_path))
    stub, clock = _stub_model(monkeypatch, lambda call, tokens: 0.010 + 0.002 * (tokens - 1))
    calibration.controller_for(stub, _Cache(1), 3, disk)
    (path,) = (tmp_path / "costs").glob("*.json")
    entry = json.loads(path.read_text())
    for scale, timed in ((1.5, False), (100.0, True)):
        path.write_text(json.dumps({**entry, "seconds": [x * scale for x in entry["seconds"]]}))
        again, clock = _stub_model(monkeypatch, lambda call, tokens: 0.010 + 0.002 * (tokens - 1))
        controller = calibration.controller_for(again, _Cache(1), 3, disk)
        assert (clock["calls"] > 1 + calibration.CHECKS) == timed
        assert controller.cost.at(1) == pytest.approx(0.010 * (1.0 if timed else scale))
    assert json.loads(path.read_text())["seconds"][0] == pytest.approx(0.010)


def test_a_job_whose_drafts_are_right_a_third_of_the_time_starts_requests_detached():
    """Batch 1, a drafter costing 0.3 of a step (a draft model), a 2-token step at 1.1x one: drafts right 0.36
    of the time over the job do not pay (1.36 tokens for 1.4x), so new requests start detached, but for one in
    EXPLORE_EVERY; the job's own rate is taken as measured (with the 1.5x of a head's held-out hint, 0.54
    would have looked worth drafting)."""
    ctl = Controller(CostModel(np.array([1, 2, 4]), np.array([1.0, 1.1, 1.3])), max_draft=3, num_slots=1)
    ctl._drafting(0.3)
    ctl.job.hits[0, 0], ctl.job.seen[0, 0] = 36.0, 100.0
    attached = []
    for _ in range(2 * Controller.EXPLORE_EVERY):
        ctl.reset(0)
        attached.append(not ctl.detached(np.array([0]))[0])
    assert sum(attached) == 2


def test_a_distilled_drafts_recorded_acceptance_is_its_hint(tmp_path):
    """make-draft records the draft's held-out first-draft acceptance; the proposer hands it to the
    controller, which rules the draft out where even 1.5x of it could not pay (32 slots, a second token per
    slot at 1.7x)."""
    import json

    from specgen.engine.proposers.draft_model import recorded_acceptance

    (tmp_path / "config.json").write_text(json.dumps({"specgen_draft": {"training": {"eval_acc": 0.287}}}))
    assert recorded_acceptance(tmp_path) == 0.287
    assert recorded_acceptance(tmp_path / "absent") is None
    wide = Controller(CostModel(np.array([32, 64, 128]), np.array([1.0, 1.7, 3.0])), max_draft=3,
                      num_slots=32)
    wide.rule_out(recorded_acceptance(tmp_path))
    narrow = Controller(CostModel(np.array([1, 2, 4]), np.array([1.0, 1.1, 1.3])), max_draft=3, num_slots=1)
    narrow.rule_out(recorded_acceptance(tmp_path))
    assert wide.off and not narrow.off


def _thirty_two_slots() -> tuple[Controller, np.ndarray]:
    """32 slots where a second token per slot costs 1.3x (a verify block of 64 tokens against 32)."""
    ctl = Controller(CostModel(np.array([32, 64, 128]), np.array([1.0, 1.3, 2.2])), max_draft=3, num_slots=32)
    return ctl, np.arange(32)


def test_a_first_generation_whose_drafts_do_not_pay_detaches_at_once():
    """32 requests placed together before any draft is known all draft (1 in 2 would pay at 1.3x). Once two
    steps (JOB_EVIDENCE_PER_SLOT) show the job's drafts missing, the next step detaches every slot but the
    explorers (one request in EXPLORE_EVERY), instead of each drafting DETACH_AFTER steps (0.95x of plain
    decoding at 32 slots); after one step's evidence none is detached yet. A token tree's slots keep the
    DETACH_AFTER rule."""
    ctl, slots = _thirty_two_slots()
    for slot in slots:
        ctl.reset(slot)
    assert not ctl.detached(slots).any()
    avail = np.full(32, 3)
    assert ctl.choose(slots, avail, 0).sum() > 0
    miss = _report(slots, np.tile([7, 8, 9], (32, 1)), avail, np.tile([1, 2, 3, 4], (32, 1)), np.full(32, 4))
    ctl.end_step(miss)
    assert ctl.choose(slots, avail, 0).sum() == 0 and not ctl.detached(slots).any()
    ctl.end_step(miss)
    tree = ctl.choose(slots, avail, 0, gains=np.full((32, 3), 0.01))  # a tree's nodes: the count grows by one
    assert tree.sum() == 0 and not ctl.detached(slots).any()
    assert ctl.choose(slots, avail, 0).sum() == 0
    explorers = slots % Controller.EXPLORE_EVERY == 0
    assert ctl.detached(slots).tolist() == (~explorers).tolist()


def test_a_slot_whose_own_drafts_pay_stays_attached_when_the_job_does_not():
    """The job's drafts miss, but one slot's own drafts have been right 0.95 of the time: it keeps verifying
    and stays attached while the slots verifying nothing detach."""
    ctl, slots = _thirty_two_slots()
    for slot in slots:
        ctl.reset(slot)
    ctl.job.hits[0, 0], ctl.job.seen[0, 0] = 2.0, 100.0
    ctl.acceptance.hits[0, 5], ctl.acceptance.seen[0, 5] = 95.0, 100.0
    k = ctl.choose(slots, np.full(32, 3), 0)
    assert k[5] > 0 and ctl.detached(slots).sum() == 32 - 32 // Controller.EXPLORE_EVERY - 1
    assert not ctl.detached(slots)[5]


def test_the_drafters_hint_is_the_jobs_prior_before_any_draft():
    """A draft whose held-out acceptance is 0.287 is not ruled out at 1.3x (1.5x headroom: 0.43), but 1.287
    tokens for 1.3x do not pay: its first 32 requests start detached, explorers aside. Without a hint (1 in 2)
    they start attached."""
    ctl, slots = _thirty_two_slots()
    ctl.rule_out(0.287)
    assert not ctl.off
    for slot in slots:
        ctl.reset(slot)
    assert ctl.detached(slots).sum() == 32 - 32 // Controller.EXPLORE_EVERY
    plain, _ = _thirty_two_slots()
    plain.rule_out(None)
    for slot in slots:
        plain.reset(slot)
    assert not plain.detached(slots).any()


def test_a_job_smaller_than_the_batch_is_judged_at_its_own_size():
    """3 requests in 32 slots, a draft right 0.3 of the time: a second token per slot costs 1.05x at 3 slots
    and 1.5x at 32. Before the first step its requests are judged at 3 slots (they pay, and start attached),
    not at the 32 the engine could hold."""
    ctl = Controller(CostModel(np.array([3, 6, 32, 64]), np.array([1.0, 1.05, 3.0, 4.5])), max_draft=1,
                     num_slots=32)
    ctl.rule_out(0.3, active=3)
    assert not ctl.off and ctl.active == 3
    for slot in range(3):
        ctl.reset(slot)
    assert not ctl.detached(np.arange(3)).any()


def test_a_sampled_job_prices_its_steps_with_the_sampler(monkeypatch):
    """A sampled job's steps pay for logits and the sampler on every logit row: its table is timed that way
    (the job's first sampled request's settings), kept apart from the greedy table of the same model."""
    from specgen.config import SamplingParams

    stub, clock = _stub_model(monkeypatch, lambda call, tokens: 0.010 + 0.001 * (tokens - 1))
    seen = []

    def forward(batch, cache, logits=True):
        clock["t"] += 0.010 + 0.001 * (len(batch.token_ids) - 1)
        assert logits  # the sampler needs them
        return types.SimpleNamespace(logits=None, greedy=np.zeros(len(batch.logit_rows), np.int64))

    def sample(logits, rows, greedy):
        seen.append((rows.temperature.tolist(), rows.top_p.tolist()))
        clock["t"] += 0.002 * len(greedy)  # 2 ms a row sampled
        return greedy

    stub.forward, stub.sample = forward, sample
    sampling = SamplingParams(temperature=0.8, top_p=0.95)
    calibration.controller_for(stub, _Cache(1), 2, NO_DISK, sampling=sampling)
    tokens, seconds = calibration.measured(stub)[(1, 2, (0.8, 0, 0.95, 0.0, False))]
    np.testing.assert_allclose(seconds, [0.012, 0.015, 0.018])  # + 2 ms per verified row
    assert seen[0] == ([0.8], [0.95]) and (1, 2) not in calibration.measured(stub)


def test_a_sampled_job_without_filters_prices_the_steps_that_sample_in_the_forward(monkeypatch):
    """Where the backend samples rows with no filter in its forward (the fused backend's screen), a job
    sampling at T alone times those forwards: no logits, no sampler call; one with top-p still pays for
    both."""
    from specgen.config import SamplingParams

    stub, clock = _stub_model(monkeypatch, lambda call, tokens: 0.010 + 0.001 * (tokens - 1))
    stub.samples_in_forward = True
    calls = []

    def forward(batch, cache, logits=True, sampling=None):
        calls.append((logits, sampling is not None))
        clock["t"] += 0.010 + 0.001 * (len(batch.token_ids) - 1) + (0.0 if sampling is None else 0.0005)
        return types.SimpleNamespace(logits=None, greedy=np.zeros(len(batch.logit_rows), np.int64))

    def sample(logits, rows, greedy):
        clock["t"] += 0.002 * len(greedy)
        return greedy

    stub.forward, stub.sample = forward, sample
    calibration.controller_for(stub, _Cache(1), 2, NO_DISK, sampling=SamplingParams(temperature=0.8))
    tokens, seconds = calibration.measured(stub)[(1, 2, (0.8, 0, 1.0, 0.0, False))]
    np.testing.assert_allclose(seconds, [0.0105, 0.0115, 0.0125])
    assert calls and all(c == (False, True) for c in calls)
    calls.clear()
    top_p = SamplingParams(temperature=0.8, top_p=0.9)
    calibration.controller_for(stub, _Cache(1), 2, NO_DISK, sampling=top_p)
    tokens, seconds = calibration.measured(stub)[(1, 2, (0.8, 0, 0.9, 0.0, False))]
    np.testing.assert_allclose(seconds, [0.012, 0.015, 0.018])
    assert calls and all(c == (True, False) for c in calls)
    calls.clear()  # log-probabilities need the logits, filters or not
    logprobs = SamplingParams(temperature=0.8, logprobs=True)
    calibration.controller_for(stub, _Cache(1), 2, NO_DISK, sampling=logprobs)
    tokens, seconds = calibration.measured(stub)[(1, 2, (0.8, 0, 1.0, 0.0, True))]
    np.testing.assert_allclose(seconds, [0.012, 0.015, 0.018])
    assert calls and all(c == (True, False) for c in calls)


def test_probing_asks_the_drafter_on_two_steps_in_eight_only_while_the_job_does_not_pay():
    """An n-gram job whose drafts are accepted 0.1 of the time (a second token per slot costs 1.7x): with
    every slot detached, the proposer and the controller run on PROBE_STEPS steps in a row of every
    PROBE_EVERY; a step with a slot attached, or after a choice where the job's drafts pay, is a probe."""
    n = 4
    ctl = Controller(CostModel(np.array([4, 8, 16]), np.array([1.0, 1.7, 3.0])), max_draft=3, num_slots=n)
    slots = np.arange(n)
    drafts, avail, kept = np.tile([7, 8, 9], (n, 1)), np.full(n, 3), np.full(n, 4)
    for _ in range(30):
        ctl.end_step(_report(slots, drafts, avail, np.tile([1, 2, 3, 4], (n, 1)), kept))
    ctl.choose(slots, avail, 0)
    assert ctl.unpaying
    pattern = [ctl.probing(True) for _ in range(3 * Controller.PROBE_EVERY)]
    every = [False] * (Controller.PROBE_EVERY - Controller.PROBE_STEPS) + [True] * Controller.PROBE_STEPS
    assert pattern == every * 3
    assert ctl.probing(False) and ctl.quiet == 0  # a slot attached: every step drafts, the count starts over
    assert not ctl.probing(True)
    for _ in range(60):  # the job's drafts turn right
        ctl.end_step(_report(slots, drafts, avail, np.tile([7, 8, 9, 4], (n, 1)), kept))
    ctl.choose(slots, avail, 0)
    assert not ctl.unpaying and all(ctl.probing(True) for _ in range(20))


def test_copies_of_detached_slots_are_asked_for_on_probes_only_while_they_do_not_pay_a_step():
    """Every slot detached from the head, one slot's copies (source 1) offered each step: while the copies
    accepted per detached slot a step could not pay for verifying them (a second token per slot costs 1.2x),
    the proposer is asked on PROBE_STEPS steps of every PROBE_EVERY (with `copies`; n-gram's rule, the head's
    own drafts, still asks every step); copies right often enough ask on every step again."""
    n = 4
    ctl = Controller(CostModel(np.array([4, 8, 16]), np.array([1.0, 1.2, 2.0])), max_draft=2, num_slots=n)
    slots = np.arange(n)
    for s in slots:
        ctl.detach(int(s))
    source = np.array([1, 0, 0, 0])
    drafts, avail, kept = np.array([[7, 8], [0, 0], [0, 0], [0, 0]]), np.array([2, 0, 0, 0]), np.full(n, 3)
    for _ in range(30):
        ctl.end_step(_report(slots, drafts, avail, np.tile([1, 2, 3], (n, 1)), kept, source))
    ctl.choose(slots, avail, 0, source)
    assert ctl.copies_unpaying and not ctl.unpaying
    every = [False] * (Controller.PROBE_EVERY - Controller.PROBE_STEPS) + [True] * Controller.PROBE_STEPS
    assert [ctl.probing(True, copies=True) for _ in range(2 * Controller.PROBE_EVERY)] == every * 2
    assert all(ctl.probing(True) for _ in range(10))
    assert ctl.probing(False, copies=True)  # a slot attached: every step drafts
    for _ in range(60):  # the copies turn right: 2 tokens a step for 1 slot in 4, verifying 2
        ctl.end_step(_report(slots, drafts, avail, np.tile([7, 8, 3], (n, 1)), kept, source))
    ctl.choose(slots, avail, 0, source)
    assert not ctl.copies_unpaying and all(ctl.probing(True, copies=True) for _ in range(20))


def test_copies_that_gain_a_little_do_not_pay_for_a_costly_proposer():
    """Copies of one slot in 4, 2 verified a step and 1 accepted: 5 tokens for a step of 6 (1.1x a 4-token
    step) beat plain decoding's 4 when finding them is free, not when the proposer takes 0.2 of a step; slots
    not detached count no copy steps."""
    n = 4
    slots = np.arange(n)
    source = np.array([1, 0, 0, 0])
    drafts, avail, kept = np.array([[7, 8], [0, 0], [0, 0], [0, 0]]), np.array([2, 0, 0, 0]), np.full(n, 3)
    emitted = np.tile([7, 9, 3], (n, 1))
    for draft_seconds, unpaying in ((0.0, False), (0.2, True)):
        ctl = Controller(CostModel(np.array([4, 8, 16]), np.array([1.0, 1.2, 2.0])), max_draft=2, num_slots=n)
        for s in slots:
            ctl.detach(int(s))
        for _ in range(30):
            ctl.end_step(dataclasses.replace(_report(slots, drafts, avail, emitted, kept, source),
                                              draft_seconds=draft_seconds))
        np.testing.assert_allclose(ctl.copy_gain.rate(0, 0, 0.0) / ctl.copy_verify.rate(0, 0, 0.0), 0.5,
                                   rtol=0.05)
        ctl.choose(slots, avail, 0, source)
        assert ctl.copies_unpaying == unpaying
    attached = Controller(CostModel(np.array([4, 8, 16]), np.array([1.0, 1.2, 2.0])), max_draft=2,
                          num_slots=n)
    attached.end_step(_report(slots, drafts, avail, emitted, kept, source))
    assert attached.copy_gain.seen[0, 0] == 0


def _quiet_job(monkeypatch, flag: str, proposer_cls, calls: dict) -> None:
    """Every slot detached, nothing verified, and Controller.<flag> set (the job's drafts, or copies, known
    not to pay); calls["propose"] counts proposer_cls.propose."""
    monkeypatch.setattr(Controller, "detached", lambda self, s: np.ones(len(s), bool))

    def choose(self, s, avail, *a, **k):
        setattr(self, flag, True)
        return np.zeros(len(avail), np.int64)

    monkeypatch.setattr(Controller, "choose", choose)
    propose = proposer_cls.propose

    def counted_propose(self, view):
        calls["propose"] += 1
        return propose(self, view)

    monkeypatch.setattr(proposer_cls, "propose", counted_propose)


def test_mtp_copies_between_probes_are_not_asked_and_outputs_stay_plain(tiny_dir, tmp_path, monkeypatch):
    """An MTP head with copies, every slot detached and its copies known not to pay: the proposer drafts on
    about PROBE_STEPS / PROBE_EVERY of the steps, and the outputs are plain decoding's; a finished request
    leaves its slot neither drafts nor copies (its next request's first steps may go untold)."""
    from specgen import SamplingParams, SpecConfig, generate, load_model
    from specgen.config import MtpConfig
    from specgen.drafters.mtp import random_mtp_weights, save_mtp
    from specgen.engine.proposers.mtp import MtpProposer

    lm = load_model(tiny_dir, dtype="float32")
    save_mtp(tmp_path, random_mtp_weights(lm.config, seed=3, std=0.3))
    spec = SpecConfig(method="mtp", num_speculative_tokens=2, mtp=MtpConfig(model=str(tmp_path)))
    prompts = [[5, 6, 7, 5, 6], [9, 10, 11, 12], [3, 4, 3, 4], [20, 21, 22]]
    sp = SamplingParams(max_tokens=21, ignore_eos=True, temperature=0.8, seed=1)
    plain = [o.token_ids for o in generate(prompts, model=lm, sampling=sp)]
    calls = {"propose": 0, "stale": 0}
    _quiet_job(monkeypatch, "copies_unpaying", MtpProposer, calls)
    observe = MtpProposer.observe

    def checked_observe(self, update):
        observe(self, update)
        done = update.slots[update.finished]
        calls["stale"] += int((self.num_drafts[done] != 0).sum() + (self.copy_at[done] != -1).sum())

    monkeypatch.setattr(MtpProposer, "observe", checked_observe)
    outs = generate(prompts, model=lm, sampling=sp, speculative=spec, engine=EngineConfig(batch_size=2))
    assert [o.token_ids for o in outs] == plain
    steps = sum(o.stats.num_steps for o in outs) // 2  # two slots a step
    assert 0 < calls["propose"] <= steps * Controller.PROBE_STEPS // Controller.PROBE_EVERY + 4
    assert calls["stale"] == 0


def test_ngram_between_probes_is_not_asked_and_its_pool_still_takes_finished_text(tiny_dir, monkeypatch):
    """Every slot detached from an n-gram job whose drafts do not pay: the proposer drafts on about
    PROBE_STEPS / PROBE_EVERY of the steps, the outputs are plain decoding's, and every finished request's
    text still reaches the job's pool (told on the steps between probes too)."""
    from specgen import SamplingParams, SpecConfig, generate, load_model
    from specgen.engine.proposers.ngram import NgramProposer
    from specgen.engine.proposers.ngram_pool import NgramPool

    lm = load_model(tiny_dir, dtype="float32")
    prompts = [[5, 6, 7], [9, 10, 11, 12], [3, 4], [20, 21, 22]]
    sp = SamplingParams(max_tokens=21, ignore_eos=True)  # (requests end between probes)
    plain = [o.token_ids for o in generate(prompts, model=lm, sampling=sp)]
    calls = {"propose": 0, "pooled": 0}
    _quiet_job(monkeypatch, "unpaying", NgramProposer, calls)
    add_batch = NgramPool.add_batch

    def counted_add(self, tokens, lens):
        calls["pooled"] += len(lens)
        return add_batch(self, tokens, lens)

    monkeypatch.setattr(NgramPool, "add_batch", counted_add)
    outs = generate(prompts, model=lm, sampling=sp, speculative=SpecConfig(method="ngram"),
                    engine=EngineConfig(batch_size=2))
    assert [o.token_ids for o in outs] == plain
    steps = sum(o.stats.num_steps for o in outs) // 2  # two slots a step
    assert 0 < calls["propose"] <= steps * Controller.PROBE_STEPS // Controller.PROBE_EVERY + 4
    assert calls["pooled"] == len(prompts)
