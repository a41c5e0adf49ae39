"""--expert-parallel-size: a mixture-of-experts model's experts split over 2 ranks (attention, shared experts
and vocabulary sharded as tensor parallelism does) writes the one-engine run's tokens and tokens per expert
(fp64, greedy and sampled, qwen3_moe and ernie4_5_moe, none / ngram / mtp, a shared prefix and chunked
prefill); the ranks' expert shards sum to the whole layer; a killed rank fails the job (exit 4) and --resume
completes it; what EP does not run is refused before any rank starts."""
from __future__ import annotations

import functools
import json
import os
import signal
from pathlib import Path

import numpy as np
import paddle
import pytest
from cli_support import by_id, invoke, read_output, write_jsonl
from conftest import TINY
from test_data_parallel import assert_complete, spawn, wait_for_lines, workers_of
from test_tensor_parallel import RECORDS, assert_same_tokens

from specgen.distributed.tp_shard import plan_shard, shard_block
from specgen.drafters.mtp import random_mtp_weights, save_mtp
from specgen.layers.moe import moe_forward
from specgen.models import load_checkpoint
from specgen.models.model import Model

MOE_ARCHS = ["qwen3_moe", "ernie4_5_moe"]


def test_expert_shards_sum_to_the_whole_layer():
    """ERNIE's routed block (8 experts top-3, 2 shared experts) over 3 ranks: experts 0-2 / 3-5 / 6-7 whole,
    the shared experts' columns split; each rank's MoE output and shared-expert output, summed over the ranks,
    is the whole block's, and each rank counts every token's experts."""
    from specgen.backends.reference import ReferenceBackend
    from specgen.config import EngineConfig

    model = Model(load_checkpoint(TINY / "ernie4_5_moe"), ReferenceBackend(EngineConfig(dtype="float64")))
    cfg, block = model.config, model.weights.blocks[1]
    assert block.moe is not None and block.down is not None
    h = paddle.to_tensor(np.random.default_rng(0).standard_normal((7, cfg.hidden_size)))
    full_counts = np.zeros(cfg.moe.num_experts, np.int64)
    want = moe_forward(h, block.moe, full_counts).numpy()
    parts, shared = [], []
    for r in range(3):
        s = plan_shard(cfg, r, 3)
        b = shard_block(block, s, model.shape, cfg.intermediate_size)
        assert b.moe.first_expert == s.experts[0] and len(b.moe.experts) == s.experts[1] - s.experts[0]
        counts = np.zeros(cfg.moe.num_experts, np.int64)
        parts.append(moe_forward(h, b.moe, counts).numpy())
        assert np.array_equal(counts, full_counts)
        gate, up = paddle.split(b.gate_up(h), 2, axis=-1)
        shared.append(b.down(paddle.nn.functional.silu(gate) * up).numpy())
    assert [plan_shard(cfg, r, 3).experts for r in range(3)] == [(0, 3), (3, 6), (6, 8)]
    np.testing.assert_allclose(sum(parts), want, rtol=1e-12, atol=1e-14)
    gate, up = paddle.split(block.gate_up(h), 2, axis=-1)
    np.testing.assert_allclose(sum(shared), block.down(paddle.nn.functional.silu(gate) * up).numpy(),
                               rtol=1e-12, atol=1e-14)


@pytest.fixture(scope="module")
def heads(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("moe_heads")
    for arch in MOE_ARCHS:
        save_mtp(d / arch, random_mtp_weights(load_checkpoint(TINY / arch).config, seed=1, std=0.3))
    return {arch: d / arch for arch in MOE_ARCHS}


def method_flags(method: str, head: Path) -> list[str]:
    """Drafting methods verify every draft offered (--no-adaptive): whether the controller verifies any of the
    random model's drafts depends on step costs timed on a shared machine."""
    return {"none": [], "ngram": ["--method", "ngram", "--no-adaptive"],
            "mtp": ["--method", "mtp", "--mtp-model", str(head), "--no-adaptive"]}[method]


def run_records(out: Path, arch: str, *extra: str) -> tuple[dict[str, dict], dict]:
    """The run's records by id, and its summary."""
    inp = write_jsonl(out.with_suffix(".in.jsonl"), RECORDS)
    summary = out.with_suffix(".summary.json")
    res = invoke("run", inp, "-o", out, "--model", TINY / arch, "--dtype", "float64", "--batch-size", "3",
                 "--seed", "5", "--prefill-chunk", "16", "--summary-json", summary, "-q", *extra, model=False)
    assert res.exit_code == 0, res.output
    s = json.loads(summary.read_text())
    assert s["num_cached_prompt_tokens"] > 0  # the shared prefix was used
    return by_id(read_output(out)), s


@pytest.fixture(scope="module")
def one_engine(tmp_path_factory, heads):
    d = tmp_path_factory.mktemp("ep_one")

    @functools.cache
    def records(arch: str, method: str) -> tuple[dict[str, dict], dict]:
        return run_records(d / f"{arch}-{method}.jsonl", arch, *method_flags(method, heads[arch]))
    return records


@pytest.mark.parametrize("arch, method", [(a, m) for a in MOE_ARCHS for m in ("none", "ngram", "mtp")])
def test_ranks_write_the_one_engine_tokens(tmp_path, heads, one_engine, arch, method):
    one, s1 = one_engine(arch, method)
    ep, s2 = run_records(tmp_path / "ep.jsonl", arch, *method_flags(method, heads[arch]),
                         "--expert-parallel-size", "2", "--threads", "2")
    assert_same_tokens(one, ep)
    # greedy and sampled records both ran (RECORDS alternate), and drafts were offered where a method drafts
    assert {"temperature" in r for r in RECORDS} == {True, False}
    if method != "none":
        assert s2["num_draft_tokens"] > 0
    # every token's experts counted once, as one engine counts them (rank 0 routes every token); with drafts
    # the counts include the verified ones, which the adaptive controller chooses from timings
    assert sum(s2["expert_tokens"]) > 0
    if method == "none":
        assert s2["expert_tokens"] == s1["expert_tokens"]


@pytest.mark.parametrize("extra, fragment", [
    (["--expert-parallel-size", "2", "--model", TINY / "llama"], "this model is dense"),
    (["--tensor-parallel-size", "2", "--model", TINY / "qwen3_moe"], "use --expert-parallel-size"),
    (["--expert-parallel-size", "9", "--model", TINY / "qwen3_moe"],
     "more ranks than the model's 4 attention"),
    (["--expert-parallel-size", "2", "--tensor-parallel-size", "2", "--model", TINY / "qwen3_moe"], "alone"),
    (["--expert-parallel-size", "2", "--data-parallel-size", "2", "--model", TINY / "qwen3_moe"],
     "not combine"),
    (["--expert-parallel-size", "2", "--backend", "fused", "--model", TINY / "qwen3_moe"],
     "reference backend"),
])
def test_refused_before_any_rank_starts(tmp_path, extra, fragment):
    inp = write_jsonl(tmp_path / "in.jsonl", RECORDS[:1])
    res = invoke("run", inp, "-o", tmp_path / "out.jsonl", *extra, model=False)
    assert res.exit_code == 2, res.output
    assert fragment in res.output


def test_killed_rank_fails_the_job_and_resume_completes_it(tmp_path):
    model = ["--model", str(TINY / "qwen3_moe"), "--dtype", "float64"]
    inp = write_jsonl(tmp_path / "in.jsonl", [{"id": f"q{i}", "prompt": f"prompt {i}: " + "lorem " * (i % 6)}
                                               for i in range(40)])
    res = invoke("run", inp, "-o", tmp_path / "ref.jsonl", "--max-tokens", "16", "--batch-size", "4",
                 "--ignore-eos", "-q", *model, model=False)
    assert res.exit_code == 0, res.output
    reference = by_id(read_output(tmp_path / "ref.jsonl"))
    out = tmp_path / "out.jsonl"
    proc = spawn(inp, out, "--expert-parallel-size", "2", *model)
    # not rank 0: it holds half the experts, blocked in a collective when it dies
    victim = workers_of(proc, 2)[1]
    wait_for_lines(proc, out, 5)
    os.kill(victim, signal.SIGKILL)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 4, err
    line = err.strip().splitlines()[-1]
    assert (line.startswith("error: expert-parallel rank ")
            and f"(pid {victim}) was killed by SIGKILL" in line), err
    assert line.endswith("--resume")
    written = len(read_output(out))
    assert 0 < written < len(reference)
    resumed = spawn(inp, out, "--expert-parallel-size", "2", "--resume", *model)
    _, err = resumed.communicate(timeout=180)
    assert resumed.returncode == 0, err
    assert_complete(out, reference)
