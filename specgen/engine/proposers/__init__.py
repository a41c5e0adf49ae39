"""Proposers by method: every Method has one factory here, reading its own section of SpecConfig."""
from __future__ import annotations

from typing import Callable

from specgen.config import Method, SpecConfig
from specgen.engine.proposers.base import NoProposer, Proposer
from specgen.models.model import Model


def _none(spec: SpecConfig, model: Model, lib, main) -> Proposer:
    return NoProposer()


def _ngram(spec: SpecConfig, model: Model, lib, main) -> Proposer:
    from specgen.engine.proposers.ngram import NgramProposer

    c = spec.ngram
    return NgramProposer(spec.num_speculative_tokens, c.min, c.max, c.pool, lib, c.branches, c.tree_paths())


def _mtp(spec: SpecConfig, model: Model, lib, main) -> Proposer:
    from specgen.engine.proposers.mtp import build_mtp_proposer

    return build_mtp_proposer(spec, model, lib)


def _draft_model(spec: SpecConfig, model: Model, lib, main) -> Proposer:
    from specgen.engine.proposers.draft_model import build_draft_model_proposer

    return build_draft_model_proposer(spec, model, main)


def _medusa(spec: SpecConfig, model: Model, lib, main) -> Proposer:
    from specgen.engine.proposers.medusa import build_medusa_proposer

    return build_medusa_proposer(spec, model)


def _hydra(spec: SpecConfig, model: Model, lib, main) -> Proposer:
    from specgen.engine.proposers.hydra import build_hydra_proposer

    return build_hydra_proposer(spec, model)


def _eagle(spec: SpecConfig, model: Model, lib, main) -> Proposer:
    from specgen.engine.proposers.eagle import build_eagle_proposer

    return build_eagle_proposer(spec, model, lib)


def _eagle3(spec: SpecConfig, model: Model, lib, main) -> Proposer:
    from specgen.engine.proposers.eagle import build_eagle_proposer

    return build_eagle_proposer(spec, model, lib, eagle3=True)


# method -> factory(spec, model, ngram.cc's library or None, the main LoadedModel or None)
REGISTRY: dict[Method, Callable[[SpecConfig, Model, object, object], Proposer]] = {
    Method.NONE: _none,
    Method.NGRAM: _ngram,
    Method.MTP: _mtp,
    Method.DRAFT_MODEL: _draft_model,
    Method.MEDUSA: _medusa,
    Method.EAGLE: _eagle,
    Method.HYDRA: _hydra,
    Method.EAGLE3: _eagle3,
}
assert set(REGISTRY) == set(Method), "every method needs a proposer"


def build_proposer(spec: SpecConfig, model: Model, lib=None, main=None) -> Proposer:
    """The proposer of spec.method for `model`; lib: ngram.cc's library (specgen.kernels.host_lib), None for
    the numpy references; main: the api.LoadedModel of `model` (a draft model loads with its settings, and its
    vocabulary is checked against its tokenizer)."""
    return REGISTRY[spec.method](spec, model, lib, main)
