"""What the user sees: the rich progress bar (stderr), the summary and bench tables (stdout)."""
from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from specgen.io.bench_rows import BenchRow
from specgen.io.summary import Summary, SummaryAccumulator

MAX_ERRORS_SHOWN = 20


def _fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


class RunProgress:
    """Requests done/total, output tokens/s, acceptance rate and ETA; silent when `quiet`."""

    def __init__(self, quiet: bool, console: Console | None = None):
        self.quiet = quiet
        self.console = console or Console(stderr=True)
        self._progress = Progress(
            TextColumn("[bold]generating"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[tps]} tok/s"), TextColumn("accept {task.fields[acc]}"),
            TimeRemainingColumn(),
            console=self.console, disable=quiet, transient=False,
        )
        self._task = None
        self._start = time.perf_counter()
        self._errors_shown = 0

    def start(self, total: int | None, completed: int) -> None:
        self._start = time.perf_counter()
        self._task = self._progress.add_task("run", total=total, completed=completed, tps="-", acc="-")

    def update(self, acc: SummaryAccumulator, completed: int) -> None:
        if self._task is None or self.quiet:
            return
        elapsed = time.perf_counter() - self._start
        tps = f"{acc.num_output_tokens / elapsed:.1f}" if elapsed > 0 else "-"
        self._progress.update(self._task, completed=completed, tps=tps, acc=_fmt(acc.acceptance_rate, ".2f"))

    def note(self, message: str) -> None:
        """A line about the run itself (shown unless --quiet)."""
        if not self.quiet:
            self._progress.console.print(f"note: {message}", markup=False, highlight=False)

    def record_error(self, message: str) -> None:
        """Bad records are errors: shown even with --quiet, up to MAX_ERRORS_SHOWN."""
        self._errors_shown += 1
        if self._errors_shown <= MAX_ERRORS_SHOWN:
            self._progress.console.print(f"error: {message}", markup=False, highlight=False)
        elif self._errors_shown == MAX_ERRORS_SHOWN + 1:
            self._progress.console.print("error: further bad records are only in the output's error field",
                                         markup=False, highlight=False)


@contextmanager
def run_progress(quiet: bool) -> Iterator[RunProgress]:
    """A live progress display for the duration of the block."""
    progress = RunProgress(quiet)
    with progress._progress:
        yield progress


def summary_table(summary: Summary, title: str = "summary") -> Table:
    table = Table(title=title, show_header=False)
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        ("requests", str(summary.num_requests)),
        ("errors", str(summary.num_errors)),
        ("method", ", ".join(summary.methods) or "-"),
        ("prompt tokens", str(summary.num_prompt_tokens)),
        ("prefill chunks", str(summary.num_prefill_chunks)),
        ("prompt tokens from the shared prefix", str(summary.num_cached_prompt_tokens)),
        ("output tokens", str(summary.num_output_tokens)),
        ("wall time (s)", _fmt(summary.wall_time_s, ".2f")),
        ("output tokens/s", _fmt(summary.output_tokens_per_s, ".1f")),
        ("mean accepted length", _fmt(summary.mean_accepted_length)),
        ("drafts verified", str(summary.num_draft_tokens)),
        ("acceptance rate (of drafts verified)", _fmt(summary.acceptance_rate)),
    ]
    rows += [(f"draft position {i + 1} accepted, per decode step", f"{p:.3f}")
             for i, p in enumerate(summary.per_position_acceptance)]
    if summary.kv_cache_bytes is not None:
        rows.append(("KV cache at peak (MiB)", f"{summary.kv_cache_bytes / 2**20:.1f}"
                     + (f" (without the shared prefix: {summary.kv_cache_bytes_unshared / 2**20:.1f})"
                        if summary.kv_cache_bytes_unshared != summary.kv_cache_bytes else "")))
    if summary.expert_tokens is not None:
        rows.append(("tokens per expert (routed blocks summed)", " ".join(map(str, summary.expert_tokens))))
        rows.append(("expert load, busiest / mean (per block, averaged)",
                     _fmt(summary.expert_load_max_over_mean, ".2f")))
    for name, value in rows:
        table.add_row(name, value)
    return table


def bench_table(rows: Sequence[BenchRow]) -> Table:
    """One row per method and batch size (specgen.app.bench.BenchRow): its rate, its speedup over the first
    method at that batch size, acceptance, and for n-gram what was possible (ceiling, oracle bound, the share
    of it reached); for a learned drafter, acceptance per draft position."""
    table = Table(title="bench")
    columns = ("method", "k", "batch", "reqs", "tokens", "tok/s", "speedup", "accept", "tok/step", "ceiling",
               "oracle", "of oracle", "per position", "identical")
    for name in columns:
        table.add_column(name, justify="left" if name in ("method", "per position") else "right")
    for r in rows:
        s, p = r.summary, r.possible
        positions = (" ".join(f"{x:.2f}" for x in s.per_position_acceptance)
                     if r.method not in ("none", "ngram") else "")  # learned drafters
        table.add_row(r.label, "-" if r.k is None else str(r.k), str(r.batch_size), str(s.num_requests),
                      str(s.num_output_tokens), _fmt(r.tok_s, ".1f"), _x(r.speedup), _fmt(s.acceptance_rate),
                      _fmt(s.mean_accepted_length, ".2f"), _fmt(None if p is None else p.ceiling, ".2f"),
                      _x(None if p is None else p.oracle), _fmt(r.of_oracle, ".0%"), positions or "-",
                      "yes" if r.identical else "NO")
    return table


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"
