import numpy as np
import pytest

from specgen.runtime import kv_cache
from specgen.runtime.kv_cache import KVCache


@pytest.mark.parametrize("dtype", ["float32", "float16", "float64"])
@pytest.mark.parametrize("zeroed", [True, False])
def test_growth_keeps_every_row_and_lets_the_kernels_binding_go_first(dtype, zeroed):
    """ensure() grows the capacity and keeps each (slot, head) row's positions that forwards reserved (the
    rest were never written, and are not copied); the kernels' handle of the old tensors is released before
    the first layer is replaced (so growing holds one old layer at a time)."""
    slots, heads, dim, layers = 3, 2, 8, 2
    cache = KVCache(layers, slots, heads, dim, dtype, max_capacity=1024, initial_capacity=64, zeroed=zeroed)
    rng = np.random.default_rng(0)
    before = []
    for t in cache.k + cache.v:
        x = rng.standard_normal(t.shape).astype(dtype)
        t.set_value(x)
        before.append(x.reshape(slots * heads, 64, dim))
    cache.reserve(45, 40)  # forwards wrote own positions [0, 40)
    old = list(cache.k)
    released = []
    cache.binding = ("key", 7, lambda: released.append(len([a for a, b in zip(cache.k, old) if a is b])))
    cache.ensure(150)  # 64 -> 150 (more than double)
    assert released == [layers] and cache.binding is None  # released while every old layer was still in place
    assert cache.capacity == 150 and cache.version == 2
    for t, x in zip(cache.k + cache.v, before):
        assert t.shape == [slots * heads * 150, dim] and str(t.dtype).endswith(dtype)
        y = t.numpy().reshape(slots * heads, 150, dim)
        assert np.array_equal(y[:, :40], x[:, :40])
        if zeroed:
            assert not y[:, 40:].any()
    cache.ensure(100)  # already room: nothing replaced
    assert cache.version == 2


@pytest.mark.parametrize("zeroed", [True, False])
def test_admission_takes_the_whole_request_room_only_when_uninitialized_and_it_fits(zeroed, monkeypatch):
    """admit(prompt, whole): uninitialized storage grows to the whole request's positions at once (its pages
    cost nothing until written), and keeps the positions written so far; when the whole room would not fit in
    physical memory it takes the prompt's only; zero-filled storage is left to grow on demand."""
    cache = KVCache(2, 4, 2, 8, "float32", max_capacity=1000, initial_capacity=64, zeroed=zeroed)
    x = np.random.default_rng(1).standard_normal([4 * 2, 64, 8]).astype("float32")
    cache.k[0].set_value(x.reshape(-1, 8))
    cache.reserve(30)
    cache.admit(50, 300)  # both fit in 64 positions / 300 does not
    assert cache.capacity == (64 if zeroed else 300)
    assert np.array_equal(cache.k[0].numpy().reshape(8, -1, 8)[:, :30], x[:, :30])
    cache.admit(20, 5000)  # capped at the model's context
    assert cache.capacity == (64 if zeroed else 1000)
    small = KVCache(2, 4, 2, 8, "float32", max_capacity=1000, initial_capacity=64, zeroed=zeroed)
    monkeypatch.setattr(kv_cache, "_physical_memory", lambda: small.nbytes(299))
    small.admit(100, 300)  # the whole room would not fit: the prompt's only
    assert small.capacity == (64 if zeroed else 128)
    small.admit(100, 299)
    assert small.capacity == (64 if zeroed else 299)
