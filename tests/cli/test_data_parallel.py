"""--data-parallel-size: N worker engines behind one reader and one writer give the one-engine run's records
(every method, greedy and sampled), each id once; a killed worker fails the job (exit 4) and --resume
completes it; a SIGTERM to the parent stops it and its workers cleanly."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from cli_support import TINY_LLAMA, by_id, invoke, read_output, write_jsonl
from conftest import TINY
from heads import random_eagle, random_eagle3, random_hydra, random_medusa

from specgen.distributed.launch import thread_shares
from specgen.drafters.eagle import save_eagle
from specgen.drafters.eagle3 import save_eagle3
from specgen.drafters.hydra import save_hydra
from specgen.drafters.medusa import save_medusa
from specgen.drafters.mtp import random_mtp_weights, save_mtp
from specgen.models import load_checkpoint
from specgen.models.export import first_layers, save_hf

ENV = {**os.environ, "OMP_NUM_THREADS": "2"}
# Half the records sample (their own temperature), half are greedy; line 4 is not JSON, line 9 has a bad
# field.
RECORDS = [{"id": f"r{i}", "prompt": f"request {i}: " + "abc " * (i % 5), "max_tokens": 6 + i % 7,
            **({"temperature": 0.9} if i % 2 else {})} for i in range(22)]
RECORDS.insert(3, '{"id": "broken", ')
RECORDS.insert(8, {"id": "bad", "prompt": "x", "colour": "red"})


@pytest.fixture(scope="module")
def drafters(tmp_path_factory) -> dict[str, list[str]]:
    d = tmp_path_factory.mktemp("drafters")
    ckpt = load_checkpoint(TINY / "llama")
    save_mtp(d / "mtp", random_mtp_weights(ckpt.config, seed=0, std=0.02))
    save_hf(first_layers(ckpt, 1), d / "cut")
    save_medusa(d / "medusa", *random_medusa(ckpt.config, 3, 0))
    save_hydra(d / "hydra", *random_hydra(ckpt.config, 3, 0))  # the model's own LM head, shared
    save_eagle(d / "eagle", random_eagle(ckpt.config, 0), ckpt.config)
    lm = np.asarray(ckpt.weights["lm_head.weight"], np.float32)  # [vocab, hidden]
    vocab = np.arange(0, ckpt.config.vocab_size, 2)  # a draft vocabulary of every other token
    save_eagle3(d / "eagle3", random_eagle3(ckpt.config, 0, lm, vocab), ckpt.config, (0, 1, 2))
    return {"none": [], "ngram": ["--method", "ngram"],
            "mtp": ["--method", "mtp", "--mtp-model", str(d / "mtp")],
            "draft_model": ["--method", "draft_model", "--draft-model", str(d / "cut")],
            **{m: ["--method", m, "--draft-model", str(d / m)]
               for m in ("medusa", "hydra", "eagle", "eagle3")}}


def test_thread_shares():
    assert thread_shares(2, 2) == [1, 1]
    assert thread_shares(7, 3) == [3, 2, 2]
    assert thread_shares(1, 3) == [1, 1, 1]  # never none


@pytest.mark.parametrize("method", ["none", "ngram", "mtp", "draft_model", "eagle"])
def test_workers_write_the_one_engine_records(tmp_path, drafters, method):
    inp = write_jsonl(tmp_path / "in.jsonl", RECORDS)
    common = ["--dtype", "float64", "--batch-size", "3", "--seed", "5", "-q", *drafters[method]]
    runs = {}
    for name, extra in (("one", []), ("two", ["--data-parallel-size", "2", "--threads", "2"])):
        out, summary = tmp_path / f"{name}.jsonl", tmp_path / f"{name}.json"
        res = invoke("run", inp, "-o", out, "--summary-json", summary, *common, *extra)
        assert res.exit_code == 8, res.output  # the two bad records are error records
        runs[name] = (by_id(read_output(out)), json.loads(summary.read_text()))
    (one, s1), (two, s2) = runs["one"], runs["two"]
    assert sorted(two) == sorted(one) and len(two) == len(RECORDS)
    for rid, rec in one.items():
        assert (two[rid]["token_ids"], two[rid]["text"], two[rid]["error"]) == (rec["token_ids"], rec["text"],
                                                                               rec["error"]), rid
    assert one["4"]["error"].startswith("line 4: malformed JSON")  # its id: the line number
    assert one["bad"]["error"].startswith("line 9: unknown field(s) colour")
    for key in ("num_requests", "num_errors", "num_prompt_tokens", "num_output_tokens", "methods"):
        assert s1[key] == s2[key], key
    assert s2["kv_cache_bytes"] > 0  # the workers' peaks, summed


def test_a_worker_start_up_error_is_the_job_error(tmp_path):
    """The draft model loads in the workers only: its error (exit 3, naming it) comes from there, before any
    request is handed out."""
    inp = write_jsonl(tmp_path / "in.jsonl", RECORDS[:2])
    res = invoke("run", inp, "-o", tmp_path / "out.jsonl", "--data-parallel-size", "2", "-q",
                 "--method", "draft_model", "--draft-model", str(tmp_path / "missing"))
    assert res.exit_code == 3, res.output
    assert "missing" in res.output
    assert not (tmp_path / "out.jsonl").read_text()  # nothing written


def spawn(inp: Path, out: Path, *extra: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "specgen", "run", str(inp), "-o", str(out), "--model", str(TINY_LLAMA),
            "--max-tokens", "16", "--batch-size", "4", "--ignore-eos", "--quiet", "--threads", "2", *extra]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=ENV,
                            start_new_session=True)  # a signal for the parent reaches it alone


def workers_of(proc: subprocess.Popen, count: int, timeout: float = 60) -> list[int]:
    """The pids of the run's engine workers (children started by multiprocessing's spawn, not its resource
    tracker), once `count` of them are running."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        pids = []
        for child in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split():
            try:
                cmd = Path(f"/proc/{child}/cmdline").read_bytes()
            except FileNotFoundError:
                continue
            if b"spawn_main" in cmd:
                pids.append(int(child))
        if len(pids) == count:
            return pids
        time.sleep(0.05)
    raise AssertionError(f"the run did not start {count} workers")


def wait_for_lines(proc: subprocess.Popen, path: Path, target: int, timeout: float = 120) -> int:
    deadline = time.monotonic() + timeout
    n = 0
    while proc.poll() is None and time.monotonic() < deadline:
        n = path.read_bytes().count(b"\n") if path.exists() else 0
        if n >= target:
            break
        time.sleep(0.005)
    return n


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> tuple[Path, dict[str, dict]]:
    """200 records and the one-engine run's output of them."""
    d = tmp_path_factory.mktemp("dpkill")
    inp = write_jsonl(d / "in.jsonl", [{"id": f"q{i}", "prompt": f"prompt {i}: " + "lorem " * (i % 6)}
                                        for i in range(200)])
    res = invoke("run", inp, "-o", d / "ref.jsonl", "--max-tokens", "16", "--batch-size", "4", "--ignore-eos",
                 "-q")
    assert res.exit_code == 0, res.output
    return inp, by_id(read_output(d / "ref.jsonl"))


def assert_complete(out: Path, reference: dict[str, dict]) -> None:
    got = by_id(read_output(out))  # each id once
    assert sorted(got) == sorted(reference)
    assert all(got[rid]["token_ids"] == ref["token_ids"] for rid, ref in reference.items())


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("ext", ["jsonl", "parquet"])
def test_killed_worker_fails_the_job_and_resume_completes_it(tmp_path, job, ext):
    inp, reference = job
    out = tmp_path / f"out.{ext}"
    proc = spawn(inp, out, "--data-parallel-size", "2")
    victim = workers_of(proc, 2)[1]
    wait_for_lines(proc, out if ext == "jsonl" else out.with_name(out.name + ".journal.jsonl"), 5)
    os.kill(victim, signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 4, err
    line = err.strip().splitlines()[-1]
    assert (line.startswith("error: data-parallel worker ")
            and f"(pid {victim}) was killed by SIGKILL" in line), err
    written = len(read_output(out))
    assert 0 < written < len(reference)
    assert (f"{written} records are safely in {out}; resume with: specgen run " in line
            and line.endswith("--resume"))

    resumed = spawn(inp, out, "--data-parallel-size", "2", "--resume")
    _, err = resumed.communicate(timeout=180)
    assert resumed.returncode == 0, err
    assert_complete(out, reference)


def test_sigterm_stops_the_parent_and_its_workers(tmp_path, job):
    inp, reference = job
    out = tmp_path / "out.jsonl"
    proc = spawn(inp, out, "--data-parallel-size", "2")
    workers = workers_of(proc, 2)
    wait_for_lines(proc, out, 5)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    lines = err.strip().splitlines()
    written = len(read_output(out))
    assert len(lines) == 1 and lines[0].startswith(f"stopped by SIGTERM: {written} records are in {out}"), err
    assert all(gone(pid) for pid in workers)
    resumed = spawn(inp, out, "--resume")
    _, err = resumed.communicate(timeout=180)
    assert resumed.returncode == 0, err
    assert_complete(out, reference)
