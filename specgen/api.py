"""The Python API: load_model() and generate()."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from specgen.config import EngineConfig, Method, SamplingParams, SpecConfig
from specgen.errors import ConfigError, InputError
from specgen.models.config import ModelConfig
from specgen.models.tokenizer import TextTokenizer


@dataclass
class LoadedModel:
    """A model ready to run: weights on the device, its tokenizer and config."""

    model: Any  # specgen.models.model.Model
    tokenizer: TextTokenizer | None
    config: ModelConfig
    source: str
    engine: EngineConfig  # the settings it was loaded with (LOAD_FIELDS)


def load_model(path: str | Path | None = None, engine: EngineConfig | None = None, **settings: Any) -> LoadedModel:
    """Load an HF directory, a .gguf file, or (None) the default SmolLM2-135M-Instruct, with the runtime of
    `engine` (default EngineConfig()) and any EngineConfig field given by name (dtype="float64", backend=...)."""
    from specgen.backends import select_backend
    from specgen.models import load_checkpoint
    from specgen.models.model import Model

    unknown = sorted(set(settings) - {f.name for f in dataclasses.fields(EngineConfig)})
    if unknown:
        raise ConfigError(f"load_model: unknown setting(s) {', '.join(unknown)}")
    engine = dataclasses.replace(engine or EngineConfig(), **settings)
    ckpt = load_checkpoint(path, engine.cache_root(), engine.quantization)
    model = Model(ckpt, select_backend(engine))
    return LoadedModel(model=model, tokenizer=ckpt.tokenizer, config=ckpt.config, source=ckpt.source, engine=engine)


def encode_prompt(loaded: LoadedModel, prompt: Any, where: str = "prompt") -> tuple[int, ...]:
    """A prompt is text, a list of chat messages (dicts with role/content), or a list of token ids."""
    tok = loaded.tokenizer
    if isinstance(prompt, str):
        if tok is None:
            raise InputError(f"{where}: this model has no tokenizer; give token ids")
        return tuple(tok.encode(prompt))
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
        if tok is None:
            raise InputError(f"{where}: this model has no tokenizer; give token ids")
        return tuple(tok.encode_chat(list(prompt)))
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return tuple(int(t) for t in prompt)
    raise InputError(f"{where}: expected text, a list of chat messages, or a list of token ids")


def generate(
    prompts: Sequence[Any],
    model: LoadedModel | str | Path | None = None,
    sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    engine: EngineConfig | None = None,
    speculative: SpecConfig | None = None,
    ids: Sequence[str] | None = None,
):
    """Complete every prompt; returns RequestOutputs in input order.

    `prompts`: text, chat messages, or token-id lists. `sampling`: one SamplingParams for all, or one each.
    """
    from specgen.engine.types import Request

    engine = engine or EngineConfig()
    speculative = speculative or SpecConfig()
    loaded = model if isinstance(model, LoadedModel) else load_model(model, engine)
    if sampling is None or isinstance(sampling, SamplingParams):
        params = [sampling or SamplingParams()] * len(prompts)
    else:
        params = list(sampling)
        if len(params) != len(prompts):
            raise InputError(f"got {len(params)} sampling params for {len(prompts)} prompts")
    ids = [str(i) for i in (ids if ids is not None else range(len(prompts)))]
    requests = [
        Request(id=ids[i], index=i, prompt_ids=encode_prompt(loaded, p, f"prompt {i}"), params=params[i])
        for i, p in enumerate(prompts)
    ]
    return sorted(make_engine(loaded, engine, speculative).run(requests), key=lambda o: o.index)


def iter_generate(loaded: LoadedModel, requests: Iterable, engine: EngineConfig, speculative: SpecConfig):
    """Stream outputs in completion order for an iterable of Requests."""
    return make_engine(loaded, engine, speculative).run(requests)


def make_engine(loaded: LoadedModel, engine: EngineConfig, speculative: SpecConfig,
                drafting: LoadedModel | None = None, engine_class: type | None = None, **extra: Any):
    """An engine over the loaded model with `engine`'s batch settings (its load settings are the model's:
    LoadedModel.engine) and the proposer of `speculative`, drafting beside `drafting` (default: `loaded`; a
    tensor-parallel rank 0 gives the full model, its engine's being a shard). engine_class: an Engine subclass
    (a prefill or decode worker's), given `extra` too."""
    from specgen import kernels
    from specgen.engine.engine import Engine
    from specgen.engine.proposers import build_proposer

    speculating = speculative.method is not Method.NONE
    runtime = loaded.engine
    lib = kernels.host_lib(runtime.cpu_target, runtime.cache_root()) if speculating else None
    drafting = drafting or loaded
    return (engine_class or Engine)(
        loaded.model, loaded.tokenizer, engine, build_proposer(speculative, drafting.model, lib, drafting),
        adaptive=speculating and speculative.adaptive, max_draft=speculative.num_speculative_tokens, **extra)
