"""SIGTERM and SIGINT during a job: a record is never half written, and what is finished stays written."""
from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from specgen.errors import Stopped


class Interrupts:
    """SIGTERM and SIGINT during a run: the first raises Stopped where the run is (admitting, in a forward),
    or right after the record being written, so a record is never half written; what is finished stays
    written. A second one (a Parquet output being finalized) raises again at once: the journal stays for
    --resume."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.count = 0  # signals received
        self._holding = False
        self._abort_at = 0  # while holding: the signal count that aborts the block anyway (0: none does)
        self._pending = False

    def _handle(self, signum: int, frame: Any) -> None:
        self.signum = self.signum or signum
        self.count += 1
        if self._holding and not (self._abort_at and self.count >= self._abort_at):
            self._pending = True
            return
        raise Stopped(self.signum)

    @contextmanager
    def installed(self) -> Iterator["Interrupts"]:
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {s: signal.signal(s, self._handle) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield self
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    @contextmanager
    def held(self, abortable: bool = False) -> Iterator[None]:
        """Signals wait until the block is done; `abortable`: a second signal (counting one that came before
        the block) aborts it."""
        self._holding = True
        self._abort_at = self.count + 1 if abortable and self.count else (2 if abortable else 0)
        try:
            yield
        finally:
            self._holding = False
            self._abort_at = 0
            if self._pending:
                self._pending = False
                raise Stopped(self.signum)
