"""The proposer protocol and the view of slot state proposers read."""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

import numpy as np

from specgen.engine.types import DraftTokens, StepUpdate


@dataclass(frozen=True)
class SlotView:
    """Read-only view of the decoding slots a proposer drafts for."""

    slots: np.ndarray  # [num_seqs] int64 cache rows of the decoding slots
    tokens: np.ndarray  # [num_slots, capacity] int64 prompt + output tokens of every slot
    seq_lens: np.ndarray  # [num_seqs] int64 valid tokens of each decoding slot
    max_draft: np.ndarray  # [num_seqs] int64 upper bound of drafts per slot this step


class Proposer(Protocol):
    """What the engine needs from a drafting method."""

    # The drafter's held-out acceptance of its first draft, when known (a trained head records it): before the
    # first step the controller rules speculation out where even that could not pay at the job's batch size.
    acceptance_hint: float | None
    # True where the drafter does nothing for slots the controller detached (a draft model, MTP-style layers
    # without copies, Medusa / Hydra heads): a step all of whose slots are detached then runs as plain
    # decoding does, with neither the proposer nor the controller called (their work was ~0.2 ms of a 4 ms
    # batch-1 step: 0.95x).
    # MTP with copies keeps copying for detached slots.
    idle_when_detached: bool
    # True where every draft the drafter offers counts toward detaching its slot (n-gram): while every slot is
    # detached from a job whose drafts do not pay, it is asked only on the controller's probes
    # (Controller.probing). MTP / EAGLE copies do not count (a slot detaches from the head's drafts).
    probes_when_detached: bool
    # True where detached slots still copy (MTP / EAGLE with copies, DraftTokens.source 1): while every slot
    # is detached and the job's copies do not pay, the drafter is asked only on the controller's probes.
    copies_when_detached: bool
    # A later sample of a request may copy its sample 0's prompt rows (the engine's n samples): the drafter
    # keeps no state of the prompt, or gives the sample sample 0's by an optional
    # copy_prompt(src slot, dst slot, prompt length). False: each sample prefills its prompt.
    clone_safe: bool

    def propose(self, view: SlotView) -> DraftTokens:
        """Drafts for the decoding slots of the coming step."""

    def observe(self, update: StepUpdate) -> None:
        """Called after each commit; stateless proposers ignore it."""


@dataclass(frozen=True)
class Drafting:
    """What a method's proposer factory (config.DRAFTERS[method].factory) is given."""

    method: Any  # config.Method
    k: int  # drafts per slot per step at most (--num-speculative-tokens; a token tree's depth)
    section: Any  # the method's own SpecConfig section (config.DRAFTERS[method].section), or None
    draft_model: str | None  # --draft-model
    model: Any  # models.model.Model: the model its drafts are verified by
    lib: Any = None  # ngram.cc's library (specgen.kernels.host_lib()); None: the numpy references
    main: Any = None  # the api.LoadedModel of `model` (a draft model loads with its settings)


def build_none(d: Drafting) -> "NoProposer":
    return NoProposer()


class NoProposer:
    """Plain decoding: no drafts."""

    acceptance_hint = None
    idle_when_detached = False
    probes_when_detached = False
    copies_when_detached = False
    clone_safe = True  # keeps no state of a slot's prompt: a sample may copy another's prompt rows
    context_only = True  # drafts from the slot's tokens alone: it may draft after a grammar's forced tokens

    def propose(self, view: SlotView) -> DraftTokens:
        return DraftTokens.none(len(view.slots), 0)

    def observe(self, update: StepUpdate) -> None:
        return None


# What drafters prepared per main model in this process: {model: {key: prepared}} (prepared_once)
_prepared: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def checkpoint_key(path: str | Path, *settings) -> tuple:
    """A drafter checkpoint as its files stand (its directory's file names and mtimes; a checkpoint file's
    directory, where its draft_vocab.npy lies), with the settings it is prepared under: a retrained head in
    the same directory is read again."""
    p = Path(path).resolve()
    d = p if p.is_dir() else p.parent
    files = tuple(sorted((f.name, f.stat().st_mtime_ns) for f in d.iterdir())) if d.is_dir() else ()
    return (str(p), files, *settings)


def prepared_once(model: Any, key: tuple, make: Callable[[], Any]) -> Any:
    """make() once per (main model, key) in this process, shared by every engine that drafts with it: loading
    a shipped head and preparing it for the model (packing, quantizing, its LM head's draft-vocabulary
    columns) took 60-110 ms per engine, a tenth of a 3-request batch-1 job (EAGLE ran 0.89x of plain
    decoding)."""
    per_model = _prepared.setdefault(model, {})
    if key not in per_model:
        per_model[key] = make()
    return per_model[key]
