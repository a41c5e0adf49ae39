"""Step costs: a table of measured step times by tokens fed, corrected online by the steps the job runs.

The table is timed at start-up on this machine, model and batch size, or found on disk (kept for a week under
<cache root>/costs, keyed by everything a step's cost depends on: a nightly job rerun on the same machine
times nothing). A table that no longer fits the machine's load costs speed, never exactness: the online
correction follows the measured step times.
"""
from __future__ import annotations

import hashlib
import json
import platform
import tempfile
import time
from pathlib import Path

import numpy as np

FAR = 1e9  # tokens: the table's ends extended this far along their slopes, so one np.interp extrapolates too


class CostModel:
    """Step time as a function of the tokens fed: a start-up table, corrected online point by point.

    The table can be off in its shape as well as its level (one unlucky timing of a 2-token step, kept on disk
    for a week, priced it at 1.39x a 1-token step where it cost 1.15x, and every job that read it drafted
    less). So each table point keeps its own measured ratio (observed seconds over the table's) from the steps
    whose token counts fall next to it, weighted as the interpolation weighs it, alongside the global ratio
    (scale) of all steps. A point's effective ratio is its own, shrunk toward the global one by POINT_PRIOR
    observations' worth; its evidence decays by POINT_DECAY per observed step, so a point the job stopped
    using drifts back to the global ratio. Beyond the table's ends the line through its end points
    extrapolates."""

    EMA = 0.1  # weight of one observation in the global ratio
    # A step counts at most OUTLIER x the current prediction. On a shared machine a step now and then takes
    # ~100 ms more (the hypervisor takes the CPU away: /proc/stat's steal ticks grow by 10-20 in exactly those
    # steps, ~1 step in 35 of a batch-1 job), 10-20x a decoding step; counted whole, one such step raised the
    # global ratio from 1 to ~2.3 for the next ~30 steps. Real errors of the table are within 2x per step.
    OUTLIER = 2.0
    POINT_PRIOR = 1.0  # observations' worth of the global ratio in each point's effective ratio
    POINT_DECAY = 0.97  # per observed step: a point's evidence (a ~30-step window)

    def __init__(self, tokens: np.ndarray, seconds: np.ndarray):
        self.tokens = np.asarray(tokens, np.float64)  # [num_points] increasing
        self.seconds = np.asarray(seconds, np.float64)  # [num_points]
        self._sum = np.zeros(len(self.tokens))  # decayed sums of interpolation weight x measured ratio
        self._evidence = np.zeros(len(self.tokens))  # decayed sums of interpolation weight
        self._x = self._extend(self.tokens, self.tokens)
        self._table = self._extend(self.tokens, self.seconds)
        self.scale = 1.0  # the global ratio (a setter: the effective table follows it)

    @staticmethod
    def _extend(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """y at x with a point FAR beyond each end on the line through the end points (one point: flat)."""
        slope = (y[-1] - y[0]) / max(x[-1] - x[0], 1.0)
        return np.concatenate([[y[0] - slope * FAR], y, [y[-1] + slope * FAR]]) if len(x) > 1 \
            else np.concatenate([[y[0]], y, [y[0]]])

    @property
    def scale(self) -> float:
        return self._scale

    @scale.setter
    def scale(self, value: float) -> None:
        self._scale = float(value)
        effective = (self.seconds * (self._sum + self.POINT_PRIOR * self._scale)
                     / (self._evidence + self.POINT_PRIOR))
        self._y = self._extend(self.tokens, effective)

    def __call__(self, num_tokens) -> np.ndarray:
        """Predicted seconds of steps feeding num_tokens (array or number)."""
        return np.interp(num_tokens, self._x, self._y)

    def at(self, num_tokens: int) -> float:
        return float(np.interp(num_tokens, self._x, self._y))

    def table_at(self, num_tokens: int) -> float:
        """The uncorrected table's seconds at num_tokens."""
        return float(np.interp(num_tokens, self._x, self._table))

    def _weights(self, t: float) -> np.ndarray:
        """The interpolation weight of each table point at token count t
        (the nearest end beyond the table)."""
        x = self.tokens
        w = np.zeros(len(x))
        if t >= x[-1] or t <= x[0]:
            w[-1 if t >= x[-1] else 0] = 1.0
            return w
        j = int(np.searchsorted(x, t, side="right")) - 1  # x[j] <= t < x[j + 1]
        lam = (t - x[j]) / (x[j + 1] - x[j])
        w[j], w[j + 1] = 1.0 - lam, lam
        return w

    def observe(self, num_tokens: int, seconds: float) -> None:
        """One step's measured seconds: into the global ratio and the ratios of the points next to its
        count."""
        predicted = self.table_at(num_tokens)
        if predicted <= 0:
            return
        r = min(seconds, self.OUTLIER * self.at(num_tokens)) / predicted
        weights = self._weights(float(num_tokens))  # [num_points]
        self._sum = self.POINT_DECAY * self._sum + weights * r
        self._evidence = self.POINT_DECAY * self._evidence + weights
        self.scale = (1 - self.EMA) * self._scale + self.EMA * r  # refreshes the effective table


# ---- the table on disk ----

MAX_AGE_S = 7 * 24 * 3600


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def table_path(root: Path, parts: list[str]) -> Path:
    """Where the table of everything in `parts` (the model's cost key, cache dtype, slots, draft depth,
    threads, the kernels' build) lives on this machine."""
    import paddle

    key = [*parts, platform.node(), _cpu_name(), paddle.__version__]
    return root / "costs" / (hashlib.sha256("\n".join(key).encode()).hexdigest()[:20] + ".json")


def load(path: Path | None) -> tuple[np.ndarray, np.ndarray] | None:
    """The stored (tokens, seconds) table, or None: absent, unreadable, malformed or older than MAX_AGE_S."""
    if path is None:
        return None
    try:
        entry = json.loads(path.read_text())
        tokens, seconds = np.array(entry["tokens"], np.int64), np.array(entry["seconds"], np.float64)
        fresh = time.time() - float(entry["measured_at"]) < MAX_AGE_S
    except (OSError, ValueError, KeyError, TypeError):
        return None
    ok = fresh and tokens.ndim == 1 and tokens.shape == seconds.shape and len(tokens) > 0
    ok = ok and bool((np.diff(tokens) > 0).all() and (seconds > 0).all())
    return (tokens, seconds) if ok else None


def store(path: Path | None, tokens: np.ndarray, seconds: np.ndarray) -> None:
    """Write the table atomically (readers see a whole file or none); a cache that cannot be written is
    skipped, as the next run then times the table again."""
    if path is None:
        return
    entry = {"tokens": [int(t) for t in tokens], "seconds": [float(s) for s in seconds],
             "measured_at": time.time()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        with open(fd, "w") as f:
            json.dump(entry, f)
        Path(tmp).replace(path)
    except OSError:
        return
