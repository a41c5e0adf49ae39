"""The Python API: load_model() and generate()."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from specgen.config import EngineConfig, SamplingParams, SpecConfig, default_threads
from specgen.errors import InputError
from specgen.models.config import ModelConfig
from specgen.models.tokenizer import TextTokenizer


def set_threads(threads: int) -> int:
    """Use `threads` CPU threads (0: the cores available) for Paddle's kernels."""
    n = threads or default_threads()
    os.environ["OMP_NUM_THREADS"] = str(n)
    import paddle

    paddle.base.core.set_num_threads(n)
    return n


@dataclass
class LoadedModel:
    """A model ready to run: weights on the device, its tokenizer and config."""

    model: Any  # specgen.engine.model.Model
    tokenizer: TextTokenizer | None
    config: ModelConfig
    source: str


def load_model(path: str | Path | None = None, dtype: str = "float32", threads: int = 0,
               matmul: str = "float32") -> LoadedModel:
    """Load an HF directory, a .gguf file, or (None) the default SmolLM2-135M-Instruct. matmul "int8" multiplies
    by GGUF block-quantized weights with the inputs quantized to int8 (see EngineConfig.matmul)."""
    set_threads(threads)
    from specgen.engine.model import Model
    from specgen.models import load_checkpoint

    ckpt = load_checkpoint(path)
    model = Model(ckpt, dtype=dtype, matmul=matmul)
    return LoadedModel(model=model, tokenizer=ckpt.tokenizer, config=ckpt.config, source=ckpt.source)


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
    loaded = model if isinstance(model, LoadedModel) \
        else load_model(model, dtype=engine.dtype, threads=engine.threads, matmul=engine.matmul)
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
    eng = make_engine(loaded, engine, speculative)
    outputs = sorted(eng.run(requests), key=lambda o: o.index)
    return outputs


def iter_generate(loaded: LoadedModel, requests: Iterable, engine: EngineConfig, speculative: SpecConfig):
    """Stream outputs in completion order for an iterable of Requests (used by the CLI)."""
    return make_engine(loaded, engine, speculative).run(requests)


def make_engine(loaded: LoadedModel, engine: EngineConfig, speculative: SpecConfig):
    from specgen.config import Method
    from specgen.engine.proposers import build_proposer
    from specgen.engine.runner import Engine

    speculating = speculative.method is not Method.NONE
    return Engine(loaded.model, loaded.tokenizer, engine, build_proposer(speculative, loaded),
                  adaptive=speculating and speculative.adaptive, max_draft=speculative.num_speculative_tokens)
