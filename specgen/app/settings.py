"""Run settings: dataclass defaults < YAML file < --speculative-config < flags, resolved once.

YAML shape: up to four sections, each mapping onto one config dataclass (specgen/config.py), methods' own
settings nested under `speculative`:

    sampling:    {max_tokens, temperature, top_p, top_k, seed, stop, ignore_eos}             -> SamplingParams
    engine:      {batch_size, dtype, threads, device, backend, ..., kv_cache_dtype, matmul} -> EngineConfig
    speculative: {method, num_speculative_tokens, adaptive, draft_model, ngram: {min, max, pool, ...},
                  mtp: {...}, draft: {...}, medusa: {...}, eagle: {...}}                   -> SpecConfig
    parallel:    {data_parallel_size, ray, tensor_parallel_size, expert_parallel_size, pd}  -> ParallelConfig

Every field is also a flag of `specgen run` and `specgen bench`: a top-level field by its name (--batch-size),
a method's field with the method as prefix (--ngram-pool, --mtp-model).
"""
from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from specgen.config import (
    DRAFTERS,
    EngineConfig,
    Method,
    ParallelConfig,
    RunConfig,
    SamplingParams,
    SpecConfig,
    from_mapping,
    json_object,
)
from specgen.errors import ConfigError

SECTIONS: dict[str, type] = {"sampling": SamplingParams, "engine": EngineConfig, "speculative": SpecConfig,
                             "parallel": ParallelConfig}


@dataclass(frozen=True)
class Setting:
    """One config field as a flag: `flag` (python name; the CLI's --flag-name), where it lives, its type."""

    flag: str
    path: tuple[str, ...]  # (section, field) or (section, method section, field)
    type: Any
    default: Any
    help: str


def all_settings() -> list[Setting]:
    """Every config field, in the dataclasses' order."""
    out: list[Setting] = []

    def walk(cls: type, path: tuple[str, ...], prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                walk(hints[f.name], path + (f.name,), f"{f.name}_")
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            out.append(Setting(prefix + f.name, path + (f.name,), hints[f.name], default,
                               f.metadata.get("help", "")))

    for section, cls in SECTIONS.items():
        walk(cls, (section,), "")
    names = [s.flag for s in out]
    assert len(set(names)) == len(names), "config field names must be unique as flags"
    return out


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
    sections = check_sections(data if data is not None else {}, str(p))
    for name, values in sections.items():
        from_mapping(SECTIONS[name], values, f"{p}: {name}")  # unknown keys at any depth, bad values: now
    return sections


def check_sections(data: Any, where: str) -> dict[str, dict[str, Any]]:
    """Validate the {section: {field: value}} shape; unknown sections are errors naming the valid ones."""
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
        out[section] = dict(values)
    return out


def parse_speculative_config(value: str) -> dict[str, Any]:
    """FastDeploy-style JSON, inline or in a file:
    {"method": "mtp", "num_speculative_tokens": 1, "model": path} ("model" is the drafter's checkpoint:
    resolve() makes it the resolved method's own `model` setting); otherwise the speculative section's keys,
    methods' settings nested ({"method": "ngram", "ngram": {"pool": 0}})."""
    data, where = json_object("--speculative-config", value)
    if "model" in data and not isinstance(data["model"], str):
        raise ConfigError(f"{where}: \"model\" must be a checkpoint path")
    # unknown keys and bad values: an error naming them, now
    checked = {k: v for k, v in data.items() if k != "model"}
    if "model" in data:
        checked["draft_model"] = data["model"]
    from_mapping(SpecConfig, checked, where)
    return data


def _with_model(model: str, method: Method) -> None:
    """Check that the method takes a checkpoint (FastDeploy JSON's "model")."""
    if not DRAFTERS[method].checkpoint:
        names = ", ".join(m.value for m, d in DRAFTERS.items() if d.checkpoint)
        raise ConfigError(f"--speculative-config: \"model\" ({model}) needs a method that drafts with a "
                          f"checkpoint ({names}), the method is {method.value!r}")


def resolve(yaml_sections: Mapping[str, Mapping[str, Any]] | None, flags: Mapping[str, Any],
            speculative_json: Mapping[str, Any] | None = None,
            methods: set[Method] | None = None) -> RunConfig:
    """Merge the layers (a flag of None means "not given") and build the dataclasses. `flags` are keyed by
    Setting.flag; a key that is no setting is a programming error. `methods`: the methods the settings serve
    (`specgen bench` runs several; default: the resolved one), for the check that none is ignored."""
    by_flag = {s.flag: s for s in all_settings()}
    layers: dict[str, dict[str, Any]] = {s: _copy(dict((yaml_sections or {}).get(s, {}))) for s in SECTIONS}
    js = dict(speculative_json or {})
    model = js.pop("model", None)
    _merge(layers["speculative"], js)
    given = {k: v for k, v in flags.items() if v is not None and v != () and v != []}
    if model is not None:  # the drafter's checkpoint, below the flags: mtp.model for mtp, else draft_model
        method = Method.parse(given.get("method", layers["speculative"].get("method", Method.NONE)))
        _with_model(model, method)
        if method is Method.MTP:
            layers["speculative"].setdefault("mtp", {})["model"] = model
            js.setdefault("mtp", {})["model"] = model
        else:
            layers["speculative"]["draft_model"] = model
            js["draft_model"] = model
    for name, value in given.items():
        path = by_flag[name].path
        node = layers[path[0]]
        for key in path[1:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    cfgs = {s: from_mapping(cls, layers[s], s) for s, cls in SECTIONS.items()}
    explicit = {by_flag[name].path for name in given} | _paths(("speculative",), js)
    _check_contradictions(cfgs["speculative"], explicit, methods)
    return RunConfig(sampling=cfgs["sampling"], engine=cfgs["engine"], spec=cfgs["speculative"],
                     parallel=cfgs["parallel"])


def _copy(d: dict) -> dict:
    return {k: _copy(v) if isinstance(v, dict) else v for k, v in d.items()}


def _merge(into: dict, layer: Mapping[str, Any]) -> None:
    for k, v in layer.items():
        if isinstance(v, Mapping) and isinstance(into.get(k), dict):
            _merge(into[k], v)
        else:
            into[k] = _copy(dict(v)) if isinstance(v, Mapping) else v


def _paths(prefix: tuple[str, ...], d: Mapping[str, Any]) -> set[tuple[str, ...]]:
    out: set[tuple[str, ...]] = set()
    for k, v in d.items():
        out |= _paths(prefix + (k,), v) if isinstance(v, Mapping) else {prefix + (k,)}
    return out


def _check_contradictions(spec: SpecConfig, explicit: set[tuple[str, ...]],
                          methods: set[Method] | None) -> None:
    """Speculative settings given on the command line that the methods run would silently ignore (`adaptive`
    is harmless anywhere)."""
    methods = methods or {spec.method}
    sections = {DRAFTERS[m].section for m in methods}
    named = ", ".join(sorted(m.value for m in methods))
    for path in sorted(explicit):
        if path[0] != "speculative" or len(path) < 2 or path[1] in ("method", "adaptive"):
            continue
        name = ".".join(path[1:])
        if methods == {Method.NONE}:
            raise ConfigError(f"{name} has no effect with method 'none'; choose a method "
                              f"({', '.join(m.value for m in Method if m is not Method.NONE)})"
                              " or drop the option")
        if len(path) > 2 and path[1] not in sections:
            raise ConfigError(f"{name} needs method {path[1]!r} (the method is {named!r})")
        if path[1] == "draft_model" and not any(DRAFTERS[m].checkpoint for m in methods):
            raise ConfigError(f"draft_model needs method draft_model or mtp (the method is {named!r})")
