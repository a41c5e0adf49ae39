"""What `specgen train-mtp` shows while it works: a generation bar, then a training bar (stderr)."""
from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


class TrainProgress:
    """Two tasks on one display: sequences generated (tok/s) and steps trained (loss, accuracy, s/step)."""

    def __init__(self, quiet: bool):
        self.quiet = quiet
        self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[info]}"), TimeRemainingColumn(),
                                 console=Console(stderr=True), disable=quiet)
        self._gen = self._train = None
        self._start = time.perf_counter()
        self._first_step: tuple[int, float] | None = None
        self._last: dict[str, Any] = {}

    def generating(self, done: int, total: int, num_tokens: int) -> None:
        if self._gen is None:
            self._start = time.perf_counter()
            self._gen = self.progress.add_task("generating", total=total, completed=done, info="")
        rate = num_tokens / max(time.perf_counter() - self._start, 1e-9)
        self.progress.update(self._gen, completed=done, info=f"{rate:.0f} tok/s" if num_tokens else "")

    def training(self, step: int, total: int, row: dict[str, Any] | None) -> None:
        now = time.perf_counter()
        if self._train is None:
            self._train = self.progress.add_task("training", total=total, completed=step, info="")
        if self._first_step is None:
            self._first_step = (step, now)
        if row is not None:
            self._last.update({k: v for k, v in row.items() if v is not None})
        s0, t0 = self._first_step
        parts = [f"{k} {self._last[k]:.3f}" for k in ("loss", "acc", "eval_acc", "eval_acc2")
                 if k in self._last]
        if step > s0:
            parts.append(f"{(now - t0) / (step - s0):.2f} s/step")
        self.progress.update(self._train, completed=step, info="  ".join(parts))


@contextmanager
def train_progress(quiet: bool) -> Iterator[TrainProgress]:
    p = TrainProgress(quiet)
    with p.progress:
        yield p
