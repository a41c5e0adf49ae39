"""Run settings: defaults < YAML < --speculative-config < flags; unknown keys, contradictions are errors;
every config field is a setting (a flag)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from specgen.app.settings import all_settings, load_yaml, parse_speculative_config, resolve
from specgen.config import EngineConfig, Method, MtpConfig, NgramConfig, SamplingParams, SpecConfig
from specgen.errors import ConfigError

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_defaults_come_from_the_dataclasses():
    cfg = resolve(None, {"max_tokens": None, "batch_size": None, "method": None, "stop": []})
    assert (cfg.sampling, cfg.engine, cfg.spec) == (SamplingParams(), EngineConfig(), SpecConfig())


def test_yaml_over_defaults_and_flags_over_yaml():
    sections = {"sampling": {"max_tokens": 10, "temperature": 0.5}, "engine": {"batch_size": 8},
                "speculative": {"method": "ngram", "num_speculative_tokens": 2}}
    cfg = resolve(sections, {"max_tokens": 20, "batch_size": None, "num_speculative_tokens": 4})
    assert cfg.sampling.max_tokens == 20  # flag wins
    assert cfg.sampling.temperature == 0.5  # YAML wins over the default
    assert cfg.engine.batch_size == 8
    assert cfg.spec.method is Method.NGRAM and cfg.spec.num_speculative_tokens == 4


def test_speculative_json_between_yaml_and_flags():
    sections = {"speculative": {"method": "ngram", "num_speculative_tokens": 2}}
    js = parse_speculative_config('{"method": "mtp", "num_speculative_tokens": 1, "model": "/m"}')
    assert js == {"method": "mtp", "num_speculative_tokens": 1, "model": "/m"}
    cfg = resolve(sections, {"num_speculative_tokens": 5}, js)
    assert cfg.spec == SpecConfig(method=Method.MTP, num_speculative_tokens=5, mtp=MtpConfig(model="/m"))
    # "model" follows the method however it is given (here a flag), and a flag for it still wins
    only_model = parse_speculative_config('{"model": "/m"}')
    assert resolve(None, {"method": "mtp"}, only_model).spec.mtp.model == "/m"
    assert resolve(None, {"method": "mtp", "mtp_model": "/flag"}, only_model).spec.mtp.model == "/flag"
    with pytest.raises(ConfigError, match="needs a method that drafts with a checkpoint"):
        resolve(None, {"method": "ngram"}, only_model)


def test_bench_settings_serve_every_method_listed():
    cfg = resolve(None, {"method": "mtp", "ngram_pool": 0, "mtp_copy": 1}, None,
                  {Method.NONE, Method.NGRAM, Method.MTP})
    assert cfg.spec.ngram.pool == 0 and cfg.spec.mtp.copy == 1
    with pytest.raises(ConfigError, match="mtp.copy needs method 'mtp'"):
        resolve(None, {"method": "ngram", "mtp_copy": 1}, None, {Method.NONE, Method.NGRAM})
    assert not resolve(None, {"adaptive": False}).spec.adaptive  # harmless with method none


def test_speculative_json_from_a_file(tmp_path):
    path = tmp_path / "spec.json"
    path.write_text(json.dumps({"method": "ngram", "ngram": {"max": 4}}))
    assert parse_speculative_config(str(path)) == {"method": "ngram", "ngram": {"max": 4}}


@pytest.mark.parametrize("value,fragment", [
    ('{"method": "ngram", "quantization": "wint8"}', "unknown key(s) quantization"),
    ('{"method": "ngram", "ngram": {"pool": -1}}', "ngram pool must be >= 0"),
    ("{not json", "not valid JSON"),
    ("/no/such/file.json", "neither a JSON object nor a readable file"),
])
def test_bad_speculative_json(value, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        parse_speculative_config(value)


@pytest.mark.parametrize("text,fragment", [
    ("sampling:\n  max_token: 3\n",
     "sampling: unknown key(s) max_token (valid: frequency_penalty, ignore_eos, logit_bias, logprobs, "
     "logprobs_mode, max_tokens"),
    ("speculative:\n  ngram:\n    maximum: 3\n",
     "speculative.ngram: unknown key(s) maximum (valid: branches, max, min, pool, tree_choices)"),
    ("decoding:\n  x: 1\n", "unknown section(s) decoding (valid: sampling, engine, speculative, parallel)"),
    ("max_tokens: 3\n", "unknown section(s) max_tokens"),
    ("sampling: [1, 2]\n", "section 'sampling' must be a mapping"),
    ("sampling: {max_tokens: 3\n", "not valid YAML"),
    ("- 1\n", "expected a mapping of sections"),
])
def test_bad_yaml(tmp_path, text, fragment):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_yaml(path)
    assert fragment in str(info.value)
    assert str(path) in str(info.value)


def test_bad_values_are_config_errors():
    with pytest.raises(ConfigError, match="batch_size must be in 1..256"):
        resolve(None, {"batch_size": 0})
    with pytest.raises(ConfigError, match="unknown method 'lookahead'"):
        resolve(None, {"method": "lookahead"})
    with pytest.raises(ConfigError, match="engine"):
        resolve({"engine": {"batch_size": "four"}}, {})
    with pytest.raises(ConfigError, match="ngram pool must be >= 0"):
        resolve(None, {"method": "ngram", "ngram_pool": -1})
    assert resolve(None, {"method": "ngram", "ngram_pool": 0}).spec.ngram.pool == 0
    with pytest.raises(ConfigError, match="device must be one of auto, cpu, gpu, got 'tpu'"):
        resolve(None, {"device": "tpu"})
    with pytest.raises(ConfigError, match="backend must be one of auto, fused, reference"):
        resolve(None, {"backend": "fast"})
    with pytest.raises(ConfigError, match="matmul must be one of float32, int8, got 'int4'"):
        resolve(None, {"matmul": "int4"})
    with pytest.raises(ConfigError, match="matmul int8 needs dtype float32, got 'float64'"):
        resolve({"engine": {"matmul": "int8"}}, {"dtype": "float64"})
    assert resolve({"engine": {"matmul": "int8"}}, {}).engine.matmul == "int8"


@pytest.mark.parametrize("flags,js,fragment", [
    ({"num_speculative_tokens": 2}, None, "num_speculative_tokens has no effect with method 'none'"),
    ({"method": "none", "num_speculative_tokens": 2}, None, "no effect with method 'none'"),
    ({"method": "ngram", "mtp_model": "/m"}, None, "mtp.model needs method 'mtp'"),
    ({"method": "ngram", "mtp_copy": 0}, None, "mtp.copy needs method 'mtp'"),
    ({"method": "mtp", "ngram_pool": 0}, None, "ngram.pool needs method 'ngram'"),
    ({"method": "mtp", "mtp_copy": 9}, None, "mtp copy must be in 0..8"),
    ({"ngram_pool": 0}, None, "ngram.pool has no effect with method 'none'"),
    ({}, {"method": "ngram", "mtp": {"copy": 1}}, "mtp.copy needs method 'mtp'"),
    ({}, {"method": "none", "num_speculative_tokens": 3}, "no effect with method 'none'"),
])
def test_contradictory_options(flags, js, fragment):
    with pytest.raises(ConfigError, match=fragment):
        resolve(None, flags, js)


def test_yaml_method_none_with_k_in_yaml_is_fine():
    cfg = resolve({"speculative": {"method": "none", "num_speculative_tokens": 2}}, {})
    assert cfg.spec.method is Method.NONE


@pytest.mark.parametrize("name", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_presets_load(name):
    sections = load_yaml(CONFIGS / name)
    cfg = resolve(sections, {})
    for section, values in sections.items():
        built = {"sampling": cfg.sampling, "engine": cfg.engine, "speculative": cfg.spec}[section]
        for key, value in values.items():
            got = getattr(built, key)
            if isinstance(value, dict):  # a method's section
                assert all(getattr(got, k) == v for k, v in value.items()), (name, section, key)
                continue
            assert (got.value if isinstance(got, Method) else got) == value, (name, section, key)


def test_every_field_is_a_setting_with_help():
    """Each config field, nested method sections included, is one flag (a method's fields prefixed with the
    method), documented."""
    settings = {s.flag: s for s in all_settings()}
    assert settings["ngram_pool"].path == ("speculative", "ngram", "pool")
    assert settings["mtp_model"].path == ("speculative", "mtp", "model")
    assert settings["batch_size"].path == ("engine", "batch_size")
    for name in ("device", "backend", "cpu_target", "cache_dir", "cost_cache", "mtp_quantize", "adaptive",
                 "ngram_min", "ngram_max", "mtp_copy", "max_prefill_tokens", "kv_cache_dtype"):
        assert name in settings and settings[name].help, name
    assert all(s.help for s in settings.values())
    nested = resolve(None, {"method": "ngram", "ngram_min": 2, "ngram_max": 4, "ngram_pool": 0}).spec.ngram
    assert nested == NgramConfig(min=2, max=4, pool=0)

