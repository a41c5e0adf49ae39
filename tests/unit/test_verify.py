"""Verification and stop handling on constructed inputs; statistics through the engine."""
import numpy as np

from specgen.engine.verify import accept_lengths, first_stop


def test_accept_lengths_all_none_partial_and_ragged():
    drafts = np.array([[5, 6, 7], [5, 6, 7], [5, 9, 7], [5, 6, 7]])
    num_draft = np.array([3, 3, 3, 1])
    targets = np.array([[5, 6, 7, 8], [4, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8]])
    # all accepted; first wrong; second wrong (later match does not count); only one drafted
    assert accept_lengths(drafts, num_draft, targets).tolist() == [3, 0, 1, 1]


def test_accept_lengths_without_drafts():
    assert accept_lengths(np.zeros((2, 0), np.int64), np.zeros(2, np.int64),
                          np.ones((2, 1), np.int64)).tolist() == [0, 0]


def test_first_stop_eos_inside_draft_and_room():
    emitted = np.array([[5, 2, 7, 8], [5, 6, 7, 8], [2, 6, 7, 8], [5, 6, 2, 8]])
    num_emitted = np.array([4, 4, 1, 2])
    room = np.array([10, 2, 10, 10])
    kept, by_eos = first_stop(emitted, num_emitted, np.array([2]), room, np.zeros(4, bool))
    # EOS at 1; max_tokens leaves 2; EOS first; EOS past what was emitted
    assert kept.tolist() == [2, 2, 1, 2]
    assert by_eos.tolist() == [True, False, True, False]
    kept, by_eos = first_stop(emitted, num_emitted, np.array([2]), room, np.ones(4, bool))
    assert kept.tolist() == [4, 2, 1, 2] and not by_eos.any()
