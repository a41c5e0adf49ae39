"""Acceptance estimates: decayed counts of drafts that matched and of drafts whose fate is known, per (draft
source, key), read as (hits + PRIOR_HITS) / (seen + PRIOR_SEEN). The controller keys them by slot (how often
each slot's drafts of each source are accepted);
the n-gram proposer keys its choice of source by match length."""
from __future__ import annotations

import numpy as np

PRIOR_HITS = 1.0  # an estimate starts at 1 accepted of 2 drafted, until its key has history
PRIOR_SEEN = 2.0


class AcceptanceEstimator:
    """[num_sources, num_keys] decayed counts. `update` decays the rows it touches (per-slot estimates follow
    a request as its text changes); `add` decays every row, then counts
    (job-wide estimates follow the job)."""

    def __init__(self, num_sources: int, num_keys: int, decay: float):
        self.decay = decay
        self.hits = np.zeros((num_sources, num_keys))  # [num_sources, num_keys]
        self.seen = np.zeros((num_sources, num_keys))

    def rate(self, source, keys, prior=None) -> np.ndarray:
        """Estimated acceptance of drafts of `source` (scalar or [n]) at `keys` ([n]): their counts with
        PRIOR_SEEN drafts' worth of `prior` (scalar or [n]; None: PRIOR_HITS of PRIOR_SEEN)."""
        prior_hits = PRIOR_HITS if prior is None else PRIOR_SEEN * prior
        return (self.hits[source, keys] + prior_hits) / (self.seen[source, keys] + PRIOR_SEEN)

    def update(self, source, keys: np.ndarray, hits: np.ndarray, seen: np.ndarray) -> None:
        """One step's counts at distinct `keys` ([n]; source scalar or [n]): those rows decay,
        then add them."""
        self.hits[source, keys] = self.decay * self.hits[source, keys] + hits
        self.seen[source, keys] = self.decay * self.seen[source, keys] + seen

    def add(self, source: np.ndarray, keys: np.ndarray, hits: np.ndarray) -> None:
        """One step's drafts, each a (source, key, hit) triple ([n] each; keys may repeat): every count
        decays, then each draft counts once in seen and, when it hit, in hits."""
        self.hits *= self.decay
        self.seen *= self.decay
        width = self.hits.shape[1]
        cell = source * width + keys  # [n] flat (source, key) cells
        size = self.hits.size
        self.hits += np.bincount(cell, hits.astype(np.float64), size).reshape(self.hits.shape)
        self.seen += np.bincount(cell, None, size).reshape(self.seen.shape)

    def reset(self, key: int) -> None:
        self.hits[:, key] = self.seen[:, key] = 0.0
