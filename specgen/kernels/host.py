"""ngram.cc's functions through ctypes, each called with typed argument structs (mirrors of its C structs).

The structs that stay put for a proposer's life (the rule, the pool, the source rates: numpy arrays updated in
place) are built once and passed by reference; a step builds only its SlotText.
"""
from __future__ import annotations

import ctypes

import numpy as np

NATIVE_MAX = 64  # ngram.cc's bound on k and n_max

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


class SlotText(ctypes.Structure):
    """Rows `slots` [num_seqs] of the engine's token table [*, row_stride], valid up to seq_lens
    [num_seqs]."""

    _fields_ = [("tokens", _ptr), ("row_stride", _i64), ("slots", _ptr), ("seq_lens", _ptr),
                ("num_seqs", _i64)]

    @classmethod
    def of(cls, tokens: np.ndarray, slots: np.ndarray, seq_lens: np.ndarray) -> tuple["SlotText", tuple]:
        """The struct and the arrays it points into (keep them alive for the call)."""
        arrays = (np.ascontiguousarray(tokens, np.int64), np.ascontiguousarray(slots, np.int64),
                  np.ascontiguousarray(seq_lens, np.int64))
        t, s, n = arrays
        return cls(t.ctypes.data, t.shape[1], s.ctypes.data, n.ctypes.data, len(s)), arrays


class NgramRule(ctypes.Structure):
    """Up to k drafts after the most recent occurrence of the longest tail of n_min..n_max tokens."""

    _fields_ = [("k", _i64), ("n_min", _i64), ("n_max", _i64)]


class PoolView(ctypes.Structure):
    """The job's pool (ngram_pool.NgramPool): its ring, hash tables and tokens written, by address."""

    _fields_ = [("ring", _ptr), ("capacity", _i64), ("keys", _ptr), ("ends", _ptr), ("table_bits", _i64),
                ("written", _i64)]


class SourceRates(ctypes.Structure):
    """Decayed hits and drafts seen per (source, match length), [2, n_max + 1] float64 each (an
    AcceptanceEstimator's arrays), the pool's least rate, and the estimates' prior."""

    _fields_ = [("hits", _ptr), ("seen", _ptr), ("min_rate", ctypes.c_double),
                ("prior_hits", ctypes.c_double), ("prior_seen", ctypes.c_double)]


class Drafts(ctypes.Structure):
    """Outputs: draft [num_seqs, k], num_draft [num_seqs], match_len [num_seqs]."""

    _fields_ = [("draft", _ptr), ("num_draft", _ptr), ("match_len", _ptr)]

    @classmethod
    def empty(cls, num_seqs: int, k: int) -> tuple["Drafts", tuple[np.ndarray, np.ndarray, np.ndarray]]:
        arrays = (np.empty((num_seqs, k), np.int64), np.empty(num_seqs, np.int64),
                  np.empty(num_seqs, np.int64))
        return cls(*(a.ctypes.data for a in arrays)), arrays


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Give the library's functions their argument types (once, when it is loaded)."""
    ref = ctypes.POINTER
    lib.specgen_ngram_match.argtypes = [ref(SlotText), ref(NgramRule), ref(Drafts)]
    lib.specgen_ngram_pool_lookup.argtypes = [_ptr, _ptr, _i64, ref(NgramRule), ref(PoolView), ref(Drafts)]
    lib.specgen_ngram_propose.argtypes = [ref(SlotText), _ptr, ref(NgramRule), ref(PoolView),
                                          ref(SourceRates), _ptr]
    for f in (lib.specgen_ngram_match, lib.specgen_ngram_pool_lookup, lib.specgen_ngram_propose):
        f.restype = None
    return lib


def ngram_match(lib: ctypes.CDLL, text: SlotText,
                rule: NgramRule) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(draft [num_seqs, k], num_draft [num_seqs], match_len [num_seqs]) of each slot's own-text match."""
    out, arrays = Drafts.empty(text.num_seqs, rule.k)
    lib.specgen_ngram_match(ctypes.byref(text), ctypes.byref(rule), ctypes.byref(out))
    return arrays


def pool_lookup(lib: ctypes.CDLL, tails: np.ndarray, tail_lens: np.ndarray, rule: NgramRule,
                pool: PoolView) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The pool's drafts for tails [num_seqs, n_max] (right-aligned), tail_lens [num_seqs]."""
    tails = np.ascontiguousarray(tails, np.int64)
    tail_lens = np.ascontiguousarray(tail_lens, np.int64)
    out, arrays = Drafts.empty(len(tails), rule.k)
    lib.specgen_ngram_pool_lookup(tails.ctypes.data, tail_lens.ctypes.data, len(tails), ctypes.byref(rule),
                                  ctypes.byref(pool), ctypes.byref(out))
    return arrays


def ngram_propose(lib: ctypes.CDLL, text: SlotText, max_draft: np.ndarray, rule: NgramRule, pool: PoolView,
                  rates: SourceRates) -> np.ndarray:
    """[num_seqs, k + 5]: k draft ids, num_draft, own first draft, own match length, pool first draft, pool
    match length."""
    max_draft = np.ascontiguousarray(max_draft, np.int64)
    out = np.empty((text.num_seqs, rule.k + 5), np.int64)
    lib.specgen_ngram_propose(ctypes.byref(text), max_draft.ctypes.data, ctypes.byref(rule),
                              ctypes.byref(pool), ctypes.byref(rates), out.ctypes.data)
    return out
