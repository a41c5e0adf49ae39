"""Proposers by method: config.DRAFTERS names each method's factory, given a Drafting (its own section of
SpecConfig, k, the checkpoint)."""
from __future__ import annotations

import importlib

from specgen.config import DRAFTERS, SpecConfig
from specgen.engine.proposers.base import Drafting, Proposer
from specgen.models.model import Model


def build_proposer(spec: SpecConfig, model: Model, lib=None, main=None) -> Proposer:
    """The proposer of spec.method for `model`; lib: ngram.cc's library (specgen.kernels.host_lib), None for
    the numpy references; main: the api.LoadedModel of `model` (a draft model loads with its settings, and its
    vocabulary is checked against its tokenizer)."""
    entry = DRAFTERS[spec.method]
    module, name = entry.factory.split(":")
    factory = getattr(importlib.import_module(module), name)
    section = getattr(spec, entry.section) if entry.section else None
    return factory(Drafting(spec.method, spec.num_speculative_tokens, section, spec.draft_model, model, lib,
                            main))
