"""The adaptive controller's per-slot choices: drafts that stop paying detach the slot from its drafter."""
import numpy as np

from specgen.engine.adaptive import Controller, CostModel


def test_slot_detaches_after_drafts_stop_paying_and_reattaches_on_reset():
    # each extra verified token costs 10% of a 2-token step
    ctl = Controller(CostModel(np.array([2, 4, 12]), np.array([1.0, 1.2, 2.0])), max_draft=5, num_slots=2)
    slots = np.array([0, 1])
    ctl.hits[:] = [0.0, 40.0]  # slot 0 never accepted; slot 1 always did
    ctl.seen[:] = [40.0, 40.0]
    for _ in range(Controller.DETACH_AFTER):
        k = ctl.choose(slots, np.array([5, 5]), 0)
    assert ctl.idle[0] == Controller.DETACH_AFTER and ctl.idle[1] == 0
    assert ctl.detached(slots).tolist() == [True, False]
    assert k[0] == 0
    ctl.reset(0)
    assert ctl.detached(slots).tolist() == [False, False]
