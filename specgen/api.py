"""The Python API: load_model() and generate(), and make_engine() for the job and the workers."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Sequence

from specgen.config import EngineConfig, Method, SamplingParams, SpecConfig
from specgen.errors import InputError
from specgen.models.loaded import LoadedModel, encode_prompt, load_model


def generate(
    prompts: Sequence[Any],
    model: LoadedModel | str | Path | None = None,
    sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    engine: EngineConfig | None = None,
    speculative: SpecConfig | None = None,
    ids: Sequence[str] | None = None,
):
    """Complete every prompt; returns RequestOutputs in input order (a prompt's n samples one after another,
    by sample_index).

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
    encoded = [encode_prompt(loaded, p, f"prompt {i}") for i, p in enumerate(prompts)]
    requests = [Request(id=ids[i], index=i, prompt_ids=encoded[i], params=params[i], sample_index=j)
                for i in range(len(prompts)) for j in range(params[i].n)]
    outs = make_engine(loaded, engine, speculative).run(requests)
    return sorted(outs, key=lambda o: (o.index, o.sample_index))


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
