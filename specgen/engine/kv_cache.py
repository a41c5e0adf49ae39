"""The preallocated per-slot KV cache, grown by doubling when a slot needs more positions."""
from __future__ import annotations

import paddle


class KVCache:
    """Per layer, K and V of shape [num_slots, capacity, num_kv_heads, head_dim].

    A slot's valid positions are [0, its length); entries past it are stale (rejected drafts) and are
    overwritten by later writes, so rejection needs no copy. Stored flattened as
    [num_slots * capacity, num_kv_heads * head_dim] so that a token's row is slot * capacity + position.
    """

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int, dtype: str,
                 max_capacity: int, initial_capacity: int = 256):
        self.num_layers = num_layers
        self.num_slots = num_slots
        self.row_width = num_kv_heads * head_dim
        self.dtype = dtype
        self.max_capacity = max_capacity
        self.capacity = 0
        self.k: list[paddle.Tensor] = []  # per layer [num_slots * capacity, num_kv_heads * head_dim]
        self.v: list[paddle.Tensor] = []
        self.ensure(min(initial_capacity, max_capacity))

    def ensure(self, needed: int) -> None:
        """Make room for positions [0, needed); doubles, keeps existing contents."""
        if needed <= self.capacity:
            return
        new_cap = max(needed, min(self.max_capacity, max(2 * self.capacity, 64)))
        for store in (self.k, self.v):
            for layer in range(self.num_layers):
                fresh = paddle.zeros([self.num_slots, new_cap, self.row_width], dtype=self.dtype)
                if store and self.capacity:
                    old = store[layer].reshape([self.num_slots, self.capacity, self.row_width])
                    fresh[:, : self.capacity] = old
                fresh = fresh.reshape([self.num_slots * new_cap, self.row_width])
                if len(store) > layer:
                    store[layer] = fresh
                else:
                    store.append(fresh)
        self.capacity = new_cap

    def nbytes(self) -> int:
        itemsize = 8 if self.dtype == "float64" else 4
        return 2 * self.num_layers * self.num_slots * self.capacity * self.row_width * itemsize
