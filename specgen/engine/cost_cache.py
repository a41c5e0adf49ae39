"""Step-cost tables (runner.calibrate) kept on disk between runs on the same machine.

Timing the table costs a job 0.2-0.3 s at start-up (a twentieth of a small job, where speculation has the least
time to win it back). The table depends on the machine, the threads, the kernels and the model's shape and
weights' format, not on the prompts: a nightly job rerun on the same machine finds it under
$SPECGEN_CACHE/costs (default ~/.cache/specgen/costs), keyed by all of those, and times nothing. A stored table
older than MAX_AGE_S is timed again; SPECGEN_COST_CACHE=0 never reads or writes one. A table that no longer
fits the machine's load costs speed, never exactness: the controller's online scale follows the measured step
times, and its guard decodes plainly while speculating measures slower.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np

MAX_AGE_S = 7 * 24 * 3600


def _root() -> Path:
    return Path(os.environ.get("SPECGEN_CACHE", Path.home() / ".cache" / "specgen")) / "costs"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def table_path(model_key: str | None, cache_dtype: str, num_slots: int, max_draft: int) -> Path | None:
    """Where the table of this model (Model.cost_key), cache dtype, slots and draft depth lives on this
    machine; None when tables are not kept (SPECGEN_COST_CACHE=0, or a model without a key)."""
    from specgen import kernels

    if model_key is None or not kernels.switch("SPECGEN_COST_CACHE"):
        return None
    import paddle

    parts = [model_key, cache_dtype, str(num_slots), str(max_draft), os.environ.get("OMP_NUM_THREADS", ""),
             str(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()),
             platform.node(), _cpu_name(), paddle.__version__, kernels.build_key(),
             os.environ.get("SPECGEN_WIDE_LINEAR", "")]
    return _root() / (hashlib.sha256("\n".join(parts).encode()).hexdigest()[:20] + ".json")


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
    """Write the table (atomically: readers see a whole file or none); a cache that cannot be written is
    skipped, as the next run then times the table again."""
    if path is None:
        return
    entry = {"tokens": [int(t) for t in tokens], "seconds": [float(s) for s in seconds], "measured_at": time.time()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(entry, f)
        os.replace(tmp, path)
    except OSError:
        return
