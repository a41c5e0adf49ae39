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
    # main-model blocks whose inputs the training data keeps after each hidden state, for a model of config
    # `cfg` (EAGLE-3's features); None: the hidden state only
    features: Callable[[Any], tuple[int, ...]] | None = None


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


def _eagle3(loaded: Any, out_dir: Path, cfg: TrainConfig, data_dir: Path | None = None):
    from specgen.train.eagle3 import Eagle3Trainer

    return Eagle3Trainer(loaded, out_dir, cfg, data_dir)


def _eagle3_features(config: Any) -> tuple[int, ...]:
    from specgen.drafters.eagle3 import default_features

    return default_features(config.num_layers)


KINDS: dict[str, HeadKind] = {
    "mtp": HeadKind(_mtp, "mtp", "model.safetensors",
                    "a DeepSeek-V3 MTP head: one decoder block over [embedding of the next token; "
                    "hidden state]"),
    "eagle": HeadKind(_eagle, "eagle", "model.safetensors",
                      "an EAGLE layer: fc over [embedding of the next token; feature], one decoder layer, "
                      "its output the next feature (dynamic token trees)"),
    "eagle3": HeadKind(_eagle3, "eagle3", "model.safetensors",
                       "an EAGLE-3 layer: fc over the main model's states at three depths, one decoder layer "
                       "over [embedding; feature], trained on its own outputs (dynamic token trees)",
                       _eagle3_features),
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
