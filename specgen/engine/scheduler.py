"""Static slots: which requests enter which free slot, and when (pure Python, no tensors)."""
from __future__ import annotations

from collections import deque
from typing import Callable, Iterable, Iterator

from specgen.engine.types import Request


class Scheduler:
    """Pulls requests lazily from an iterator (bounded memory) and hands them to free slots in input order."""

    def __init__(self, requests: Iterable[Request], num_slots: int, max_prefill_tokens: int,
                 prefill_chunk: int = 0, ready: Callable[[], bool] | None = None,
                 cost: Callable[[Request], int | None] | None = None,
                 hold: Callable[[Request, list[Request]], bool] | None = None):
        """ready: whether the source yields its next item without waiting (a queue fed by another process);
        with it, free slots take only what is there while slots are running, and wait for more only when
        none is.
        cost: an item's prompt tokens to prefill (default, or where it gives None: its prompt's, or a chunk
        of it).
        hold: whether the next item waits (and those after it) though a slot is free, given the items this
        admission took already: a sample waiting for its first sample's prefill, to copy it."""
        self._source: Iterator[Request] = iter(requests)
        self.ready, self.cost, self.hold = ready, cost, hold
        self._pending: deque[Request] = deque()
        self._exhausted = False
        self.free = deque(range(num_slots))
        self.num_slots = num_slots
        self.max_prefill_tokens = max_prefill_tokens
        self.prefill_chunk = prefill_chunk  # with chunked prefill a prompt costs at most one chunk per step

    def _peek(self, wait: bool = True) -> Request | None:
        if not self._pending and not self._exhausted and (wait or self.ready is None or self.ready()):
            try:
                self._pending.append(next(self._source))
            except StopIteration:
                self._exhausted = True
        return self._pending[0] if self._pending else None

    def peek(self, n: int) -> list[Request]:
        """Up to n upcoming requests, without admitting them (to find a prefix they share)."""
        while len(self._pending) < n and not self._exhausted:
            try:
                self._pending.append(next(self._source))
            except StopIteration:
                self._exhausted = True
        return list(self._pending)[:n]

    def has_work(self, num_active: int) -> bool:
        return num_active > 0 or self._peek() is not None

    def admit(self) -> list[tuple[int, Request]]:
        """Fill free slots while the step's prompt-token budget lasts (at least one request per step)."""
        admitted: list[tuple[int, Request]] = []
        budget = self.max_prefill_tokens
        while self.free:
            req = self._peek(wait=len(self.free) == self.num_slots and not admitted)
            if req is None or (self.hold is not None and self.hold(req, [r for _, r in admitted])):
                break
            cost = self.cost(req) if self.cost is not None else None
            if cost is None:
                cost = (min(len(req.prompt_ids), self.prefill_chunk) if self.prefill_chunk
                        else len(req.prompt_ids))
            if admitted and cost > budget:
                break
            self._pending.popleft()
            budget -= cost
            admitted.append((self.free.popleft(), req))
        return admitted

    def retire(self, slot: int) -> None:
        self.free.append(slot)
