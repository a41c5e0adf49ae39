"""Durability: `specgen run` killed (SIGKILL) or interrupted (SIGINT), then --resume, equals a clean run."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_support import TINY_LLAMA, by_id, read_output, write_jsonl

from specgen.io.outputs import journal_path

NUM_REQUESTS = 80  # ~0.7 s of generation: a kill after at most half of them lands mid-run
RUN_ARGS = ["--model", str(TINY_LLAMA), "--max-tokens", "16", "--batch-size", "4", "--ignore-eos", "--quiet"]
ENV = {**os.environ, "OMP_NUM_THREADS": "2"}


def _default_sigint() -> None:
    # A child of a background job inherits SIGINT ignored; Python only installs its handler when it is not.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def spawn(inp: Path, out: Path, *extra: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "specgen", "run", str(inp), "-o", str(out), *RUN_ARGS, *extra]
    return subprocess.Popen(argv,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV,
                            preexec_fn=_default_sigint)  # noqa: PLW1509 (the test process starts no threads)


def finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[int, str]:
    _, err = proc.communicate(timeout=timeout)
    return proc.returncode, err


def lines_written(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def wait_for_lines(proc: subprocess.Popen, path: Path, target: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while lines_written(path) < target and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    records = [{"id": f"q{i}", "prompt": f"prompt {i}: " + "lorem ipsum " * (i % 6)}
               for i in range(NUM_REQUESTS)]
    return write_jsonl(tmp_path_factory.mktemp("kill") / "in.jsonl", records)


@pytest.fixture(scope="module")
def reference(inputs) -> dict[str, dict]:
    out = inputs.parent / "reference.jsonl"
    rc, err = finish(spawn(inputs, out))
    assert rc == 0, err
    records = by_id(read_output(out))
    assert len(records) == NUM_REQUESTS
    return records


def assert_matches_reference(out: Path, reference: dict[str, dict]) -> None:
    got = by_id(read_output(out))  # fails on any id written twice
    assert sorted(got) == sorted(reference)
    for rid, ref in reference.items():
        assert (got[rid]["text"], got[rid]["token_ids"]) == (ref["text"], ref["token_ids"]), rid
        assert got[rid]["error"] is None


@pytest.mark.parametrize("seed,ext", [(0, "jsonl"), (1, "jsonl"), (2, "parquet")])
def test_sigkill_then_resume(tmp_path, inputs, reference, seed, ext):
    rng = random.Random(seed)
    out = tmp_path / f"out.{ext}"
    watched = out if ext == "jsonl" else journal_path(out)
    proc = spawn(inputs, out)
    wait_for_lines(proc, watched, rng.randint(1, NUM_REQUESTS // 2))
    time.sleep(rng.uniform(0, 0.02))  # land anywhere between two records, not just after one
    proc.kill()
    rc, err = finish(proc)
    assert rc == -signal.SIGKILL, f"the run ended before the kill (rc {rc}); make it longer\n{err}"
    written = lines_written(watched)
    assert 0 < written < NUM_REQUESTS

    rc, err = finish(spawn(inputs, out, "--resume"))
    assert rc == 0, err
    assert_matches_reference(out, reference)
    assert not journal_path(out).exists()


@pytest.mark.parametrize("signum,ext", [(signal.SIGINT, "parquet"), (signal.SIGTERM, "jsonl"),
                                        (signal.SIGTERM, "parquet")])
def test_signal_stops_cleanly_then_resume(tmp_path, inputs, reference, signum, ext):
    """SIGINT / SIGTERM: exit 130 / 143 with one line (records written, the command that resumes), no crash
    dump; the output is complete up to there (Parquet finalized) and --resume completes it."""
    out = tmp_path / f"out.{ext}"
    proc = spawn(inputs, out)
    wait_for_lines(proc, out if ext == "jsonl" else journal_path(out), 10)
    proc.send_signal(signum)
    rc, err = finish(proc)
    assert rc == 128 + signum, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    partial = read_output(out)
    assert 0 < len(partial) < NUM_REQUESTS
    name = signal.Signals(signum).name
    assert lines[0].startswith(f"stopped by {name}: {len(partial)} records are in {out}; "
                               f"resume with: specgen run ")
    assert lines[0].endswith(" --resume")
    assert not journal_path(out).exists()  # finalized: a readable Parquet file

    rc, err = finish(spawn(inputs, out, "--resume"))
    assert rc == 0, err
    assert_matches_reference(out, reference)


def test_second_sigint_exits_at_once_losing_nothing(tmp_path, inputs, reference):
    out = tmp_path / "out.parquet"
    proc = spawn(inputs, out)
    wait_for_lines(proc, journal_path(out), 10)
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGINT)
    rc, err = finish(proc)
    assert rc == 130, err
    assert "Traceback" not in err and "stopped by SIGINT" in err
    assert len(read_output(out)) >= 10  # finalized, or still a journal: every record written is there

    rc, err = finish(spawn(inputs, out, "--resume"))
    assert rc == 0, err
    assert_matches_reference(out, reference)


@pytest.mark.parametrize("delay", [0.05, 0.3, 0.6])
def test_sigterm_while_starting_ends_quietly(tmp_path, inputs, delay):
    """A SIGTERM while Paddle is imported or the model loads: exit 143, no crash dump, the output as it was.
    (On a quiet machine the whole run takes ~1.5 s: the delays stay well inside its start.)"""
    out = tmp_path / "out.jsonl"
    proc = spawn(inputs, out)
    time.sleep(delay)
    proc.send_signal(signal.SIGTERM)
    rc, err = finish(proc)
    assert rc in (143, -signal.SIGTERM), err
    assert "Traceback" not in err and "FatalError" not in err
    assert lines_written(out) < NUM_REQUESTS
