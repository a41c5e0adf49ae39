"""What one forward reads and writes, below the layers and backends that run it: the packed batch
(batch.py) and the KV cache (kv_cache.py)."""
