"""What growing the KV cache costs: time and peak resident memory while a full cache doubles.

    python benchmarks/kv_growth.py [--slots 64] [--positions 1024]
    PYTHONPATH=/tmp/old python benchmarks/kv_growth.py      # the same with another checkout's specgen

The default model's cache (float32, uninitialized as on the fused kernels) for --slots slots at --positions
positions, every position written and reserved as forwards would, bound to the kernels as a forward binds it;
then the cache grows to twice the positions and is bound again (what the next forward does). Resident memory is
sampled every 5 ms from /proc/self/status.
"""
from __future__ import annotations

import argparse
import os
import threading
import time


def rss_mib() -> int:
    with open("/proc/self/status") as f:
        return int(f.read().split("VmRSS:")[1].split()[0]) // 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--positions", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    from specgen import load_model
    from specgen.engine.kv_cache import KVCache

    model = load_model(None, threads=args.threads).model
    if model.ops is None:
        raise SystemExit("needs the fused kernels (the cache they bind by handle)")
    cfg, cap = model.config, args.positions
    cache = KVCache(cfg.num_layers, args.slots, cfg.num_kv_heads, cfg.head_dim, "float32", 8 * cap,
                    initial_capacity=cap, zeroed=False)
    for t in cache.k + cache.v:
        t.fill_(1.0)  # every page written, as by a job whose slots filled their rows
    cache.reserve(cap)
    model._caches_handle(cache)
    before, peak, done = rss_mib(), [0], threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss_mib())
            time.sleep(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    start = time.perf_counter()
    cache.ensure(2 * cap)
    model._caches_handle(cache)
    took = time.perf_counter() - start
    done.set()
    watcher.join()
    print(f"{args.slots} slots, {cap} -> {2 * cap} positions ({cache.nbytes(cap) / 2**30:.2f} GiB written): "
          f"growth {took:.2f} s; resident memory {before} MiB before, {peak[0]} MiB at the peak, {rss_mib()} MiB after")


if __name__ == "__main__":
    main()
