"""The static batch's host-side state: one row per slot (cache row), and placing requests into slots."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from specgen.engine.types import Request, RequestOutput, RequestStats, sample_key
from specgen.layers.sampling import request_key

MAX_DRAFT = 5  # drafts per slot per step at most (FastDeploy's bound on num_speculative_tokens)

_DTYPES = {"active": bool, "prefilled": bool, "ignore_eos": bool, "logprobs": bool, "penalized": bool,
           "processed_logprobs": bool, "prompt_logprobs": bool,
           "repetition_penalty": np.float64, "presence_penalty": np.float64, "frequency_penalty": np.float64,
           "temperature": np.float64,
           "top_p": np.float64, "min_p": np.float64, "rng_key": np.uint64}


@dataclass
class SlotTable:
    """Host-side state of every slot, indexed by slot (cache row)."""

    tokens: np.ndarray  # [num_slots, capacity] int64 prompt + output
    seq_len: np.ndarray  # [num_slots] int64 valid tokens (KV is cached for all but the last)
    prompt_len: np.ndarray  # [num_slots] int64
    max_len: np.ndarray  # [num_slots] int64 prompt_len + max_tokens, capped by the context length
    active: np.ndarray  # [num_slots] bool
    prefilled: np.ndarray  # [num_slots] bool the whole prompt is in the cache
    prefill_pos: np.ndarray  # [num_slots] int64 prompt tokens already in the cache (chunked prefill)
    prefix_len: np.ndarray  # [num_slots] int64 leading positions read from the shared prefix cache
    temperature: np.ndarray  # [num_slots] float64
    top_p: np.ndarray  # [num_slots] float64
    top_k: np.ndarray  # [num_slots] int64
    min_p: np.ndarray  # [num_slots] float64
    rng_key: np.ndarray  # [num_slots] uint64
    ignore_eos: np.ndarray  # [num_slots] bool
    logprobs: np.ndarray  # [num_slots] bool the request asks for its tokens' log-probabilities
    top_logprobs: np.ndarray  # [num_slots] int64 and for this many most likely tokens' at each position
    processed_logprobs: np.ndarray  # [num_slots] bool of the distribution sampled from (logprobs_mode)
    prompt_logprobs: np.ndarray  # [num_slots] bool the request asks for its prompt tokens' log-probabilities
    prompt_top: np.ndarray  # [num_slots] int64 and for this many most likely tokens' at each prompt position
    penalized: np.ndarray  # [num_slots] bool its rows are processed (engine/penalties.py): any of the below,
    # or a logit bias
    repetition_penalty: np.ndarray  # [num_slots] float64
    presence_penalty: np.ndarray  # [num_slots] float64
    frequency_penalty: np.ndarray  # [num_slots] float64
    min_tokens: np.ndarray  # [num_slots] int64
    num_steps: np.ndarray  # [num_slots] int64
    num_draft: np.ndarray  # [num_slots] int64
    num_accepted: np.ndarray  # [num_slots] int64
    accepted_per_pos: np.ndarray  # [num_slots, MAX_DRAFT] int64
    drafted_per_pos: np.ndarray  # [num_slots, MAX_DRAFT] int64 steps that verified a draft at that position
    num_chunks: np.ndarray  # [num_slots] int64 prefill forwards
    num_cached: np.ndarray  # [num_slots] int64 prompt tokens read from a shared prefix (its statistic:
    # prefix_len is where the slot's own cache rows start, 0 once a hand-off gave it the prefix's rows as its
    # own)

    @classmethod
    def empty(cls, num_slots: int, capacity: int) -> "SlotTable":
        """Zeros for every field: int64 unless listed in _DTYPES; [num_slots] unless a second axis is
        listed."""
        second = {"tokens": capacity, "accepted_per_pos": MAX_DRAFT, "drafted_per_pos": MAX_DRAFT}
        return cls(**{f.name: np.zeros((num_slots, second[f.name]) if f.name in second else num_slots,
                                       dtype=_DTYPES.get(f.name, np.int64)) for f in dataclasses.fields(cls)})

    def grow(self, capacity: int) -> None:
        if capacity > self.tokens.shape[1]:
            new = np.zeros((self.tokens.shape[0], max(capacity, 2 * self.tokens.shape[1])), np.int64)
            new[:, : self.tokens.shape[1]] = self.tokens
            self.tokens = new

    def place(self, slot: int, req: Request, end: int, shared: int) -> None:
        """`req` into `slot`: its prompt, the position it may reach (`end`, exclusive), the leading prompt
        tokens read from the shared prefix (`shared`), its sampling parameters; statistics zeroed."""
        p, n = req.params, len(req.prompt_ids)
        self.grow(end + MAX_DRAFT + 1)
        self.tokens[slot, :n] = req.prompt_ids
        self.seq_len[slot] = self.prompt_len[slot] = n
        self.max_len[slot] = end
        self.active[slot], self.prefilled[slot] = True, False
        self.prefill_pos[slot] = self.prefix_len[slot] = self.num_cached[slot] = shared
        self.temperature[slot], self.top_p[slot], self.top_k[slot] = p.temperature, p.top_p, p.top_k
        self.min_p[slot] = p.min_p
        self.rng_key[slot] = request_key(p.seed, sample_key(req.id, req.sample_index))
        self.ignore_eos[slot] = p.ignore_eos
        self.logprobs[slot], self.top_logprobs[slot] = p.logprobs, p.top_logprobs
        self.processed_logprobs[slot] = p.logprobs_mode == "processed"
        self.prompt_logprobs[slot] = p.prompt_logprobs is not None
        self.prompt_top[slot] = p.prompt_logprobs or 0
        self.repetition_penalty[slot], self.presence_penalty[slot] = p.repetition_penalty, p.presence_penalty
        self.frequency_penalty[slot], self.min_tokens[slot] = p.frequency_penalty, p.min_tokens
        self.penalized[slot] = (p.repetition_penalty != 1 or p.presence_penalty != 0
                                or p.frequency_penalty != 0 or p.min_tokens > 0 or bool(p.logit_bias))
        for counts in (self.num_steps, self.num_draft, self.num_accepted, self.accepted_per_pos,
                       self.drafted_per_pos, self.num_chunks):
            counts[slot] = 0

    def output_ids(self, slot: int) -> list[int]:
        return self.tokens[slot, self.prompt_len[slot]: self.seq_len[slot]].tolist()

    def stats(self, slot: int) -> RequestStats:
        return RequestStats(
            num_steps=int(self.num_steps[slot]),
            num_draft_tokens=int(self.num_draft[slot]),
            num_accepted_tokens=int(self.num_accepted[slot]),
            num_emitted_tokens=int(self.seq_len[slot] - self.prompt_len[slot]),
            accepted_per_position=self.accepted_per_pos[slot].tolist(),
            drafted_per_position=self.drafted_per_pos[slot].tolist(),
            num_prefill_chunks=int(self.num_chunks[slot]),
            num_cached_prompt_tokens=int(self.num_cached[slot]),
        )

    def export_row(self, slot: int) -> dict[str, np.ndarray]:
        """Every field's entry for `slot` (copies; the token row up to its length): what another engine's
        table needs to carry the request on (import_row)."""
        row = {f.name: np.array(getattr(self, f.name)[slot]) for f in dataclasses.fields(self)}
        row["tokens"] = row["tokens"][: int(self.seq_len[slot])]
        return row

    def import_row(self, slot: int, row: dict[str, np.ndarray]) -> None:
        """`slot` takes export_row's fields."""
        self.grow(int(row["max_len"]) + MAX_DRAFT + 1)
        for name, value in row.items():
            if name == "tokens":
                self.tokens[slot, : len(value)] = value
            else:
                getattr(self, name)[slot] = value


@dataclass
class SlotLists:
    """A short list per slot (token ids, with a value each): padded rows, -1 past a slot's entries; grown to
    the longest list set, never shrunk (a request's logit bias, its stop token ids)."""

    ids: np.ndarray  # [num_slots, width] int64
    values: np.ndarray  # [num_slots, width] float64

    @classmethod
    def empty(cls, num_slots: int) -> "SlotLists":
        return cls(np.zeros((num_slots, 0), np.int64), np.zeros((num_slots, 0)))

    def set(self, slot: int, ids, values=None) -> None:
        """`slot`'s list: ids [m] (values [m], default 0)."""
        m, (n, w) = len(ids), self.ids.shape
        if m > w:
            ids_, values_ = np.full((n, m), -1, np.int64), np.zeros((n, m))
            ids_[:, :w], values_[:, :w] = self.ids, self.values
            self.ids, self.values = ids_, values_
        self.ids[slot], self.values[slot] = -1, 0.0
        self.ids[slot, :m] = ids
        if values is not None:
            self.values[slot, :m] = values


def rejection(req: Request, context_len: int, vocab_size: int) -> str | None:
    """Why `req` cannot run (an empty prompt, no room in the context, a token outside the vocabulary), or
    None."""
    n = len(req.prompt_ids)
    if n == 0:
        return "empty prompt"
    if n >= context_len:
        return f"prompt has {n} tokens; the model's context is {context_len} (room for none to generate)"
    bad = [t for t in req.prompt_ids if not 0 <= t < vocab_size]
    if bad:
        return f"token id {bad[0]} outside the vocabulary [0, {vocab_size})"
    p = req.params
    bad = [t for t in [*p.stop_token_ids, *(t for t, _ in p.logit_bias)] if not 0 <= t < vocab_size]
    if bad:
        return f"logit_bias or stop_token_ids: token id {bad[0]} outside the vocabulary [0, {vocab_size})"
    if req.params.n > 1 and req.sample_index >= req.params.n:
        return f"sample_index {req.sample_index} of n = {req.params.n}"
    return None


def error_output(req: Request, message: str) -> RequestOutput:
    return RequestOutput(req.id, req.index, "", [], None, len(req.prompt_ids), RequestStats(), error=message,
                         api=req.api, openai=req.openai, sample_index=req.sample_index,
                         num_samples=req.params.n)


def common_prefix(prompts: list) -> list[int]:
    """The longest token prefix every prompt starts with ([] for fewer than two prompts)."""
    if len(prompts) < 2:
        return []
    arrs = [np.asarray(p, dtype=np.int64) for p in prompts]
    n = min(len(a) for a in arrs)
    same = np.all(np.stack([a[:n] for a in arrs]) == arrs[0][:n], axis=0)  # [n]
    return arrs[0][: int(np.argmin(same)) if not same.all() else n].tolist()
