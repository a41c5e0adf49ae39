"""KV-memory admission: a request is placed only if the KV cache then fits its budget (90% of the memory
available at start, or --max-kv-memory); otherwise the run stops (MemoryBudgetError, exit 7) naming a batch
size that fits.
One owner for the colocated engine and the decode worker of --pd alike."""
from __future__ import annotations

import numpy as np

from specgen.config import EngineConfig
from specgen.engine.slots import MAX_DRAFT
from specgen.errors import MemoryBudgetError
from specgen.runtime.kv_cache import KVCache, available_memory

ROOM = MAX_DRAFT + 1  # positions past a request's end that a verify block may write


def kv_budget(cache: KVCache, config: EngineConfig) -> int:
    """Bytes the KV cache may take: 90% of the memory available now (plus what a zero-filled cache already
    holds), capped by max_kv_memory."""
    avail = int(0.9 * available_memory()) + (cache.nbytes() if cache.zeroed else 0)
    limit = config.kv_memory_limit()
    return avail if limit is None else min(avail, limit)


def gib(n: int) -> str:
    """Bytes for a message: GiB, or MiB / KiB below one."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


class KvMemory:
    """The KV budget of one engine's cache and what its slots hold. A slot's pages stay resident up to the
    longest request it held (and, once the cache grew, up to the rows the growth copied for every slot)."""

    def __init__(self, cache: KVCache, config: EngineConfig, context_len: int):
        self.cache, self.context_len = cache, context_len
        self.budget = kv_budget(cache, config)  # bytes the KV cache may take
        self.high = np.zeros(cache.num_slots, np.int64)  # [num_slots] the longest request each slot held

    def need(self, ends: np.ndarray) -> int:
        """KV bytes for requests whose last positions + 1 are `ends`, each running to its end: the pages a
        slot writes (storage starts uninitialized), or the whole zero-filled capacity they make the cache
        grow to."""
        c = self.cache
        if c.zeroed:
            return c.nbytes(max(c.capacity, min(int(ends.max(initial=0)) + ROOM, c.max_capacity)))
        return c.bytes_per_position() * int((np.minimum(ends + ROOM, c.max_capacity)).sum())

    def fitting_batch(self) -> int:
        """The batch size whose KV cache fits the budget at the full context."""
        per_slot = (self.need(np.array([self.context_len]))
                    // (self.cache.num_slots if self.cache.zeroed else 1))
        return int(min(max(1, self.budget // max(per_slot, 1)), 256))

    def advice(self) -> str:
        """What fits the KV budget: the batch size at the full context, the context at this batch size."""
        positions = self.budget // (self.cache.bytes_per_position() * self.cache.num_slots) - ROOM
        return f"--batch-size {self.fitting_batch()} or --max-model-len {max(positions, 1)} guarantees it"

    def admit(self, slot: int, request_id: str, prompt_len: int, end: int) -> None:
        """Place a request of `prompt_len` tokens running to position `end` (its last + 1) in `slot`: raises
        MemoryBudgetError when the slots' high-water marks, this slot's raised, would not fit the budget; else
        raises the mark and lets the cache grow to hold it."""
        c = self.cache
        ends = np.maximum(self.high, c.peak_own if c.capacity > c.initial_capacity else 0)  # [num_slots]
        ends[slot] = max(ends[slot], end)
        need = self.need(ends[ends > 0])
        if need > self.budget:
            raise MemoryBudgetError(
                f"request {request_id!r} runs to position {end}: with what the {int((ends > 0).sum())} slots "
                f"in use hold, the KV cache would need {gib(need)}, over its budget of {gib(self.budget)}; "
                f"rerun with --resume and --batch-size {self.fitting_batch()} (it fits the full context) or "
                "a larger --max-kv-memory")
        self.high[slot] = max(self.high[slot], end)
        c.admit(prompt_len + ROOM, end + ROOM)

    def warning(self, batch_size: int) -> str | None:
        """A note for a job whose every slot at the full context would not fit the budget (None: it would)."""
        full = self.need(np.full(batch_size, self.context_len))
        if full <= self.budget:
            return None
        return (f"the KV cache at {batch_size} slots x {self.context_len} positions would need {gib(full)}, "
                f"over its budget of {gib(self.budget)}; a request that would take it past the budget stops "
                f"the run (exit 7; {self.advice()})")
