"""The heads `specgen train-head --kind` trains: one entry per kind, naming its trainer and the method that
runs what it saves. A new kind is one entry in KINDS (its trainer subclasses train.trainer.Trainer, so it
shares the data pipeline, windows, loop, checkpoints and loss curve)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specgen.errors import ConfigError
from specgen.train.config import TrainConfig


@dataclass(frozen=True)
class HeadKind:
    """How to train one kind of head and how to use the result."""

    trainer: Callable[..., Any]  # (loaded model, output dir, TrainConfig, data_dir) -> a Trainer
    method: str  # the --method that drafts with the saved head (--draft-model OUTPUT)
    saves: str  # the file the head is saved in, inside OUTPUT
    help: str  # one line for --help


def _mtp(loaded: Any, out_dir: Path, cfg: TrainConfig, data_dir: Path | None = None):
    from specgen.train.trainer import Trainer

    return Trainer(loaded, out_dir, cfg, data_dir)


def _medusa(loaded: Any, out_dir: Path, cfg: TrainConfig, data_dir: Path | None = None):
    from specgen.train.tree_heads import TreeHeadTrainer

    return TreeHeadTrainer(loaded, out_dir, cfg, data_dir)


def _hydra(loaded: Any, out_dir: Path, cfg: TrainConfig, data_dir: Path | None = None):
    from specgen.train.tree_heads import HydraTrainer

    return HydraTrainer(loaded, out_dir, cfg, data_dir)


def _eagle(loaded: Any, out_dir: Path, cfg: TrainConfig, data_dir: Path | None = None):
    from specgen.train.eagle import EagleTrainer

    return EagleTrainer(loaded, out_dir, cfg, data_dir)


KINDS: dict[str, HeadKind] = {
    "mtp": HeadKind(_mtp, "mtp", "model.safetensors",
                    "a DeepSeek-V3 MTP head: one decoder block over [embedding of the next token; "
                    "hidden state]"),
    "eagle": HeadKind(_eagle, "eagle", "model.safetensors",
                      "an EAGLE layer: fc over [embedding of the next token; feature], one decoder layer, "
                      "its output the next feature (dynamic token trees)"),
    "medusa": HeadKind(_medusa, "medusa", "medusa_lm_head.safetensors",
                       "--heads Medusa heads, residual blocks on the last hidden state, sharing the LM head"),
    "hydra": HeadKind(_hydra, "hydra", "hydra_lm_head.safetensors",
                      "--heads Hydra heads: Medusa's, head i also reading the embeddings of the path's "
                      "i + 1 tokens"),
}


def head_kind(name: str) -> HeadKind:
    """The entry of `name`, or a ConfigError listing the kinds."""
    if name not in KINDS:
        raise ConfigError(f"unknown head kind {name!r} (valid: {', '.join(KINDS)})")
    return KINDS[name]
