"""A model loaded for a backend: its weights on the device, tokenizer and config (load_model), and prompts
encoded for it (encode_prompt)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specgen.config import EngineConfig
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


def load_model(path: str | Path | None = None, engine: EngineConfig | None = None,
               **settings: Any) -> LoadedModel:
    """Load an HF directory, a .gguf file, or (None) the default SmolLM2-135M-Instruct, with the runtime of
    `engine` (default EngineConfig()) and any EngineConfig field given by name (dtype="float64",
    backend=...)."""
    from specgen.backends import select_backend
    from specgen.models import load_checkpoint
    from specgen.models.model import Model

    unknown = sorted(set(settings) - {f.name for f in dataclasses.fields(EngineConfig)})
    if unknown:
        raise ConfigError(f"load_model: unknown setting(s) {', '.join(unknown)}")
    engine = dataclasses.replace(engine or EngineConfig(), **settings)
    ckpt = load_checkpoint(path, engine.cache_root(), engine.quantization)
    model = Model(ckpt, select_backend(engine))
    return LoadedModel(model=model, tokenizer=ckpt.tokenizer, config=ckpt.config, source=ckpt.source,
                       engine=engine)


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
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool)
                                                 for t in prompt):
        return tuple(int(t) for t in prompt)
    raise InputError(f"{where}: expected text, a list of chat messages, or a list of token ids")


def context_len(loaded: Any, engine_cfg: Any) -> int:
    """The engine's context: the model's, capped by max_model_len when that is set."""
    ctx = loaded.config.max_position_embeddings
    return min(ctx, engine_cfg.max_model_len) if engine_cfg.max_model_len else ctx
