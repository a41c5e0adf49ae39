"""What a nightly job meets: write errors, a full disk, a vanished folder, mismatched resumes, two runs on one
output, non-finite numbers, a KV cache too large for the memory."""
from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from cli_support import TINY_LLAMA, by_id, invoke, read_output, stderr_lines, write_jsonl

import specgen.io.writers
from specgen.errors import EXIT_RECORD_ERRORS
from specgen.io.lock import OutputLock, lock_path
from specgen.io.manifest import PARQUET_KEY, sidecar_path
from specgen.io.outputs import iter_output_records, journal_path
from specgen.layers.sampling import SAMPLER_VERSION

NUM = 24
ARGS = ["--max-tokens", "6", "--batch-size", "4", "--ignore-eos", "-q"]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("robust") / "in.jsonl",
                       [{"id": f"q{i}", "prompt": f"prompt {i} " + "ab " * (i % 4)} for i in range(NUM)])


@pytest.fixture(scope="module")
def reference(inputs) -> dict[str, dict]:
    out = inputs.parent / "reference.jsonl"
    assert invoke("run", inputs, "-o", out, *ARGS).exit_code == 0
    return by_id(read_output(out))


def same_as_reference(out: Path, reference: dict[str, dict]) -> None:
    got = by_id(list(iter_output_records(out)))  # by_id fails on an id written twice
    assert sorted(got) == sorted(reference)
    assert all(got[k]["token_ids"] == reference[k]["token_ids"] for k in reference)


class FaultyFile:
    """The sink's file, failing like a full disk at write number `fail_at` (half the line
    reaches the file)."""

    def __init__(self, real, fail_at: int, hook=None):
        self._real, self._fail_at, self._hook, self.writes = real, fail_at, hook, 0

    def write(self, data) -> int:
        self.writes += 1
        if self._hook is not None:
            self._hook(self.writes)
        if self.writes == self._fail_at:
            self._real.write(bytes(data[: len(data) // 2]))
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self._real.write(data)

    def __getattr__(self, name):
        return getattr(self._real, name)


def faulty_open(monkeypatch, fail_at: int, hook=None) -> None:
    def fake(path, mode="r", buffering=-1, **kw):
        return FaultyFile(open(path, mode, buffering, **kw), fail_at, hook)

    monkeypatch.setattr(specgen.io.writers, "open", fake, raising=False)


@pytest.mark.parametrize("ext", ["jsonl", "parquet"])
def test_disk_full_then_resume(tmp_path, inputs, reference, monkeypatch, ext):
    out = tmp_path / f"out.{ext}"
    faulty_open(monkeypatch, fail_at=6)
    result = invoke("run", inputs, "-o", out, *ARGS)
    assert result.exit_code == 5, result.output
    [line] = stderr_lines(result)
    written = out if ext == "jsonl" else journal_path(out)
    assert line.startswith(f"error: cannot write {written}: No space left on device; "
                           f"5 records are safely in {out}")
    assert line.endswith("resume with: the same command with --resume")  # `specgen run ...` from a shell
    assert len(list(iter_output_records(out))) == 5  # the torn sixth line was trimmed
    monkeypatch.undo()
    assert invoke("run", inputs, "-o", out, *ARGS, "--resume").exit_code == 0
    same_as_reference(out, reference)
    assert not lock_path(out).exists() and not journal_path(out).exists()


def test_disk_full_while_finalizing_parquet(tmp_path, inputs, reference, monkeypatch):
    out = tmp_path / "out.parquet"

    def full(path, tmp):
        tmp.write_bytes(b"partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(specgen.io.writers, "_merge_parquet", full)
    result = invoke("run", inputs, "-o", out, *ARGS)
    assert result.exit_code == 5
    assert f"No space left on device; {NUM} records are safely in {out}" in result.stderr
    assert not out.exists() and not out.with_name(out.name + ".tmp").exists() and journal_path(out).exists()
    monkeypatch.undo()
    assert invoke("run", inputs, "-o", out, *ARGS, "--resume").exit_code == 0  # nothing to run: finalizes
    same_as_reference(out, reference)


def test_output_folder_removed_while_writing(tmp_path, inputs, monkeypatch):
    folder = tmp_path / "gone"
    folder.mkdir()
    out = folder / "out.jsonl"
    faulty_open(monkeypatch, fail_at=0, hook=lambda n: n == 3 and shutil.rmtree(folder))
    result = invoke("run", inputs, "-o", out, *ARGS)
    assert result.exit_code == 5, result.output
    [line] = stderr_lines(result)
    assert f"cannot write {out}: the file was removed or replaced while this run wrote it; 0 records" in line


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir()
    if os.geteuid() != 0 or not shutil.which("mount"):
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def test_small_tmpfs_fills_then_resume_after_space_is_freed(tmp_path, inputs, reference):
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "12k"):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        out = disk / "out.jsonl"
        result = invoke("run", inputs, "-o", out, *ARGS)
        assert result.exit_code == 5, result.output
        assert "No space left on device" in result.stderr
        kept = len(list(iter_output_records(out)))
        assert 0 < kept < NUM and f"{kept} records are safely in {out}" in result.stderr
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        result = invoke("run", inputs, "-o", out, *ARGS, "--resume")
        assert result.exit_code == 5 and "error: cannot" in result.stderr  # read-only: refused before loading
        subprocess.run(["mount", "-o", "remount,rw,size=4m", str(disk)], check=True)
        assert invoke("run", inputs, "-o", out, *ARGS, "--resume").exit_code == 0
        same_as_reference(out, reference)
    finally:
        subprocess.run(["umount", str(disk)], check=False)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes read-only files")
def test_read_only_output_refused_before_loading(tmp_path, inputs):
    out = tmp_path / "out.jsonl"
    assert invoke("run", inputs, "-o", out, *ARGS).exit_code == 0
    out.chmod(0o444)
    result = invoke("run", inputs, "-o", out, *ARGS, "--resume")
    assert result.exit_code == 5 and f"cannot write {out}: permission denied" in result.stderr


# ---- the run manifest ----

@pytest.mark.parametrize("ext", ["jsonl", "parquet"])
def test_resume_with_other_settings_is_refused(tmp_path, inputs, ext):
    out = tmp_path / f"out.{ext}"
    first = [*ARGS[:-1], "--max-tokens", "3"]  # stopped after the first run: the output has all records
    assert invoke("run", inputs, "-o", out, *first).exit_code == 0
    if ext == "parquet":
        assert not sidecar_path(out).exists()
        import pyarrow.parquet as pq

        stored = json.loads(pq.read_schema(out).metadata[PARQUET_KEY])
    else:
        stored = json.loads(sidecar_path(out).read_text())
    assert stored["sampling"]["max_tokens"] == 3 and stored["model"]["sha256"]
    result = invoke("run", inputs, "-o", out, *ARGS, "--method", "ngram", "--resume")
    assert result.exit_code == 2
    assert "sampling.max_tokens: 3 (output) -> 6 (this run)" in result.stderr
    assert 'speculative.method: "none" (output) -> "ngram" (this run)' in result.stderr
    assert "--allow-mismatch" in result.stderr
    result = invoke("run", inputs, "-o", out, *ARGS, "--resume", "--allow-mismatch")
    assert result.exit_code == 0 and "warning: --allow-mismatch: sampling.max_tokens" in result.stderr
    assert "mixed: " in invoke("stats", out).stdout  # the output says it mixes settings
    assert invoke("run", inputs, "-o", out, *first, "--resume").exit_code == 0  # the same settings: fine
    stats = invoke("stats", out)
    assert (stats.exit_code == 0 and "sampling.max_tokens: 3" in stats.stdout
            and "model.sha256" in stats.stdout)


def test_resume_of_an_output_of_an_older_sampler_is_refused(tmp_path, inputs):
    """An output whose manifest predates the sampler's version (and min_p) was sampled by version 1, one that
    records 2 by the inverse CDF: a resume with this sampler (3, the Gumbel-max draw) is refused, unless
    --allow-mismatch; min_p at its default is no difference."""
    for old in (1, 2):
        out = tmp_path / f"out{old}.jsonl"
        assert invoke("run", inputs, "-o", out, *ARGS[:-1], "--max-tokens", "3").exit_code == 0
        stored = json.loads(sidecar_path(out).read_text())
        assert stored["sampling"]["sampler"] == SAMPLER_VERSION == 3 and stored["sampling"]["min_p"] == 0.0
        if old == 1:
            del stored["sampling"]["sampler"], stored["sampling"]["min_p"]
        else:
            stored["sampling"]["sampler"] = 2
        sidecar_path(out).write_text(json.dumps(stored))
        result = invoke("run", inputs, "-o", out, *ARGS[:-1], "--max-tokens", "3", "--resume")
        assert result.exit_code == 2 and f"sampling.sampler: {old} (output) -> 3 (this run)" in result.stderr
        assert "min_p" not in result.stderr
        result = invoke("run", inputs, "-o", out, *ARGS[:-1], "--max-tokens", "3", "--resume",
                        "--allow-mismatch")
        assert result.exit_code == 0


def test_allow_mismatch_needs_resume(tmp_path, inputs):
    result = invoke("run", inputs, "-o", tmp_path / "o.jsonl", "--allow-mismatch")
    assert result.exit_code == 2 and "--allow-mismatch only applies with --resume" in result.stderr


def test_manifest_names_the_model_by_content(tmp_path, inputs):
    copy = tmp_path / "model"
    shutil.copytree(TINY_LLAMA, copy)
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    assert invoke("run", inputs, "-o", a, *ARGS).exit_code == 0
    assert invoke("run", inputs, "-o", b, *ARGS, "--model", copy, model=False).exit_code == 0
    ma, mb = (json.loads(sidecar_path(p).read_text())["model"] for p in (a, b))
    assert ma["sha256"] == mb["sha256"] and ma["path"] != mb["path"]


# ---- one writer per output ----

def test_second_writer_fails_naming_the_holder(tmp_path, inputs):
    out = tmp_path / "out.jsonl"
    with OutputLock(out):
        result = invoke("run", inputs, "-o", out, *ARGS)
    assert result.exit_code == 6
    [line] = stderr_lines(result)
    assert line == (f"error: {out} is being written by process {os.getpid()} (lock {lock_path(out)}); "
                    "wait for it to finish or stop it")
    assert not out.exists()


def test_stale_lock_is_taken_over(tmp_path, inputs):
    out = tmp_path / "out.jsonl"
    dead = subprocess.Popen(["true"])
    dead.wait()
    lock_path(out).write_text(f"{dead.pid}\n")  # left by a killed run: no process holds it
    assert invoke("run", inputs, "-o", out, *ARGS).exit_code == 0
    assert len(read_output(out)) == NUM and not lock_path(out).exists()


# ---- non-finite numbers ----

@pytest.fixture(scope="module")
def poisoned(tmp_path_factory) -> Path:
    """The tiny llama with token 7's embedding row NaN: a request holding token 7 goes non-finite."""
    from safetensors.numpy import load_file, save_file

    path = tmp_path_factory.mktemp("poisoned") / "llama"
    shutil.copytree(TINY_LLAMA, path)
    weights = load_file(path / "model.safetensors")
    weights["model.embed_tokens.weight"][7] = np.nan
    save_file(weights, path / "model.safetensors")
    return path


@pytest.mark.parametrize("backend", ["fused", "reference"])
def test_nan_request_gets_an_error_record_the_others_go_on(tmp_path, poisoned, backend):
    records = [{"id": f"r{i}", "input_ids": [3 + i, 5, 7 if i % 3 == 1 else 9, 11]} for i in range(9)]
    inp = write_jsonl(tmp_path / "in.jsonl", records)
    args = [*ARGS, "--backend", backend, "--batch-size", "8"]
    result = invoke("run", inp, "-o", tmp_path / "out.jsonl", *args, "--model", poisoned, model=False)
    assert result.exit_code == EXIT_RECORD_ERRORS, result.output
    got = by_id(read_output(tmp_path / "out.jsonl"))
    bad = {f"r{i}" for i in range(9) if i % 3 == 1}
    assert {k for k, r in got.items() if r["error"]} == bad
    for k in bad:
        assert got[k]["error"].startswith(f"line {int(k[1:]) + 1}: non-finite values (NaN or Inf) in the "
                                          "model's output at engine step 1, output token 0")
    clean = [r for r in records if r["id"] not in bad]
    write_jsonl(tmp_path / "clean.jsonl", clean)
    assert invoke("run", tmp_path / "clean.jsonl", "-o", tmp_path / "ref.jsonl", *args).exit_code == 0
    ref = by_id(read_output(tmp_path / "ref.jsonl"))
    assert all(got[k]["token_ids"] == ref[k]["token_ids"] and len(ref[k]["token_ids"]) == 6 for k in ref)


# ---- memory ----

def test_kv_cache_over_its_budget_stops_with_advice(tmp_path, inputs):
    out = tmp_path / "out.jsonl"
    result = invoke("run", inputs, "-o", out, *ARGS, "--max-kv-memory", "40KiB")
    assert result.exit_code == 7, result.output
    [line] = stderr_lines(result)
    assert line.startswith("error: request 'q") and "over its budget of 40.0 KiB" in line
    assert "--max-model-len" not in line  # it is in the manifest: a resume with another one would be refused
    # the advice holds: the batch size it names runs the job within the same budget
    batch = line.split("--resume and --batch-size ")[1].split(" ")[0]
    args = [a if a != "4" else batch for a in ARGS]
    assert invoke("run", inputs, "-o", out, *args, "--max-kv-memory", "40KiB", "--resume").exit_code == 0


def test_bad_memory_size_is_a_config_error(tmp_path, inputs):
    result = invoke("run", inputs, "-o", tmp_path / "o.jsonl", "--max-kv-memory", "lots")
    assert result.exit_code == 2 and "max_kv_memory must be a size such as 8GiB" in result.stderr


@pytest.mark.parametrize("backend", ["fused", "reference"])
def test_the_slot_of_a_nan_request_serves_the_next_one_cleanly(tmp_path, poisoned, backend):
    """A request that went non-finite leaves nothing behind in its slot (nor in a drafter's cache): a short
    request placed there afterwards gets the tokens it gets alone."""
    a = {"id": "a", "input_ids": [3 + (i % 9) for i in range(39)] + [7]}
    b = {"id": "b", "input_ids": [8 + (i % 5) for i in range(30)], "max_tokens": 30}
    c = {"id": "c", "input_ids": [4, 5, 6, 8]}
    args = [*ARGS, "--backend", backend, "--batch-size", "2", "--model", poisoned]
    for method in ("none", "ngram"):
        out, alone = tmp_path / f"{method}.jsonl", tmp_path / f"{method}-alone.jsonl"
        result = invoke("run", write_jsonl(tmp_path / "in.jsonl", [a, b, c]), "-o", out, *args,
                        "--method", method, model=False)
        assert result.exit_code == EXIT_RECORD_ERRORS, result.output
        assert invoke("run", write_jsonl(tmp_path / "c.jsonl", [c]), "-o", alone, *args,
                      model=False).exit_code == 0
        got = by_id(read_output(out))
        assert got["a"]["error"] and got["b"]["error"] is None and got["c"]["error"] is None
        assert got["c"]["token_ids"] == read_output(alone)[0]["token_ids"]
