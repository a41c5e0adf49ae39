"""Input records -> engine Requests: tokenize in the reader so that every error names its line or row."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Container, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from specgen.config import SamplingParams
from specgen.engine.grammar import grammar_error
from specgen.engine.types import Request, sample_key
from specgen.errors import ConfigError, InputError
from specgen.io.ids import SeenIds
from specgen.io.readers import RawRecord
from specgen.io.records import InputRecord, RecordError, parse_record

Encode = Callable[[Any, str], "tuple[int, ...]"]
# Called with (record id, message naming the line, number of prompt tokens or None, whether the record is an
# OpenAI Batch line) for each bad record.
OnBad = Callable[[str, str, "int | None", bool], None]
@dataclass
class RequestSource:
    """Iterable of Requests, pulled lazily by the engine; bad records go to `on_bad` (None: raise InputError).

    A record's id defaults to its 1-based line/row number; ids in `done_ids` (a resumed run) are skipped.
    A record with n samples yields n Requests (sample_index 0..n-1); done_ids holds samples (sample_key), and
    only those not done are yielded.
    """

    records: Iterable[RawRecord]
    encode: Encode  # (prompt, where) -> token ids; raises InputError
    sampling: SamplingParams  # the run's defaults; a record's own fields override them
    context_len: int  # a prompt must leave room for at least one generated token
    vocab_size: int
    unit: str = "line"
    done_ids: Container[str] = frozenset()
    on_bad: OnBad | None = None
    max_n: int = 0  # the most samples a record may ask for (the batch size; 0: any)
    num_skipped: int = 0  # samples skipped because they were already done
    _seen: SeenIds = field(default_factory=SeenIds, repr=False)

    def __iter__(self) -> Iterator[Request]:
        for raw in self.records:
            where = f"{self.unit} {raw.number}"
            default_id = str(raw.number)
            try:
                req = self._request(raw, where, default_id)
            except RecordError as exc:
                rid = exc.record_id or default_id
                if rid in self.done_ids:
                    self.num_skipped += 1
                    continue
                self._bad(rid, f"{where}: {exc}", exc.num_prompt_tokens, exc.openai)
                continue
            if req is not None:
                for j in range(req.params.n):
                    if j and sample_key(req.id, j) in self.done_ids:
                        self.num_skipped += 1
                    elif j == 0 and req.id in self.done_ids:
                        self.num_skipped += 1
                    else:
                        yield dataclasses.replace(req, sample_index=j) if j else req

    def _request(self, raw: RawRecord, where: str, default_id: str) -> Request | None:
        """None when the record was already done; raises RecordError for a bad one."""
        if raw.error is not None:
            raise RecordError(raw.error)
        rec = parse_record(raw.value, default_id)
        try:
            return self._checked(rec, raw, where)
        except RecordError as exc:
            exc.openai = rec.openai
            raise

    def _checked(self, rec: InputRecord, raw: RawRecord, where: str) -> Request | None:
        """_request's checks of a parsed record, and its Request (sample 0)."""
        if rec.id in self.done_ids and not dict(rec.overrides).get("n", self.sampling.n) > 1:
            self.num_skipped += 1
            return None
        if rec.id in self._seen:
            raise RecordError(f"duplicate id {rec.id!r}", rec.id)
        self._seen.add(rec.id, raw.number)
        params = self.sampling
        if rec.overrides:
            try:
                params = dataclasses.replace(self.sampling, **dict(rec.overrides))
            except ConfigError as exc:
                raise RecordError(str(exc), rec.id) from None
        try:
            ids = tuple(self.encode(rec.prompt, where))
        except InputError as exc:
            raise RecordError(str(exc).removeprefix(f"{where}: "), rec.id) from None
        self._check_ids(ids, rec.id)
        self._check_params(params, rec.id)
        return Request(id=rec.id, index=raw.number, prompt_ids=ids, params=params, api=rec.api,
                       openai=rec.openai)

    def _check_ids(self, ids: tuple[int, ...], record_id: str) -> None:
        """The engine's own admission checks, made here so that the message names the line."""
        n = len(ids)
        if n == 0:
            raise RecordError("empty prompt (no tokens)", record_id)
        if n >= self.context_len:
            raise RecordError(f"prompt has {n} tokens; the model's context is {self.context_len} "
                              "(room for none to generate)", record_id, n)
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise RecordError(f"token id {bad} outside the vocabulary [0, {self.vocab_size})", record_id, n)

    def _check_params(self, params: SamplingParams, record_id: str) -> None:
        why = grammar_error(params.response_format) if params.response_format else None
        if why is not None:
            raise RecordError(why, record_id)
        if self.max_n and params.n > self.max_n:
            raise RecordError(f"n = {params.n} samples is more than the batch's {self.max_n} slots",
                              record_id)
        bad = next((t for t in params.stop_token_ids if t >= self.vocab_size), None)
        if bad is not None:
            raise RecordError(f"stop_token_ids: token id {bad} outside the vocabulary [0, {self.vocab_size})",
                              record_id)
        bad = next((t for t, _ in params.logit_bias if t >= self.vocab_size), None)
        if bad is not None:
            raise RecordError(f"logit_bias: token id {bad} outside the vocabulary [0, {self.vocab_size})",
                              record_id)

    def _bad(self, record_id: str, message: str, num_prompt_tokens: int | None, openai: bool) -> None:
        if self.on_bad is None:
            raise InputError(message)
        self.on_bad(record_id, message, num_prompt_tokens, openai)
