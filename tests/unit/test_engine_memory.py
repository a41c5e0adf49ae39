"""KV-memory admission (engine/memory.py) on a real cache: the budget, the high-water marks, the advice."""
import numpy as np
import pytest

from specgen.config import EngineConfig
from specgen.engine.memory import ROOM, KvMemory, gib
from specgen.errors import MemoryBudgetError
from specgen.runtime.kv_cache import KVCache


def memory(budget: str, zeroed: bool = False, slots: int = 4) -> KvMemory:
    cache = KVCache(2, slots, 2, 8, "float32", 1024, initial_capacity=64, zeroed=zeroed)
    return KvMemory(cache, EngineConfig(max_kv_memory=budget), context_len=1024)


def test_need_counts_the_pages_each_request_writes():
    m = memory("1MiB")
    per_position = m.cache.bytes_per_position()
    assert m.need(np.array([100, 10])) == per_position * (100 + ROOM + 10 + ROOM)
    assert m.need(np.array([5000])) == per_position * 1024  # capped by the cache's capacity


def test_admit_raises_the_mark_and_refuses_past_the_budget_with_a_batch_size_that_fits():
    m = memory("64KiB")
    per_position = m.cache.bytes_per_position()
    end = (64 << 10) // per_position // 2 - ROOM  # two such requests fit exactly
    m.admit(0, "a", 10, end)
    m.admit(1, "b", 10, end)
    assert m.high.tolist() == [end, end, 0, 0]
    with pytest.raises(MemoryBudgetError) as err:
        m.admit(2, "c", 10, 8)
    message = str(err.value)
    assert "request 'c' runs to position 8" in message and "over its budget of 64.0 KiB" in message
    assert f"--batch-size {m.fitting_batch()} " in message
    assert m.high[2] == 0  # a refused request leaves no mark
    m.admit(0, "d", 10, end)  # a slot's next request within its old mark fits again
    assert m.fitting_batch() == 1  # not one slot at the full context fits: the smallest batch
    assert memory("4MiB").fitting_batch() == 16  # 4 MiB over 256 KiB a slot at 1,024 positions


def test_warning_names_what_fits_only_when_the_full_batch_would_not():
    assert memory("1GiB").warning(4) is None
    note = memory("64KiB").warning(4)
    assert note is not None and "over its budget of 64.0 KiB" in note and "--batch-size" in note
    assert gib(3 << 30) == "3.0 GiB" and gib(1536) == "1.5 KiB" and gib(12) == "12 B"
