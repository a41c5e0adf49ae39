"""The run manifest: the settings that decide an output's records, stored with the output.

A JSONL output keeps it in a sidecar `OUT.manifest.json`; a Parquet output in the file's key-value metadata
(`specgen.manifest`), and in the sidecar while the output is still a journal. `--resume` compares the stored
manifest with the new run's and refuses on a difference (app/job.py).
"""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from specgen.errors import InputError, OutputError
from specgen.io.outputs import output_format
from specgen.models.checkpoint import checkpoint_files, file_stamps

PARQUET_KEY = b"specgen.manifest"
HASH_CHUNK = 1 << 20


def sidecar_path(output: Path) -> Path:
    return output.with_name(output.name + ".manifest.json")


def read_manifest(output: Path) -> dict[str, Any] | None:
    """The manifest stored with `output` (sidecar first, then Parquet metadata); None for an output without
    one."""
    side = sidecar_path(output)
    if side.exists():
        try:
            data = json.loads(side.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise InputError(f"{side}: not a readable manifest ({exc})") from None
        if not isinstance(data, dict):
            raise InputError(f"{side}: not a manifest (expected a JSON object)")
        return data
    if output_format(output) == "parquet" and output.exists():
        return parquet_manifest(output)
    return None


def parquet_manifest(path: Path) -> dict[str, Any] | None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        meta = pq.read_schema(path).metadata or {}
    except (pa.ArrowException, OSError) as exc:
        raise InputError(f"{path}: not a readable Parquet output ({exc})") from None
    raw = meta.get(PARQUET_KEY)
    return json.loads(raw) if raw else None


def write_sidecar(output: Path, manifest: Mapping[str, Any]) -> None:
    """Atomically (temporary file, fsync, rename)."""
    side = sidecar_path(output)
    tmp = side.with_name(side.name + ".tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, side)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise OutputError(f"cannot write {side}: {exc.strerror or exc}") from None


# Shown, not compared: the model is the same by its content's hash wherever it lies; the version, and the
# record of settings an --allow-mismatch resume mixed in, say how the output came to be.
NOT_COMPARED = ("specgen_version", "model.path", "mixed")
# What a key missing from a stored manifest stood for when it was written: its setting did not exist yet, and
# outputs then were made as with this value. (sampling.sampler: the sampler's version, layers/sampling.py; the
# first had none.)
ABSENT_MEANS = {"sampling.min_p": 0.0, "sampling.sampler": 1, "sampling.logprobs": False,
                "sampling.top_logprobs": 0, "sampling.repetition_penalty": 1.0,
                "sampling.presence_penalty": 0.0, "sampling.frequency_penalty": 0.0,
                "sampling.logit_bias": [], "sampling.min_tokens": 0, "sampling.n": 1,
                "sampling.stop_token_ids": [], "sampling.response_format": "",
                "output_format": "auto", "speculative.draft.prompt_window": 256,
                "sampling.logprobs_mode": "raw", "sampling.prompt_logprobs": None}


def differences(stored: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """One line per setting that differs: `key: stored (output) -> current (this run)`."""
    b = _flatten(current)
    # a setting added since the output was written: its absence there means its old (default) behaviour
    a = {**{k: v for k, v in ABSENT_MEANS.items() if k in b}, **_flatten(stored)}
    out = []
    for key in sorted(set(a) | set(b)):
        if key in NOT_COMPARED or a.get(key) == b.get(key):
            continue
        out.append(f"{key}: {_show(a.get(key))} (output) -> {_show(b.get(key))} (this run)")
    return out


def describe(manifest: Mapping[str, Any]) -> list[str]:
    """`key: value` lines, for `specgen stats`."""
    return [f"{k}: {_show(v)}" for k, v in sorted(_flatten(manifest).items())]


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, Mapping):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _show(value: Any) -> str:
    return "(absent)" if value is None else json.dumps(value)


def content_hash(path: str | Path, cache_root: Path) -> str:
    """sha256 over a checkpoint's files (a file, or a directory's weight / config / tokenizer files, by name),
    remembered in `cache_root` by path, size and modification time so that a rerun reads nothing."""
    files = checkpoint_files(path)
    stamp = json.dumps(file_stamps(files))
    key = hashlib.sha256(stamp.encode()).hexdigest()[:24]
    memo = cache_root / "hashes" / f"{key}.txt"
    try:
        return memo.read_text(encoding="ascii").strip()
    except OSError:
        pass
    h = hashlib.sha256()
    for p in files:
        h.update(p.name.encode() + b"\0")
        with open(p, "rb") as f:
            while chunk := f.read(HASH_CHUNK):
                h.update(chunk)
    digest = h.hexdigest()
    try:
        memo.parent.mkdir(parents=True, exist_ok=True)
        memo.write_text(digest + "\n", encoding="ascii")
    except OSError:
        pass  # a read-only cache: hash again next time
    return digest
