"""Run settings: dataclass defaults < YAML file < --speculative-config < flags, resolved once.

YAML shape: up to three sections, each mapping onto one config dataclass's fields:

    sampling:     {max_tokens, temperature, top_p, top_k, seed, stop, ignore_eos}   -> SamplingParams
    engine:       {batch_size, dtype, threads, max_model_len, max_prefill_tokens, prefill_chunk, shared_prefix,
                   kv_cache_dtype, matmul, ...} -> EngineConfig
    speculative:  {method, num_speculative_tokens, ngram_min, ngram_max, ngram_pool, mtp_model, mtp_copy,
                  adaptive} -> SpecConfig
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from specgen.config import EngineConfig, Method, SamplingParams, SpecConfig, from_mapping
from specgen.errors import ConfigError

SECTIONS: dict[str, type] = {"sampling": SamplingParams, "engine": EngineConfig, "speculative": SpecConfig}

# FastDeploy's --speculative-config names the draft checkpoint "model"; everything else is a SpecConfig field.
SPEC_JSON_ALIASES = {"model": "mtp_model"}


@dataclass(frozen=True)
class RunConfig:
    """The three resolved configs of a run; each component receives only its own part."""

    sampling: SamplingParams
    engine: EngineConfig
    spec: SpecConfig


def _field_names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def section_of_field() -> dict[str, str]:
    """Field name -> section name (the three dataclasses have disjoint field names)."""
    return {name: section for section, cls in SECTIONS.items() for name in _field_names(cls)}


def load_yaml(path: str | Path) -> dict[str, dict[str, Any]]:
    """Read a YAML config file into {section: {field: value}}, rejecting unknown sections and keys."""
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{p}: config file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{p}: cannot read config file ({exc})") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML ({' '.join(str(exc).split())})") from None
    return check_sections(data if data is not None else {}, str(p))


def check_sections(data: Any, where: str) -> dict[str, dict[str, Any]]:
    """Validate the {section: {field: value}} shape; unknown names are errors naming the valid ones."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of sections ({', '.join(SECTIONS)})")
    unknown = sorted(str(k) for k in data if k not in SECTIONS)
    if unknown:
        raise ConfigError(f"{where}: unknown section(s) {', '.join(unknown)} (valid: {', '.join(SECTIONS)})")
    out: dict[str, dict[str, Any]] = {}
    for section, values in data.items():
        values = {} if values is None else values
        if not isinstance(values, dict):
            raise ConfigError(f"{where}: section {section!r} must be a mapping of field: value")
        names = _field_names(SECTIONS[section])
        bad = sorted(str(k) for k in values if k not in names)
        if bad:
            raise ConfigError(
                f"{where}: unknown key(s) {', '.join(bad)} in section {section!r} "
                f"(valid: {', '.join(sorted(names))})"
            )
        out[section] = dict(values)
    return out


def parse_speculative_config(value: str) -> dict[str, Any]:
    """FastDeploy-style JSON, inline or in a file: {"method": "mtp", "num_speculative_tokens": 1, ...}."""
    text, where = value, "--speculative-config"
    if not value.lstrip().startswith("{"):
        p = Path(value)
        try:
            text, where = p.read_text(encoding="utf-8"), str(p)
        except OSError as exc:
            raise ConfigError(
                f"--speculative-config: neither a JSON object nor a readable file ({exc})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a JSON object")
    valid = _field_names(SpecConfig) | set(SPEC_JSON_ALIASES)
    unknown = sorted(k for k in data if k not in valid)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)} (valid: {', '.join(sorted(valid))})")
    return {SPEC_JSON_ALIASES.get(k, k): v for k, v in data.items()}


def resolve(
    yaml_sections: Mapping[str, Mapping[str, Any]] | None,
    flags: Mapping[str, Any],
    speculative_json: Mapping[str, Any] | None = None,
) -> RunConfig:
    """Merge the layers (a flag of None means "not given") and build the three dataclasses.

    `flags` keys are dataclass field names; a key that is no field is a programming error.
    """
    owner = section_of_field()
    layers = {s: dict((yaml_sections or {}).get(s, {})) for s in SECTIONS}
    layers["speculative"].update(speculative_json or {})
    given = {k: v for k, v in flags.items() if v is not None and v != () and v != []}
    for name, value in given.items():
        layers[owner[name]][name] = value
    cfgs = {s: from_mapping(cls, layers[s], s) for s, cls in SECTIONS.items()}
    _check_contradictions(cfgs["speculative"], set(given) | set(speculative_json or {}))
    return RunConfig(sampling=cfgs["sampling"], engine=cfgs["engine"], spec=cfgs["speculative"])


def _check_contradictions(spec: SpecConfig, explicit: set[str]) -> None:
    """Options given on the command line that the resolved method would silently ignore."""
    if spec.method is Method.NONE:
        for name in ("num_speculative_tokens", "mtp_model", "mtp_copy", "ngram_min", "ngram_max", "ngram_pool"):
            if name in explicit:
                raise ConfigError(f"{name} has no effect with method 'none'; choose a method (ngram or mtp) "
                                  "or drop the option")
    for name in ("mtp_model", "mtp_copy"):
        if name in explicit and spec.method is not Method.MTP:
            raise ConfigError(f"{name} needs method 'mtp' (the method is {spec.method.value!r})")
