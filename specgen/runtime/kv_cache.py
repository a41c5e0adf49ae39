"""The preallocated per-slot KV cache, grown by doubling when a slot needs more positions."""
from __future__ import annotations

import functools
import os

import numpy as np
import paddle

INITIAL_CAPACITY = 256  # positions per slot allocated up front (then doubled as slots need more)


class KVCache:
    """Per layer, K and V of shape [num_slots, num_kv_heads, capacity, head_dim], in the model's dtype or, for
    a float32 model on the fused kernels, float16 (the attention kernel widens each key and value as it reads
    it).

    A slot's valid positions are [0, its length); entries past it are stale (rejected drafts) and are
    overwritten by later writes, so rejection needs no copy. With `zeroed` False the storage starts (and
    grows) uninitialized: for the fused attention kernel, which reads a query's keys [0, its position] only,
    all of them written before they are read (the Paddle reference path masks whole rows, so it needs finite
    zeros there). That skips filling the whole allocation (the default model's 256 positions: 0.15 s for 32
    slots, 1.5 s for 256), and the pages of slots and positions a job never fills are never touched.
    Stored flattened as
    [num_slots * num_kv_heads * capacity, head_dim]: the row of (slot, head, position) is
    (slot * num_kv_heads + head) * capacity + position, so one gather yields a contiguous
    [num_seqs, num_kv_heads, max_kv, head_dim] block for attention (Paddle's CPU transposes are slow).
    """

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int, dtype: str,
                 max_capacity: int, initial_capacity: int | None = None, zeroed: bool = True):
        self.num_layers = num_layers
        self.num_slots = num_slots
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.dtype = dtype
        self.zeroed = zeroed
        self.max_capacity = max_capacity
        self.capacity = 0
        first = INITIAL_CAPACITY if initial_capacity is None else initial_capacity
        self.initial_capacity = min(first, max_capacity)
        self.k: list[paddle.Tensor] = []  # per layer [num_slots * num_kv_heads * capacity, head_dim]
        self.v: list[paddle.Tensor] = []
        # Shared prefix (cascade attention): one 1-slot cache holding positions [0, prefix_tokens) for every
        # slot; a slot with prefix length p stores its own position j at row j - p.
        self.prefix: "KVCache | None" = None
        self.peak_position = 0  # largest absolute position + 1 any slot reached (memory report)
        self.peak_own = 0  # largest row + 1 any slot stored in its own rows
        # counts replacements of the k / v tensors (ensure), for whoever holds them by handle
        self.version = 0
        # (what was bound, handle, its release): the fused backend's handle of these tensors
        self.binding = None
        self._views: tuple[int, list[np.ndarray]] | None = None  # (version, host views): move_rows
        self.ensure(self.initial_capacity)

    def ensure(self, needed: int) -> None:
        """Make room for positions [0, needed); at least doubles, and keeps the positions forwards reserved so
        far ([0, peak_own) of each row: nothing else was written)."""
        if needed <= self.capacity:
            return
        new_cap = max(needed, min(self.max_capacity, max(2 * self.capacity, 64)))
        self._views = None  # (numpy views keep the old tensors alive too)
        self.unbind()  # the kernels' handle keeps the old tensors alive: let each layer's go as it is
        # replaced, so growing holds one old layer at a time, not the whole cache
        for store in (self.k, self.v):
            for layer in range(self.num_layers):
                rows = self.num_slots * self.num_kv_heads
                alloc = paddle.zeros if self.zeroed else paddle.empty
                fresh = alloc([rows, new_cap, self.head_dim], dtype=self.dtype)
                # positions no forward reserved were never written
                if store and self.capacity and self.peak_own:
                    _copy_into(fresh, store[layer].reshape([rows, self.capacity, self.head_dim]),
                               self.peak_own)
                fresh = fresh.reshape([rows * new_cap, self.head_dim])
                if len(store) > layer:
                    store[layer] = fresh
                else:
                    store.append(fresh)
        self.capacity = new_cap
        self.version += 1

    def admit(self, prompt: int, whole: int) -> None:
        """Room for a slot being placed on uninitialized storage: positions [0, whole) for its whole request
        (prompt + max_tokens + a draft) where that fits in physical memory, else [0, prompt) for its prompt.

        Uninitialized pages cost nothing until a forward writes them, so taking the whole request's room up
        front means a job whose requests fit never grows (a growth copies every slot's written positions:
        ~5 s for 256 slots at 512 -> 1,024 positions). Zero-filled storage pays for every page it allocates,
        so it grows on demand (in forwards' reserve); so does a request too large for this machine's memory,
        and every request where the kernel commits virtual memory strictly (vm.overcommit_memory = 2)."""
        if self.zeroed:
            return
        whole = min(whole, self.max_capacity)
        ahead = self.nbytes(whole) <= _physical_memory() and not _strict_overcommit()
        self.ensure(whole if ahead else min(prompt, self.max_capacity))

    def clear_slot(self, slot: int) -> None:
        """Zero every row of `slot` in a zero-filled cache (a request that went non-finite left NaN there,
        which the reference attention's masked reads would carry into the slot's next request); storage that
        starts uninitialized is never read past what was written, so it needs nothing."""
        if not self.zeroed or self.capacity == 0:
            return
        rows = self.num_kv_heads * self.capacity
        for store in (self.k, self.v):
            for t in store:
                t[slot * rows: (slot + 1) * rows] = 0

    def move_rows(self, slots: np.ndarray, src: np.ndarray, dst: np.ndarray) -> None:
        """Own row dst[i] of slot slots[i] takes the K and V of its row src[i], in every layer and KV head (a
        token tree's accepted path into the positions it now holds; all [m] int64). Every source is read
        before any destination is written, so the moves may overlap in any order. What is moved from stays
        behind past the slot's length: stale, as any rejected draft."""
        KV, cap = self.num_kv_heads, self.capacity
        base = (slots[:, None] * KV + np.arange(KV)[None, :]) * cap  # [m, KV]
        s, d = (base + src[:, None]).reshape(-1), (base + dst[:, None]).reshape(-1)  # [m * KV]
        if self.k[0].place.is_cpu_place():
            for rows in self._host_views():
                rows[d] = rows[s]
            return
        si, di = paddle.to_tensor(s), paddle.to_tensor(d)
        for t in self.k + self.v:
            paddle.scatter_(t, di, paddle.gather(t, si), overwrite=True)

    def export_slot(self, slot: int, n: int, prefix_len: int = 0) -> list[list[np.ndarray]]:
        """K and V of `slot`'s positions [0, n), for a hand-off to another engine's cache (import_slot): per
        tensor (every layer's K, then every layer's V) the pieces [num_kv_heads, m, head_dim] that make them,
        in order: the shared prefix's first `prefix_len` positions (cascade attention reads them from there),
        then the slot's own rows. On the CPU, views of the storage: copy them before the cache changes."""
        own = self._slot_rows(slot, n - prefix_len)
        if not prefix_len:
            return [[x] for x in own]
        return [[p, x] for p, x in zip(self.prefix._slot_rows(0, prefix_len), own)]

    def copy_slot(self, src: int, dst: int, n: int, prefix_len: int = 0) -> None:
        """`dst`'s own rows [0, n) take the K and V of `src`'s positions [0, n) (its first `prefix_len` read
        from the shared prefix): the samples of one prompt share its prefill. `dst` reads no shared prefix
        afterwards."""
        self.import_slot(dst, self.export_slot(src, n, prefix_len))

    def _slot_rows(self, slot: int, n: int) -> list[np.ndarray]:
        """[num_kv_heads, n, head_dim] rows [0, n) of `slot`, per tensor (K layers, then V layers)."""
        KV, cap, D = self.num_kv_heads, self.capacity, self.head_dim
        if self.k[0].place.is_cpu_place():
            return [v.reshape(self.num_slots, KV, cap, D)[slot, :, :n] for v in self._host_views()]
        rows = paddle.to_tensor(((slot * KV + np.arange(KV))[:, None] * cap
                                 + np.arange(n)[None, :]).reshape(-1))
        return [paddle.gather(t, rows).numpy().reshape(KV, n, D) for t in self.k + self.v]

    def import_slot(self, slot: int, tensors: list[np.ndarray]) -> None:
        """`slot`'s own rows [0, n) take export_slot's K and V ([num_kv_heads, n, head_dim] per tensor, in its
        order; a list of pieces is joined); the slot reads no shared prefix afterwards."""
        tensors = [np.concatenate(x, axis=1) if isinstance(x, (list, tuple)) else x for x in tensors]
        n = tensors[0].shape[1]
        self.reserve(n)
        KV, cap, D = self.num_kv_heads, self.capacity, self.head_dim
        if self.k[0].place.is_cpu_place():
            for view, x in zip(self._host_views(), tensors):
                view.reshape(self.num_slots, KV, cap, D)[slot, :, :n] = x
            return
        rows = paddle.to_tensor(((slot * KV + np.arange(KV))[:, None] * cap
                                 + np.arange(n)[None, :]).reshape(-1))
        for t, x in zip(self.k + self.v, tensors):
            paddle.scatter_(t, rows, paddle.to_tensor(np.ascontiguousarray(x).reshape(KV * n, D)),
                            overwrite=True)

    def _host_views(self) -> list[np.ndarray]:
        """numpy views of every layer's K and V on the CPU (the same storage the kernels hold by handle), made
        once per set of tensors (a view costs ~13 us: 60 of them were most of a move's 0.8 ms)."""
        if self._views is None or self._views[0] != self.version:
            self._views = (self.version, [np.from_dlpack(t) for t in self.k + self.v])
        return self._views[1]

    def unbind(self) -> None:
        """Drop the kernels' handle of these tensors (Model binds them again at its next forward)."""
        if self.binding is not None:
            self.binding[2]()
            self.binding = None

    def reserve(self, max_position: int, own_max: int | None = None) -> None:
        """Room for a forward writing positions up to max_position - 1 (own rows up to own_max - 1 when a
        shared prefix holds the first ones), and the peaks the memory report reads."""
        own_max = max_position if own_max is None else own_max
        self.ensure(own_max)
        self.peak_position = max(self.peak_position, max_position)
        self.peak_own = max(self.peak_own, own_max)

    def bytes_per_position(self) -> int:
        """K and V bytes of one slot's position, over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * {"float64": 8, "float32": 4,
                                                                            "float16": 2}[self.dtype]

    def nbytes(self, capacity: int | None = None) -> int:
        """Bytes of K and V over all layers (with the shared prefix's), or for another per-slot capacity."""
        itemsize = {"float64": 8, "float32": 4, "float16": 2}[self.dtype]
        width = self.num_kv_heads * self.head_dim
        own = 2 * self.num_layers * self.num_slots * (capacity or self.capacity) * width * itemsize
        return own + (self.prefix.nbytes() if self.prefix is not None and capacity is None else 0)


@functools.cache
def _physical_memory() -> int:
    """Bytes of RAM on this machine (no limit where the platform does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 62


def available_memory() -> int:
    """Bytes this process may still take: Linux's MemAvailable, capped by a cgroup v2 memory limit; the
    physical memory where neither is known."""
    avail = _physical_memory()
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read().strip())
        if limit != "max":
            avail = min(avail, int(limit) - used)
    except (OSError, ValueError):
        pass
    return max(avail, 0)


@functools.cache
def _strict_overcommit() -> bool:
    """Whether Linux charges every allocated byte against a commit limit (untouched pages are not free)."""
    try:
        with open("/proc/sys/vm/overcommit_memory") as f:
            return f.read().strip() == "2"
    except OSError:
        return False


def _copy_into(dst: paddle.Tensor, src: paddle.Tensor, used: int) -> None:
    """dst[:, :u] = src[:, :u] for dst [rows, C, D], src [rows, c, D], u = min(used, c): the positions written
    so far, so the pages past them stay untouched in both. On the CPU through numpy views (one memcpy per
    row)."""
    u = min(used, src.shape[1])
    if dst.place.is_cpu_place() and src.place.is_cpu_place():
        np.from_dlpack(dst)[:, :u] = np.from_dlpack(src)[:, :u]
    else:
        dst[:, :u] = src[:, :u]
