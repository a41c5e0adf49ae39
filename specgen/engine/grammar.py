"""Structured output: each constrained slot's grammar matcher (llguidance), the allowed-token masks of the
rows a step verifies, grammar-forced drafts, and drafts cut at the first token the grammar rejects.

A constraint is SamplingParams.response_format's canonical JSON (config.response_format). It compiles once per
process (grammar_of, Compiler.matcher): a million records with one schema compile it once, each slot taking a
copy of the compiled matcher in its start state.

Exactness under speculation: a verified row's mask is the grammar's state after the committed tokens and the
drafts before the row (a chain's earlier drafts; a tree node's ancestors), so each row is masked as plain
constrained decoding masks the position it stands for. Drafts are offered only up to the first one the
grammar rejects (a rejected draft could never be accepted: the row before it masks it out). The matcher
advances by the tokens a step keeps, never by drafts (it computes a draft's mask and rolls back).
"""
from __future__ import annotations

import functools
import json
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import llguidance
import numpy as np

from specgen.engine.types import DraftTokens
from specgen.models.tokenizer import TextTokenizer

# JSON as Python's json.dumps writes it ("a": 1, "b": 2): the spacing small chat models write, and no free
# whitespace (a model can loop on newlines where whitespace is free; every key and separator is then forced).
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@functools.lru_cache(maxsize=1024)
def grammar_of(spec: str) -> str:
    """The llguidance grammar of a canonical constraint (config.response_format); raises ValueError for a
    schema that is not a JSON object."""
    d = json.loads(spec)
    kind = d["type"]
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_STYLE)
    if kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(d["schema"], defaults=JSON_STYLE)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(d["regex"])
    if kind == "choice":
        return llguidance.grammar_from("choice", json.dumps(d["choice"]))
    return llguidance.grammar_from("grammar", d["grammar"])  # Lark, or GBNF (llama.cpp's)


@functools.lru_cache(maxsize=1024)
def grammar_error(spec: str) -> str | None:
    """Why a constraint does not compile (an invalid schema, regex or grammar), or None."""
    try:
        message = llguidance.LLMatcher.validate_grammar(grammar_of(spec))
    except ValueError as exc:
        message = str(exc)
    if not message or message.startswith("WARNING"):
        return None
    lines = [" ".join(line.split()) for line in message.strip().splitlines()]
    said = [lines[0]] + [line for line in lines[1:] if line.startswith("error:")]  # (a regex's own reason)
    return f"response_format: {' '.join(said)}"


@dataclass(frozen=True)
class ForcedDrafts:
    """The tokens each decoding slot's grammar forces next (none for unconstrained slots)."""

    ids: np.ndarray  # [num_dec, max_forced] int64
    num: np.ndarray  # [num_dec] int64


class Compiler:
    """A model's tokenizer as llguidance reads it, and the constraints compiled over it: one per (tokenizer,
    vocabulary, EOS) in the process, shared by its engines (reading the tokenizer took 0.2 s for the default
    model: a job of many small generate() calls paid it each time)."""

    # compiled constraints kept (the least recently used dropped): jobs with a schema per record
    COMPILED_KEPT = 256

    def __init__(self, tokenizer: TextTokenizer, vocab_size: int, eos_ids: tuple[int, ...]):
        self.tokenizer = llguidance.LLTokenizer(tokenizer.tokenizer.to_str(), n_vocab=vocab_size,
                                                eos_token=list(eos_ids))
        # a matcher in its start state per constraint, most recently used last
        self.compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()

    def matcher(self, spec: str) -> llguidance.LLMatcher:
        """`spec` compiled over this tokenizer (grammar_error(spec) is None), in its start state."""
        m = self.compiled.pop(spec, None)
        if m is None:
            m = llguidance.LLMatcher(self.tokenizer, grammar_of(spec), log_level=0)
            while len(self.compiled) >= self.COMPILED_KEPT:
                self.compiled.popitem(last=False)
        self.compiled[spec] = m
        return m


# {id(TextTokenizer): (a weak reference to it, {(vocab_size, eos_ids): Compiler})}
_compilers: dict[int, tuple[weakref.ref, dict[tuple, Compiler]]] = {}


def compiler_for(tokenizer: TextTokenizer, vocab_size: int, eos_ids: np.ndarray) -> Compiler:
    """The process's Compiler of `tokenizer` over a vocabulary of `vocab_size` ending at `eos_ids`; raises
    ValueError where llguidance cannot read the tokenizer."""
    ref, per = _compilers.get(id(tokenizer), (None, None))
    if ref is None or ref() is not tokenizer:
        ref, per = weakref.ref(tokenizer, lambda _, key=id(tokenizer): _compilers.pop(key, None)), {}
        _compilers[id(tokenizer)] = (ref, per)
    key = (vocab_size, tuple(int(e) for e in eos_ids))
    if key not in per:
        per[key] = Compiler(tokenizer, *key)
    return per[key]


class Grammars:
    """The constrained slots' matchers, over the model's vocabulary (a token id past the tokenizer's is never
    allowed)."""

    def __init__(self, tokenizer: TextTokenizer, vocab_size: int, eos_ids: np.ndarray, num_slots: int,
                 threads: int):
        self.compiler = compiler_for(tokenizer, vocab_size, eos_ids)
        self.vocab_size = vocab_size
        self.words = (self.compiler.tokenizer.vocab_size + 31) // 32  # int32 words of one mask
        self.matchers: list[llguidance.LLMatcher | None] = [None] * num_slots
        self.active = np.zeros(num_slots, bool)  # [num_slots] the slot's output is constrained
        self.num_forced = np.zeros(num_slots, np.int64)  # [num_slots] forced drafts accepted (statistics)
        self.executor = llguidance.LLExecutor(num_threads=threads)

    def compile_error(self, spec: str) -> str | None:
        """Why `spec` (grammar_error(spec) None) does not compile over this tokenizer (a special token it
        names that the vocabulary lacks), or None."""
        m = self.compiler.matcher(spec)
        return f"response_format: {m.get_error()}" if m.is_error() else None

    def place(self, slot: int, spec: str, output_ids: list[int]) -> str | None:
        """Constrain `slot` by `spec` (compile_error(spec) None), its matcher advanced by the output it holds
        already (a hand-off's first token); returns why that output breaks the grammar, or None."""
        m = self.compiler.matcher(spec).deep_copy()
        if output_ids and not m.consume_tokens(output_ids):
            return f"response_format: the output so far breaks the grammar ({m.get_error()})"
        self.matchers[slot], self.active[slot], self.num_forced[slot] = m, True, 0
        return None

    def release(self, slot: int) -> None:
        self.matchers[slot], self.active[slot] = None, False

    def forced(self, slots: np.ndarray, room: np.ndarray) -> ForcedDrafts:
        """The tokens the grammar allows alone next, up to `room` [n] per slot (none for slots not
        constrained)."""
        width = int(room.max(initial=0))
        ids, num = np.zeros((len(slots), width), np.int64), np.zeros(len(slots), np.int64)
        for i in np.nonzero(self.active[slots] & (room > 0))[0]:
            f = self.matchers[slots[i]].compute_ff_tokens()[: room[i]]
            ids[i, : len(f)], num[i] = f, len(f)
        return ForcedDrafts(ids, num)

    def cut(self, slots: np.ndarray, drafts: DraftTokens) -> np.ndarray:
        """[n] drafts each slot may verify: a chain's up to its first draft the grammar rejects, a tree's up
        to its first node whose path the grammar rejects (nodes after it dropped too: a kept prefix stays a
        tree)."""
        num = drafts.num_draft.copy()
        for i in np.nonzero(self.active[slots] & (num > 0))[0]:
            m, ids = self.matchers[slots[i]], drafts.draft_ids[i, : num[i]].tolist()
            if drafts.parents is None:
                num[i] = m.validate_tokens(ids)
                continue
            for node, path in enumerate(_paths(drafts.parents[i, : num[i]], ids)):
                if m.validate_tokens(path) < len(path):
                    num[i] = node
                    break
        return num

    def masks(self, slots: np.ndarray, first: np.ndarray, drafts: list[list[int]] | None,
              parents: np.ndarray | None, total: int) -> np.ndarray:
        """The allowed tokens of the rows a step verifies for constrained slots: [total, vocab] bool, row
        first[i] + j for slot i's block position j (its drafts[i] chain, or its tree's nodes with `parents`
        [n, width]); rows of no constrained slot all True."""
        bits = np.full((total, self.words), -1, np.int32)
        drafts = drafts if drafts is not None else [[] for _ in slots]
        ptr, size = bits.ctypes.data, self.words * 4
        roots = [(self.matchers[s], int(first[i])) for i, s in enumerate(slots)
                 if self.active[s] and not drafts[i]]
        if roots:  # no drafts: one mask each
            self.executor.unsafe_compute_mask_ptr(roots, ptr, size, total)
        chains = [(self.matchers[s], int(first[i]), drafts[i]) for i, s in enumerate(slots)
                  if self.active[s] and drafts[i] and parents is None]
        if chains:
            self.executor.unsafe_compute_mask_ptr_with_draft_token(chains, ptr, size, total)
        if parents is not None:
            for i, s in enumerate(slots):
                if self.active[s] and drafts[i]:
                    self._tree_masks(self.matchers[s], parents[i, : len(drafts[i])], drafts[i], bits,
                                     int(first[i]))
        allowed = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, : self.vocab_size]
        return allowed.astype(bool)

    def _tree_masks(self, m: llguidance.LLMatcher, parents: np.ndarray, ids: list[int], bits: np.ndarray,
                    first: int) -> None:
        """A tree's masks: its root's, then each node's after its path (consumed, masked, rolled back)."""
        m.unsafe_compute_mask_ptr(bits[first].ctypes.data, self.words * 4)
        for node, path in enumerate(_paths(parents, ids)):
            assert m.consume_tokens(path), "a tree node the grammar rejects was offered"
            m.unsafe_compute_mask_ptr(bits[first + 1 + node].ctypes.data, self.words * 4)
            m.rollback(len(path))

    def commit(self, slots: np.ndarray, emitted: np.ndarray, kept: np.ndarray,
               forced: np.ndarray | None) -> dict[int, str]:
        """Advance each constrained slot's matcher by the tokens its block kept ([n, width + 1], [n]);
        `forced` [n]: the forced drafts it verified (counted where accepted). Returns {slot: why} for a
        matcher the tokens broke (none should)."""
        broken = {}
        for i in np.nonzero(self.active[slots] & (kept > 0))[0]:
            s = int(slots[i])
            m = self.matchers[s]
            # one at a time: consume_tokens refuses EOS where consume_token takes it (llguidance 1.9)
            if not all(m.consume_token(tok) for tok in emitted[i, : kept[i]].tolist()):
                broken[s] = f"the output broke its response_format ({m.get_error()})"
            if forced is not None and i < len(forced):
                self.num_forced[s] += min(int(forced[i]), int(kept[i]) - 1)
        return broken


def ahead(forced: ForcedDrafts, drafts: DraftTokens) -> DraftTokens:
    """Forced tokens first, then the drafter's drafts (made after them): a chain continues them; a tree hangs
    from the last forced token (its root-children's parent), forced nodes scored 1."""
    n, f = len(forced.num), forced.num
    width = forced.ids.shape[1] + drafts.draft_ids.shape[1]
    ids = np.zeros((n, width), np.int64)
    ids[:, : forced.ids.shape[1]] = forced.ids
    row, col = np.nonzero(np.arange(drafts.draft_ids.shape[1])[None, :] < drafts.num_draft[:, None])
    ids[row, f[row] + col] = drafts.draft_ids[row, col]
    if drafts.parents is None:
        return DraftTokens(ids, f + drafts.num_draft, drafts.source)
    parents = np.zeros((n, width), np.int64)
    scores = (np.arange(width)[None, :] < f[:, None]).astype(np.float64)  # [n, width]
    parents[:, : forced.ids.shape[1]] = np.arange(forced.ids.shape[1])[None, :]
    parents[row, f[row] + col] = drafts.parents[row, col] + f[row]
    if drafts.scores is not None:
        scores[row, f[row] + col] = drafts.scores[row, col]
    return DraftTokens(ids, f + drafts.num_draft, drafts.source, parents,
                       None if drafts.scores is None else scores)


def _paths(parents: np.ndarray, ids: list[int]) -> list[list[int]]:
    """Each tree node's tokens from the root's first child down to it (parents [m]: block index of each node's
    parent, 0 the root; node j at block index j + 1)."""
    paths: list[list[int]] = []
    for j, p in enumerate(parents.tolist()):
        paths.append((paths[p - 1] if p else []) + [ids[j]])
    return paths
