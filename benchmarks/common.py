"""What the benchmark scripts share: the prompt sets, the machine line, a timer and a table printer."""
from __future__ import annotations

import datetime
import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import numpy as np

T = TypeVar("T")

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
CATEGORIES = ["summarization", "rag", "translation", "math_reasoning", "qa", "writing"]  # Spec-Bench's six


def load_sets(per_category: int, mbpp: int) -> dict[str, list[list[dict]]]:
    """Chat messages per prompt set: the first `per_category` Spec-Bench questions of each category (their
    first turn), and "code_rewrite": the first `mbpp` sanitized-MBPP functions, each asked to be rewritten."""
    sets: dict[str, list[list[dict]]] = {}
    lines = (DATA / "spec_bench" / "question.jsonl").read_text().splitlines()
    questions = [json.loads(line) for line in lines if line.strip()]
    for category in CATEGORIES:
        items = [q for q in questions if q["category"] == category][:per_category]
        sets[category] = [[{"role": "user", "content": q["turns"][0]}] for q in items]
    functions = json.loads((DATA / "mbpp" / "sanitized-mbpp.json").read_text())[:mbpp]
    ask = "Rewrite this function with type hints and a docstring:\n\n"
    sets["code_rewrite"] = [[{"role": "user", "content": f"{ask}```python\n{f['code']}\n```"}]
                            for f in functions]
    return sets


def machine() -> str:
    """One line to print at the top of every run: the CPU, the cores this process may use, the load (other
    processes on a shared machine take cores from a benchmark) and the time."""
    cpu = "unknown CPU"
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                 if line.startswith("model name")]
        cpu = names[0] if names else cpu
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = f", load average {os.getloadavg()[0]:.2f}" if hasattr(os, "getloadavg") else ""
    now = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    return f"machine: {cpu}, {cores} cores available{load}, {now}"


def timed(fn: Callable[[], T]) -> tuple[T, float]:
    """fn's result and the wall-clock seconds it took."""
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def repeat_times(fn: Callable[[], object], repeats: int) -> list[float]:
    """The seconds of `repeats` calls of fn, after one untimed warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def _cell(value: object, digits: int) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]], digits: int = 2) -> None:
    """Print rows under headers; a column holding numbers (or None, printed "-") is right-aligned, one of text
    left-aligned; floats get `digits` decimals."""
    cells = [[_cell(v, digits) for v in row] for row in rows]
    numeric = [all(isinstance(row[i], (int, float, type(None))) and not isinstance(row[i], bool)
                   for row in rows) for i in range(len(headers))]
    widths = [max([len(h)] + [len(row[i]) for row in cells]) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        columns = zip(values, widths, numeric, strict=True)
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in columns).rstrip()

    print(line(headers))
    for row in cells:
        print(line(row))


class ForwardLog:
    """Each forward of a loaded model (its tokens fed and seconds) while the log is attached: for ratios
    that price every arm's forwards at one pooled cost per token count (normalized_seconds), so that the
    machine's drift between arms (this shared VM's step time moved 20% within a minute) cancels."""

    def __init__(self, loaded):
        self.calls: list[tuple[int, float]] = []
        model = loaded.model
        inner = model.forward

        def forward(batch, *args, **kwargs):
            start = time.perf_counter()
            out = inner(batch, *args, **kwargs)
            self.calls.append((len(batch.token_ids), time.perf_counter() - start))
            return out

        model.forward = forward  # (the instance's: the engine calls model.forward)

    def take(self) -> list[tuple[int, float]]:
        calls, self.calls = self.calls, []
        return calls


def normalized_seconds(runs: dict[str, list[tuple[float, list[tuple[int, float]]]]]) -> dict[str, float]:
    """Per arm, from its runs [(wall seconds, ForwardLog calls)], the least over its runs of: the run's
    forwards each priced at the median seconds of its token count over every arm's runs (prefills feed the
    same counts in every arm), plus the run's host time (wall less its own forwards). Warm every arm up first:
    an engine's first job times its controller's cost table with forwards of its own."""
    per_n: dict[int, list[float]] = {}
    for arm_runs in runs.values():
        for _, calls in arm_runs:
            for n, dt in calls:
                per_n.setdefault(n, []).append(dt)
    cost = {n: float(np.median(v)) for n, v in per_n.items()}
    return {arm: min(sum(cost[n] - dt for n, dt in calls) + wall for wall, calls in arm_runs)
            for arm, arm_runs in runs.items()}
