"""Every flag reaches the config; defaults < YAML < --speculative-config < flags; --help lists the options."""
from __future__ import annotations

import re

import pytest
from cli_support import invoke, write_jsonl

import specgen.app.job
import specgen.cli
from specgen.config import EngineConfig, Method, MtpConfig, NgramConfig, SamplingParams, SpecConfig
from specgen.io.job_output import JobResult
from specgen.io.summary import summarize


@pytest.fixture
def captured(monkeypatch):
    """Stub the model load and the job: capture what `run` would hand them."""
    seen = {}

    def fake_run_job(plan, loaded, cfg, progress):
        seen.update(plan=plan, loaded=loaded, cfg=cfg)
        return JobResult(summarize([]), 0)

    def fake_load(model, cfg):
        seen.update(model=model)
        return "loaded"

    monkeypatch.setattr(specgen.app.job, "run_job", fake_run_job)
    monkeypatch.setattr(specgen.app.job, "run_manifest", lambda loaded, cfg: {})
    monkeypatch.setattr(specgen.app.job, "check_manifest", lambda plan, manifest: [])
    monkeypatch.setattr(specgen.cli, "_load", fake_load)
    return seen


@pytest.fixture
def inp(tmp_path):
    return write_jsonl(tmp_path / "in.jsonl", [{"prompt": "a"}])


def test_every_flag_reaches_the_config(captured, inp, tmp_path):
    result = invoke(
        "run", inp, "-o", tmp_path / "out.parquet", "--method", "ngram", "--num-speculative-tokens", "4",
        "--batch-size", "7", "--max-tokens", "11", "--temperature", "0.7", "--top-p", "0.9", "--top-k", "5",
        "--seed", "42", "--stop", "END", "--stop", "\n\n", "--ignore-eos", "--dtype", "float64",
        "--threads", "3", "--max-model-len", "128", "--on-error", "fail", "--input-format", "jsonl",
        "--quiet", model=False)
    assert result.exit_code == 0, result.output
    cfg = captured["cfg"]
    assert cfg.sampling == SamplingParams(max_tokens=11, temperature=0.7, top_p=0.9, top_k=5, seed=42,
                                          stop=("END", "\n\n"), ignore_eos=True)
    assert cfg.engine == EngineConfig(batch_size=7, dtype="float64", threads=3, max_model_len=128)
    assert cfg.spec == SpecConfig(method=Method.NGRAM, num_speculative_tokens=4)
    plan = captured["plan"]
    assert (plan.input, plan.input_format, plan.output, plan.resume, plan.on_error) == (
        inp, "jsonl", tmp_path / "out.parquet", False, "fail")
    assert captured["model"] is None  # the built-in default


def test_mtp_flags_and_model(captured, inp, tmp_path):
    result = invoke("run", inp, "-o", tmp_path / "o.jsonl", "--method", "mtp", "--mtp-model", "/ckpt/mtp",
                    "--model", "/ckpt/main", "--resume", model=False)
    assert result.exit_code == 0, result.output
    assert captured["cfg"].spec == SpecConfig(method=Method.MTP, mtp=MtpConfig(model="/ckpt/mtp"))
    assert captured["model"] == "/ckpt/main" and captured["plan"].resume


def test_no_flags_gives_the_dataclass_defaults(captured, inp, tmp_path):
    result = invoke("run", inp, "-o", tmp_path / "o.jsonl", model=False)
    assert result.exit_code == 0, result.output
    cfg = captured["cfg"]
    assert (cfg.sampling, cfg.engine, cfg.spec) == (SamplingParams(), EngineConfig(), SpecConfig())
    assert captured["plan"].on_error == "skip"


def test_precedence_defaults_yaml_speculative_config_flags(captured, inp, tmp_path):
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("sampling:\n  max_tokens: 9\n  temperature: 0.5\nengine:\n  batch_size: 3\n"
                         "speculative:\n  method: ngram\n  num_speculative_tokens: 2\n  ngram:\n    max: 4\n")
    result = invoke("run", inp, "-o", tmp_path / "o.jsonl", "--config", yaml_file, "--max-tokens", "20",
                    "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 1, "model": "/d"}',
                    "--num-speculative-tokens", "5", model=False)
    assert result.exit_code == 0, result.output
    cfg = captured["cfg"]
    assert cfg.sampling.max_tokens == 20  # flag over YAML
    assert cfg.sampling.temperature == 0.5  # YAML over default
    assert cfg.sampling.top_p == 1.0  # default
    assert cfg.engine.batch_size == 3
    assert cfg.spec == SpecConfig(method=Method.MTP, num_speculative_tokens=5, ngram=NgramConfig(max=4),
                                  mtp=MtpConfig(model="/d"))


@pytest.mark.parametrize("command,options", [
    ("run", ["--output", "--model", "--method", "--num-speculative-tokens", "--mtp-model", "--ngram-pool",
             "--speculative-config", "--batch-size", "--max-tokens", "--temperature", "--top-p", "--top-k",
             "--seed", "--stop", "--ignore-eos", "--dtype", "--threads", "--max-model-len", "--config",
             "--resume", "--on-error", "--quiet", "--summary-json", "--input-format", "--device", "--backend",
             "--cpu-target", "--cache-dir", "--no-cost-cache", "--ngram-min", "--ngram-max", "--mtp-copy",
             "--no-mtp-quantize", "--no-adaptive", "--kv-cache-dtype", "--matmul", "--prefill-chunk"]),
    ("stats", ["--summary-json"]),
    ("bench", ["--methods", "--model", "--num-speculative-tokens", "--ngram-pool", "--batch-size",
               "--max-tokens", "--config", "--batch-sizes", "--sample", "--sample-seed", "--repeats",
               "--plot"]),
])
def test_help_lists_the_options(command, options):
    result = invoke(command, "--help")
    assert result.exit_code == 0
    text = re.sub(r"\s+", " ", result.output)
    for option in options:
        assert option in text, option
    if command != "stats":
        assert "defaults < --config YAML < --speculative-config < individual flags" in text


def test_top_level_help_lists_the_commands():
    result = invoke("--help")
    assert result.exit_code == 0
    for command in ("run", "stats", "bench"):
        assert command in result.output
