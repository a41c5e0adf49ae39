"""--pd P:D: prefill workers hand each prompt's KV cache, drafter state and first token to decode workers
through shared memory; the job writes the colocated engine's tokens (fp64, greedy and sampled, every method, a
shared prefix and chunked prefill, 1P1D, 2P1D and 1P2D); with the adaptive controller off the drafting
statistics are the colocated engine's too (the drafter state arrived whole); a killed worker fails the job
(exit 4) and --resume completes it; bad records still become error records naming their line."""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import signal
from pathlib import Path

import numpy as np
import pytest
from cli_support import by_id, invoke, read_output, write_jsonl
from conftest import TINY
from test_data_parallel import assert_complete, drafters, spawn, wait_for_lines, workers_of  # noqa: F401

from specgen import load_model
from specgen.api import encode_prompt, make_engine
from specgen.config import EngineConfig, NgramConfig, SamplingParams, SpecConfig
from specgen.distributed.disaggregated import DECODE, PREFILL, Handoff, make_pd_engine
from specgen.distributed.parcel import SHM_DIR, pack, sweep, unpack
from specgen.engine.types import Request, RequestOutput
from specgen.runtime.kv_cache import KVCache

PREFIX = "You are a careful assistant. Answer briefly and exactly, in one line, without a preamble. "
# Half the records sample, half are greedy; the first batch shares a prefix (cascade attention); line 5 is
# not JSON
RECORDS = [{"id": f"r{i}", "prompt": (PREFIX if i < 3 else "") + f"request {i}: " + "abc " * (i % 5),
            "max_tokens": 1 + i % 9, **({"temperature": 0.9} if i % 2 else {})} for i in range(12)]
RECORDS.insert(4, '{"id": "broken", ')
STATS = ("num_steps", "num_draft_tokens", "num_accepted_tokens", "accepted_per_position",
         "num_prefill_chunks", "num_cached_prompt_tokens")


def test_cache_rows_travel_whole_with_a_shared_prefix(tmp_path):
    """export_slot's pieces (the prefix's rows, then the slot's own), through a parcel, into another cache's
    slot: its rows [0, n) are the prefix's and then the slot's own, in every layer, K and V."""
    rng = np.random.default_rng(0)
    src = KVCache(2, 3, 2, 4, "float64", 32, initial_capacity=16)
    src.prefix = KVCache(2, 1, 2, 4, "float64", 8, initial_capacity=8)
    for c in (src, src.prefix):
        for t in c.k + c.v:
            t[:] = rng.normal(size=t.shape)
    pieces = src.export_slot(1, 9, prefix_len=5)  # positions 0-4 from the prefix, 5-8 from own rows 0-3
    parcel = pack({f"kv.{j}": p for j, p in enumerate(pieces)}, "specgen-test")
    dst = KVCache(2, 2, 2, 4, "float64", 32, initial_capacity=4)
    with unpack(parcel) as arrays:
        dst.import_slot(0, [arrays[f"kv.{j}"] for j in range(4)])
    assert dst.capacity >= 9 and dst.peak_own == 9
    for j, (s, p, d) in enumerate(zip(src.k + src.v, src.prefix.k + src.prefix.v, dst.k + dst.v)):
        s, p, d = (x.numpy().reshape(n, 2, -1, 4) for x, n in ((s, 3), (p, 1), (d, 2)))
        assert np.array_equal(d[0, :, :5], p[0, :, :5]) and np.array_equal(d[0, :, 5:9], s[1, :, :4]), j
    assert not (SHM_DIR / parcel.name).exists()  # the receiver freed the segment
    left = pack({"x": np.zeros(3)}, "specgen-test")
    assert sweep("specgen-test") == 1 and not (SHM_DIR / left.name).exists()


def test_parcels_stay_out_of_the_resource_tracker(monkeypatch):
    """Segments are packed, read, discarded and swept without multiprocessing's resource tracker, which would
    print leak warnings after the job's last line when a killed worker's hand-off is swept while read."""
    from multiprocessing import resource_tracker

    calls = []
    monkeypatch.setattr(resource_tracker, "register", lambda *a: calls.append(("register", a)))
    monkeypatch.setattr(resource_tracker, "unregister", lambda *a: calls.append(("unregister", a)))
    parcel = pack({"x": np.arange(5.0), "y": [np.ones((2, 1)), np.zeros((2, 2))]}, "specgen-test")
    with unpack(parcel) as arrays:
        assert arrays["x"].tolist() == [0, 1, 2, 3, 4] and arrays["y"].tolist() == [[1, 0, 0], [1, 0, 0]]
    assert not (SHM_DIR / parcel.name).exists()
    pack({"x": np.zeros(3)}, "specgen-test")
    assert sweep("specgen-test") == 1
    assert calls == []


def run_records(out: Path, *extra: str) -> tuple[dict[str, dict], dict]:
    inp = write_jsonl(out.with_suffix(".in.jsonl"), RECORDS)
    summary = out.with_suffix(".summary.json")
    res = invoke("run", inp, "-o", out, "--model", TINY / "llama", "--dtype", "float64", "--batch-size", "3",
                 "--seed", "5", "--prefill-chunk", "16", "--summary-json", summary, "-q", *extra, model=False)
    assert res.exit_code == 8, res.output  # the broken line is an error record
    return by_id(read_output(out)), json.loads(summary.read_text())


@pytest.fixture(scope="module")
def colocated(tmp_path_factory, drafters):  # noqa: F811
    """The colocated engine's records per (method, adaptive), each run once for the module."""
    d = tmp_path_factory.mktemp("pd_one")

    @functools.cache
    def records(method: str, adaptive: bool) -> tuple[dict[str, dict], dict]:
        extra = [] if adaptive else ["--no-adaptive"]
        return run_records(d / f"{method}-{adaptive}.jsonl", *drafters[method], *extra)
    return records


@pytest.mark.parametrize("method, adaptive, pd", [
    ("none", True, "1:1"), ("ngram", True, "2:1"), ("mtp", False, "1:2"), ("draft_model", False, "1:1"),
    ("eagle", True, "1:1"), ("hydra", True, "1:1")])
def test_workers_write_the_colocated_tokens(tmp_path, drafters, colocated, method, adaptive,  # noqa: F811
                                            pd):
    """Tokens, texts and error records as the colocated engine's; with the controller off (the same drafts
    offered, all verified) the drafting statistics too: the MTP head's and the draft model's caches came
    whole."""
    extra = [] if adaptive else ["--no-adaptive"]
    one, s1 = colocated(method, adaptive)
    got, s2 = run_records(tmp_path / "pd.jsonl", *drafters[method], *extra, "--pd", pd, "--threads", "2")
    assert sorted(got) == sorted(one)
    for rid, rec in one.items():
        assert (got[rid]["token_ids"], got[rid]["text"], got[rid]["error"]) == (rec["token_ids"], rec["text"],
                                                                               rec["error"]), rid
        if not adaptive:
            assert [got[rid][k] for k in STATS] == [rec[k] for k in STATS], rid
    assert one["5"]["error"].startswith("line 5: malformed JSON")
    # one prefill worker finds the prefix as one engine does (with several, each finds the one its own first
    # batch shares: which requests it took first varies)
    if pd.startswith("1:"):
        assert s2["num_cached_prompt_tokens"] == s1["num_cached_prompt_tokens"] > 0
    assert s2["kv_cache_bytes"] > 0
    assert not list(SHM_DIR.glob("specgen-pd-*"))  # every hand-off freed


@pytest.mark.parametrize("extra, fragment", [
    (["--pd", "1"], "pd must be P:D"),
    (["--pd", "1:1", "--data-parallel-size", "2"], "does not combine"),
])
def test_refused(tmp_path, extra, fragment):
    inp = write_jsonl(tmp_path / "in.jsonl", RECORDS[:1])
    res = invoke("run", inp, "-o", tmp_path / "out.jsonl", *extra)
    assert res.exit_code == 2, res.output
    assert fragment in res.output


@pytest.mark.parametrize("victim", ["prefill", "decode"])
def test_killed_worker_fails_the_job_and_resume_completes_it(tmp_path, victim):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": f"q{i}", "prompt": f"prompt {i}: " + "lorem " * (i % 6)}
                                               for i in range(60)])
    res = invoke("run", inp, "-o", tmp_path / "ref.jsonl", "--max-tokens", "16", "--batch-size", "4",
                 "--ignore-eos", "-q")
    assert res.exit_code == 0, res.output
    reference = by_id(read_output(tmp_path / "ref.jsonl"))
    out = tmp_path / "out.jsonl"
    proc = spawn(inp, out, "--pd", "1:1")
    pid = sorted(workers_of(proc, 2))[0 if victim == "prefill" else 1]  # the prefill worker is started first
    wait_for_lines(proc, out, 5)
    os.kill(pid, signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 4, err
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"error: {victim} worker 0 of 1 (pid {pid}) was killed by SIGKILL"), err
    written = len(read_output(out))
    assert 0 < written < len(reference) and line.endswith("--resume")
    assert not list(SHM_DIR.glob("specgen-pd-*"))  # what the dead worker held in shared memory was freed
    resumed = spawn(inp, out, "--pd", "1:1", "--resume")
    _, err = resumed.communicate(timeout=180)
    assert resumed.returncode == 0, err
    assert_complete(out, reference)


def pipeline(loaded, engine: EngineConfig, spec: SpecConfig,
             requests: list[Request]) -> dict[str, RequestOutput]:
    """The workers' engines in this process: a prefill engine's hand-offs (through shared memory) into a
    decode engine; outputs by id."""
    items = list(make_pd_engine(loaded, engine, spec, PREFILL).run(requests))
    handoffs = [x for x in items if isinstance(x, Handoff)]
    out = {o.id: o for o in items if not isinstance(o, Handoff)}  # done at the first token
    out.update({o.id: o for o in make_pd_engine(loaded, engine, spec, DECODE).run(handoffs)})
    return out


def requests_of(loaded, texts: list[str], max_tokens: int = 12) -> list[Request]:
    return [Request(f"r{i}", i, encode_prompt(loaded, t), SamplingParams(
        max_tokens=1 + (i * 5 + max_tokens) % max_tokens, temperature=0.8 if i % 2 else 0.0, seed=7))
        for i, t in enumerate(texts)]


def assert_colocated(loaded, engine: EngineConfig, spec: SpecConfig, requests: list[Request]) -> int:
    """The pipeline's outputs are the colocated engine's (with the controller off, their statistics too);
    returns the drafts verified."""
    one = {o.id: o for o in make_engine(loaded, engine, spec).run(requests)}
    pd = pipeline(loaded, engine, spec, requests)
    assert sorted(pd) == sorted(one)
    for rid, o in one.items():
        assert (pd[rid].token_ids, pd[rid].text) == (o.token_ids, o.text), rid
        if not spec.adaptive:
            assert dataclasses.asdict(pd[rid].stats) == dataclasses.asdict(o.stats), rid
    return sum(o.stats.num_draft_tokens for o in pd.values())


def test_medusa_guesses_travel(tmp_path):
    """Medusa's guesses made at the prompt's last position go with the request (fused fp64, controller off:
    the same trees verified as in the colocated engine)."""
    from specgen.config import MedusaConfig
    from specgen.drafters.medusa import save_medusa

    loaded = load_model(TINY / "llama", dtype="float64")
    cfg, rng = loaded.config, np.random.default_rng(1)
    lm = loaded.model.weights.lm_head.dense().numpy().T  # head 0 guesses the model's own next tokens
    save_medusa(tmp_path, [[(rng.normal(0, 0.02, (cfg.hidden_size,) * 2),
                             rng.normal(0, 0.02, cfg.hidden_size))]
                           for _ in range(3)], [lm] * 3)
    spec = SpecConfig(method="medusa", draft_model=str(tmp_path), adaptive=False,
                      medusa=MedusaConfig(topk=2, tree_choices=("0,0,0", "1", "0,1", "1,0")))
    requests = requests_of(loaded, [f"item {i}: " + "x y " * i for i in range(8)])
    assert assert_colocated(loaded, EngineConfig(batch_size=3, dtype="float64"), spec, requests) > 0


def test_eagle_trees_travel(tmp_path):
    """The EAGLE tree grown at the prompt's last position (its tokens, parents and probabilities) goes with
    the request, beside the layer's cache (fused fp64, controller off: the same trees verified and accepted as
    in the colocated engine; without the tree arrays the decode side verified an empty tree on its first
    step)."""
    from heads import random_eagle, random_eagle3

    from specgen.config import EagleConfig
    from specgen.drafters.eagle import save_eagle
    from specgen.drafters.eagle3 import save_eagle3

    loaded = load_model(TINY / "llama", dtype="float64")
    save_eagle(tmp_path, random_eagle(loaded.config, 3, norm=True), loaded.config)
    requests = requests_of(loaded, [f"item {i}: " + "x y " * i for i in range(8)])
    # the trees alone (these prompts repeat: with copies most slots copy), and with copies; an EAGLE-3 layer
    # (its features, the main model's block inputs, handed over by each side's forward)
    lm = loaded.model.weights.lm_head.dense().numpy().T
    vocab = np.arange(0, loaded.config.vocab_size, 2)
    save_eagle3(tmp_path / "e3", random_eagle3(loaded.config, 1, lm, vocab), loaded.config, (0, 1, 2))
    for method, path, copy in (("eagle", tmp_path, 0), ("eagle", tmp_path, 2),
                               ("eagle3", tmp_path / "e3", 0)):
        spec = SpecConfig(method=method, draft_model=str(path), adaptive=False, num_speculative_tokens=3,
                          eagle=EagleConfig(topk=2, nodes=6, copy=copy))
        assert assert_colocated(loaded, EngineConfig(batch_size=3, dtype="float64"), spec, requests) > 0, \
            (method, copy)


@pytest.mark.realmodel
@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_default_model_hand_off(real_model64, method):
    """SmolLM2 in float64, its shipped MTP head: hand-offs give the colocated engine's tokens (in this
    process; the worker processes are the tiny model's tests above)."""
    texts = ["The capital of France is", "def fib(n):", "Once upon a time", "List three colors:"]
    requests = requests_of(real_model64, texts, 10)
    spec = SpecConfig(method=method, adaptive=False, ngram=NgramConfig(pool=0))
    drafts = assert_colocated(real_model64, EngineConfig(batch_size=2, dtype="float64"), spec, requests)
    assert drafts > 0 or method == "ngram"  # the head drafted (these prompts give n-gram lookup nothing)


def test_logprobs_travel():
    """A request asking for log-probabilities: its first token's (the prefill worker's) go with it, its
    prompt's too (prompt_logprobs; the prompts share a prefix, whose entries are scored once), and the decode
    worker's output equals the colocated engine's, entry for entry."""
    loaded = load_model(TINY / "llama", dtype="float64")
    requests = [dataclasses.replace(r, params=dataclasses.replace(r.params, logprobs=i % 3 > 0,
                                                                  top_logprobs=i % 3,
                                                                  prompt_logprobs=(3, 0, None)[i % 3]))
                for i, r in enumerate(requests_of(loaded, [PREFIX + f"item {i}: " + "x y " * i
                                                           for i in range(6)]))]
    engine, spec = EngineConfig(batch_size=3, dtype="float64"), SpecConfig(method="ngram", adaptive=False)
    one = {o.id: o for o in make_engine(loaded, engine, spec).run(requests)}
    pd = pipeline(loaded, engine, spec, requests)
    for i, r in enumerate(requests):
        assert pd[r.id].token_ids == one[r.id].token_ids
        assert pd[r.id].logprobs == one[r.id].logprobs
        assert (one[r.id].logprobs is None) == (i % 3 == 0)
        assert one[r.id].logprobs is None or len(one[r.id].logprobs) == len(one[r.id].token_ids)
        assert pd[r.id].prompt_logprobs == one[r.id].prompt_logprobs
        assert (one[r.id].prompt_logprobs is None) == (r.params.prompt_logprobs is None)
    assert sum(r.params.prompt_logprobs is not None for r in requests) >= 3
    assert any(r.params.prompt_logprobs is not None and one[r.id].stats.num_cached_prompt_tokens > 0
               for r in requests)  # (entries of the shared prefix's positions)


def test_constrained_requests_travel():
    """A request with a response_format: the decode worker's grammar starts after the first token (the
    prefill worker's), and its output equals the colocated engine's (greedy and sampled, forced drafts on)."""
    loaded = load_model(TINY / "llama", dtype="float64")
    fmt = {"type": "regex", "regex": "[a-c]{1,4}(-[0-9]{2}){1,3}"}
    requests = [dataclasses.replace(r, params=dataclasses.replace(r.params, max_tokens=20,
                                                                  response_format=fmt))
                for r in requests_of(loaded, [f"item {i}: " + "x y " * i for i in range(6)])]
    engine, spec = EngineConfig(batch_size=3, dtype="float64"), SpecConfig(method="ngram", adaptive=False)
    assert_colocated(loaded, engine, spec, requests)
    one = list(make_engine(loaded, engine, spec).run(requests))
    assert all(o.finish_reason == "stop" for o in one)
    assert sum(o.stats.num_forced_tokens for o in one) > 0
