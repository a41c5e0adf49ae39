"""The step loop: admit, propose, one packed forward, sample + verify all slots at once, commit."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Iterable, Iterator

import numpy as np

from specgen.config import EngineConfig
from specgen.engine import cost_cache
from specgen.engine.adaptive import Controller, CostModel
from specgen.engine.kv_cache import KVCache
from specgen.engine.model import Model
from specgen.engine.proposers.base import NoProposer, Proposer, SlotView
from specgen.engine.sampling import request_key, sample, uniforms
from specgen.engine.scheduler import Scheduler
from specgen.engine.types import Request, RequestOutput, RequestStats, StepUpdate, build_forward_batch
from specgen.engine.verify import accept_lengths, first_stop
from specgen.errors import ConfigError
from specgen.models.tokenizer import TextTokenizer

MAX_DRAFT = 5


_DTYPES = {"active": bool, "prefilled": bool, "ignore_eos": bool, "temperature": np.float64, "top_p": np.float64,
           "rng_key": np.uint64}


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
    rng_key: np.ndarray  # [num_slots] uint64
    ignore_eos: np.ndarray  # [num_slots] bool
    num_steps: np.ndarray  # [num_slots] int64
    num_draft: np.ndarray  # [num_slots] int64
    num_accepted: np.ndarray  # [num_slots] int64
    accepted_per_pos: np.ndarray  # [num_slots, MAX_DRAFT] int64
    drafted_per_pos: np.ndarray  # [num_slots, MAX_DRAFT] int64 steps that verified a draft at that position
    num_chunks: np.ndarray  # [num_slots] int64 prefill forwards

    @classmethod
    def empty(cls, num_slots: int, capacity: int) -> "SlotTable":
        """Zeros for every field: int64 unless listed in _DTYPES; [num_slots] unless a second axis is listed."""
        second = {"tokens": capacity, "accepted_per_pos": MAX_DRAFT, "drafted_per_pos": MAX_DRAFT}
        return cls(**{f.name: np.zeros((num_slots, second[f.name]) if f.name in second else num_slots,
                                       dtype=_DTYPES.get(f.name, np.int64)) for f in dataclasses.fields(cls)})

    def grow(self, capacity: int) -> None:
        if capacity > self.tokens.shape[1]:
            new = np.zeros((self.tokens.shape[0], max(capacity, 2 * self.tokens.shape[1])), np.int64)
            new[:, : self.tokens.shape[1]] = self.tokens
            self.tokens = new


class Engine:
    """Generates completions for a stream of requests with a static batch of slots."""

    def __init__(self, model: Model, tokenizer: TextTokenizer | None, config: EngineConfig,
                 proposer: Proposer | None = None, adaptive: bool = False, max_draft: int = MAX_DRAFT):
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.proposer = proposer or NoProposer()
        ctx = model.config.max_position_embeddings
        self.context_len = min(ctx, config.max_model_len) if config.max_model_len else ctx
        self.eos_ids = np.array(model.config.eos_token_ids, dtype=np.int64)
        loaded = "int8" if model.int8_product else "float32"
        if config.matmul != loaded:
            raise ConfigError(f"the model was loaded with matmul {loaded!r}, the engine asks for "
                              f"{config.matmul!r}: load it with load_model(..., matmul={config.matmul!r})")
        self.cache = model.new_cache(config.batch_size, self.context_len, config.kv_cache_dtype)
        self.table = SlotTable.empty(config.batch_size, 256)
        self.requests: list[Request | None] = [None] * config.batch_size
        self.adaptive, self.max_draft = adaptive, max_draft
        self.controller: Controller | None = None  # with `adaptive`, made when the first run starts (_start)
        self.prefix_ids: np.ndarray | None = None  # [prefix_tokens] the shared prefix, once computed
        self.prefix_hidden = None  # paddle [prefix_tokens, hidden]

    def _start(self, num_requests: int) -> None:
        """The adaptive controller, its step costs measured with as many slots as the job will fill at first
        (a job of 8 requests in 32 slots times 8-slot steps: 4x cheaper start-up, and the costs it will see)."""
        active = max(1, min(self.config.batch_size, num_requests))
        self.controller = calibrate(self.model, self.cache, self.max_draft, active)
        self.controller.rule_out(getattr(self.proposer, "acceptance_hint", None), active)

    # ---- admission and retirement (per request, outside the step's hot path) ----

    def _reject(self, req: Request) -> RequestOutput | None:
        n = len(req.prompt_ids)
        if n == 0:
            return _error_output(req, "empty prompt")
        if n >= self.context_len:
            return _error_output(
                req, f"prompt has {n} tokens; the model's context is {self.context_len} (room for none to generate)"
            )
        bad = [t for t in req.prompt_ids if not 0 <= t < self.model.config.vocab_size]
        if bad:
            return _error_output(req, f"token id {bad[0]} outside the vocabulary [0, {self.model.config.vocab_size})")
        return None

    def _place(self, slot: int, req: Request) -> None:
        t, p, n = self.table, req.params, len(req.prompt_ids)
        end = min(n + p.max_tokens, self.context_len)  # the request's last position + 1
        t.grow(end + MAX_DRAFT + 1)
        self.cache.admit(n + MAX_DRAFT + 1, end + MAX_DRAFT + 1)
        t.tokens[slot, :n] = req.prompt_ids
        t.seq_len[slot] = n
        t.prompt_len[slot] = n
        t.max_len[slot] = end
        # A prompt that starts with the shared prefix skips it (keeping at least one token of its own to prefill).
        shared = 0
        if self.prefix_ids is not None and n > 1 and len(self.prefix_ids) <= n:
            if np.array_equal(self.prefix_ids, req.prompt_ids[: len(self.prefix_ids)]):
                shared = min(len(self.prefix_ids), n - 1)
        t.active[slot], t.prefilled[slot] = True, False
        t.prefill_pos[slot] = t.prefix_len[slot] = shared
        t.temperature[slot], t.top_p[slot], t.top_k[slot] = p.temperature, p.top_p, p.top_k
        t.rng_key[slot] = request_key(p.seed, req.id)
        t.ignore_eos[slot] = p.ignore_eos
        t.num_steps[slot] = t.num_draft[slot] = t.num_accepted[slot] = 0
        t.accepted_per_pos[slot] = t.drafted_per_pos[slot] = 0
        t.num_chunks[slot] = 0
        self.requests[slot] = req
        if self.controller is not None:
            self.controller.reset(slot)

    def _finish(self, slot: int, reason: str, text_cut: str | None) -> RequestOutput:
        t, req = self.table, self.requests[slot]
        out_ids = t.tokens[slot, t.prompt_len[slot] : t.seq_len[slot]].tolist()
        text = text_cut if text_cut is not None else self._decode(out_ids)
        stats = RequestStats(
            num_steps=int(t.num_steps[slot]),
            num_draft_tokens=int(t.num_draft[slot]),
            num_accepted_tokens=int(t.num_accepted[slot]),
            num_emitted_tokens=len(out_ids),
            accepted_per_position=t.accepted_per_pos[slot].tolist(),
            drafted_per_position=t.drafted_per_pos[slot].tolist(),
            num_prefill_chunks=int(t.num_chunks[slot]),
            num_cached_prompt_tokens=int(t.prefix_len[slot]),
        )
        t.active[slot] = False
        self.requests[slot] = None
        return RequestOutput(req.id, req.index, text, out_ids, reason, int(t.prompt_len[slot]), stats)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    # ---- the loop ----

    def run(self, requests: Iterable[Request]) -> Iterator[RequestOutput]:
        """Yields outputs as requests finish (completion order)."""
        sched = Scheduler(requests, self.config.batch_size, self.config.max_prefill_tokens, self.config.prefill_chunk)
        if self.config.shared_prefix == "auto" and self.prefix_ids is None:
            self.share_prefix(common_prefix([r.prompt_ids for r in sched.peek(self.config.batch_size)]))
        if self.adaptive and self.controller is None:
            self._start(len(sched.peek(self.config.batch_size)))
        while sched.has_work(int(self.table.active.sum())):
            for slot, req in sched.admit():
                err = self._reject(req)
                if err is not None:
                    sched.retire(slot)
                    yield err
                else:
                    self._place(slot, req)
            if not self.table.active.any():
                continue
            for out, slot in self.step():
                sched.retire(slot)
                yield out

    def step(self) -> list[tuple[RequestOutput, int]]:
        """One forward for every active slot: prefill blocks (or prompt chunks) of new slots, [last + drafts] of
        decoding ones."""
        t = self.table
        step_start = time.perf_counter()
        dec = np.nonzero(t.active & t.prefilled)[0]  # [num_dec]
        new, chunk = self._prefill_chunks()  # [num_new] slots prefilling this step and their chunk lengths
        final = t.prefill_pos[new] + chunk == t.prompt_len[new]  # [num_new] chunk ends the prompt: sample
        room = t.max_len - t.seq_len  # [num_slots] tokens each slot may still emit (>= 1 while active)
        view = SlotView(dec, t.tokens, t.seq_len[dec], np.minimum(room[dec] - 1, MAX_DRAFT))
        draft_start = time.perf_counter()
        drafts = self.proposer.propose(view)
        draft_seconds = time.perf_counter() - draft_start
        num_avail = np.minimum(drafts.num_draft, view.max_draft)  # [num_dec]
        num_draft = num_avail
        if self.controller is not None:
            num_draft = np.minimum(num_avail, self.controller.choose(dec, num_avail, int(chunk.sum()), drafts.source))
        width = drafts.draft_ids.shape[1]

        # Packed tokens: decoding blocks [last, drafts...] first, then the new slots' prompts.
        dec_blocks = np.concatenate([t.tokens[dec, t.seq_len[dec] - 1][:, None], drafts.draft_ids], axis=1)
        dec_mask = np.arange(width + 1)[None, :] <= num_draft[:, None]  # [num_dec, width + 1]
        col_all = np.arange(t.tokens.shape[1])[None, :]
        new_start = t.prefill_pos[new]
        first_block = new_start == t.prefix_len[new]  # [num_new] the slot's first block (after any shared prefix)
        new_mask = (col_all >= new_start[:, None]) & (col_all < (new_start + chunk)[:, None])
        token_ids = np.concatenate([dec_blocks[dec_mask], t.tokens[new][new_mask]])
        slots = np.concatenate([dec, new])
        lens = np.concatenate([num_draft + 1, chunk])
        starts = np.concatenate([t.seq_len[dec] - 1, new_start])
        logits_all = np.concatenate([np.ones(len(dec), bool), np.zeros(len(new), bool)])
        no_logits = np.concatenate([np.zeros(len(dec), bool), ~final])
        batch = build_forward_batch(slots, starts, lens, token_ids, logits_all, no_logits=no_logits,
                                    prefix_lens=t.prefix_len[slots] if self.prefix_ids is not None else None)
        # A step whose slots are all greedy needs no logits (Model.forward_greedy: a screened LM head skips them).
        logits, hidden, greedy = self.model.forward_greedy(batch, self.cache, logits=bool(t.temperature[slots].any()))

        row_tok = batch.logit_rows  # [num_logits]
        row_slot = batch.token_slots[row_tok]
        temperature = t.temperature[row_slot]
        u = None
        if temperature.any():  # sampled rows: their uniforms
            u = uniforms(t.rng_key[row_slot], batch.positions[row_tok] + 1 - t.prompt_len[row_slot])
        targets = sample(logits, temperature, t.top_k[row_slot], t.top_p[row_slot], u, greedy)
        if self.controller is not None:
            self.controller.cost.observe(len(batch.token_ids), time.perf_counter() - step_start)

        # Targets back into [num_seqs, width + 1]: decode rows are the first sum(num_draft + 1) logit rows.
        emitted = np.zeros((len(slots), width + 1), np.int64)
        emitted[: len(dec)][dec_mask] = targets[: int(dec_mask.sum())]
        emitted[len(dec):, 0][final] = targets[int(dec_mask.sum()):]
        accepted = accept_lengths(drafts.draft_ids, num_draft, emitted[: len(dec)])
        num_emitted = np.concatenate([accepted + 1, final.astype(np.int64)])  # a mid-prompt chunk emits nothing
        kept, by_eos = first_stop(emitted, num_emitted, self.eos_ids, room[slots], t.ignore_eos[slots])
        by_stop, texts = self._stop_strings(slots, emitted, kept)
        if self.controller is not None:
            self.controller.update(dec, drafts.draft_ids, num_avail, emitted[: len(dec)], kept[: len(dec)],
                                   drafts.source)

        # Commit: tokens, lengths, statistics.
        col = np.arange(width + 1)[None, :]
        keep_mask = col < kept[:, None]
        rows = np.repeat(slots, kept)
        t.tokens[rows, (t.seq_len[slots][:, None] + col)[keep_mask]] = emitted[keep_mask]
        t.seq_len[slots] += kept
        t.prefill_pos[new] += chunk
        t.prefilled[new] = final
        t.num_chunks[new] += 1
        produced = np.concatenate([np.ones(len(dec), np.int64), final.astype(np.int64)])  # steps that emit
        t.num_steps[slots] += produced
        t.num_draft[dec] += num_draft
        t.num_accepted[slots] += kept - produced
        if width:
            t.accepted_per_pos[slots, :width] += (col[:, :width] < (kept - 1)[:, None])
            t.drafted_per_pos[dec, :width] += (col[:, :width] < num_draft[:, None])
        done = by_eos | by_stop | (t.seq_len[slots] >= t.max_len[slots])
        all_drafts = np.concatenate([num_draft, np.zeros(len(new), np.int64)])
        block_start = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
        # positions whose input was right and whose next token is known (a mid-prompt chunk: all of them)
        num_valid = np.where(produced == 1, lens - 1 - all_drafts + kept, lens)
        catch_up = np.concatenate([np.zeros(len(dec), np.int64), np.where(first_block, t.prefix_len[new], 0)])
        # With the adaptive controller, a proposer whose drafts cost time (MTP) prepares one more than this step
        # verified at most (one while speculation is off: enough for shadow acceptance), not always k.
        depth = MAX_DRAFT if self.controller is None else int(num_draft.max(initial=0)) + 1
        detached = None if self.controller is None else self.controller.detached(slots)
        draft_start = time.perf_counter()
        self.proposer.observe(StepUpdate(slots, block_start, starts, num_valid, done, t.tokens, hidden,
                                         catch_up, self.prefix_hidden, depth, detached, t.seq_len[slots],
                                         t.prompt_len[slots]))
        draft_seconds += time.perf_counter() - draft_start
        if self.controller is not None and len(dec) and (not detached[: len(dec)].all() or num_avail.any()):
            self.controller.drafting(draft_seconds)  # (detached slots that still draft: MTP's copies)
        if self.controller is not None and len(new) == 0:  # steps that prefill are not comparable
            # A speculative step counts whole, drafting for the next one included; a plain one without the
            # drafter's time, which plain decoding would not spend (its slots detach from the drafter).
            spec = bool(num_draft.sum())
            self.controller.record(int(kept.sum()), time.perf_counter() - step_start - (0.0 if spec else draft_seconds),
                                   spec, len(batch.token_ids))
        finished = []
        for i in np.nonzero(done)[0]:
            s = int(slots[i])
            reason = "stop" if (by_eos[i] or by_stop[i]) else "length"
            finished.append((self._finish(s, reason, texts.get(s)), s))
        return finished

    def share_prefix(self, prefix_ids) -> int:
        """Compute the KV of `prefix_ids` once, into the cache's shared prefix; prompts placed afterwards that start
        with it read it from there (cascade attention) instead of prefilling and storing it per slot. Needs the
        fused kernels; a prefix shorter than `min_shared_prefix` is not worth it. Returns the tokens shared."""
        if self.model.ops is None or len(prefix_ids) < self.config.min_shared_prefix or self.table.active.any():
            return 0
        n = min(len(prefix_ids), self.context_len - 1)
        ids = np.asarray(prefix_ids[:n], dtype=np.int64)
        cfg = self.model.config
        pre = KVCache(cfg.num_layers, 1, cfg.num_kv_heads, cfg.head_dim, self.cache.dtype, n, initial_capacity=n)
        batch = build_forward_batch(np.zeros(1, np.int64), np.zeros(1, np.int64), np.array([n]), ids, np.zeros(1, bool))
        _, hidden = self.model.forward(batch, pre)
        self.cache.prefix = pre
        self.prefix_ids, self.prefix_hidden = ids, hidden  # hidden [n, hidden]: the MTP head's catch-up input
        return n

    def memory(self) -> dict[str, int]:
        """KV cache bytes the run needed at its peak: every slot's rows up to the longest one (plus the shared
        prefix, once), and the same without sharing (every slot holding the prefix itself). The allocation
        rounds these up (it grows by doubling)."""
        c = self.cache
        prefix = c.prefix.nbytes() if c.prefix is not None else 0
        return {"kv_cache_bytes": c.nbytes(c.peak_own) + prefix,
                "kv_cache_bytes_unshared": c.nbytes(c.peak_position)}

    def _prefill_chunks(self) -> tuple[np.ndarray, np.ndarray]:
        """Slots still prefilling and how many prompt tokens each feeds this step: the rest of its prompt, or at
        most `prefill_chunk` of it; with chunking, in slot order while `max_prefill_tokens` lasts (at least one)."""
        t, cfg = self.table, self.config
        new = np.nonzero(t.active & ~t.prefilled)[0]  # [num_new]
        chunk = t.prompt_len[new] - t.prefill_pos[new]
        if cfg.prefill_chunk and len(new):
            chunk = np.minimum(chunk, cfg.prefill_chunk)
            fits = np.cumsum(chunk) <= cfg.max_prefill_tokens
            fits[0] = True
            new, chunk = new[fits], chunk[fits]
        return new, chunk.astype(np.int64)

    def _stop_strings(self, slots: np.ndarray, emitted: np.ndarray, kept: np.ndarray):
        """Cut runs at the first token after which the output text contains a stop string.

        Only requests that have stop strings are looked at (a per-request loop over that subset).
        Modifies `kept` in place; returns (stopped [num_seqs] bool, {slot: text cut before the stop}).
        """
        stopped = np.zeros(len(slots), bool)
        texts: dict[int, str] = {}
        if self.tokenizer is None:
            return stopped, texts
        t = self.table
        for i, s in enumerate(slots.tolist()):
            stops = self.requests[s].params.stop
            if not stops:
                continue
            prior = t.tokens[s, t.prompt_len[s] : t.seq_len[s]].tolist()
            for j in range(int(kept[i])):
                text = self._decode(prior + emitted[i, : j + 1].tolist())
                hits = [text.find(x) for x in stops if x in text]
                if hits:
                    kept[i] = j + 1
                    stopped[i] = True
                    texts[s] = text[: min(hits)]
                    break
        return stopped, texts


def common_prefix(prompts: list) -> list[int]:
    """The longest token prefix every prompt starts with ([] for fewer than two prompts)."""
    if len(prompts) < 2:
        return []
    arrs = [np.asarray(p, dtype=np.int64) for p in prompts]
    n = min(len(a) for a in arrs)
    same = np.all(np.stack([a[:n] for a in arrs]) == arrs[0][:n], axis=0)  # [n]
    return arrs[0][: int(np.argmin(same)) if not same.all() else n].tolist()


def _error_output(req: Request, message: str) -> RequestOutput:
    return RequestOutput(req.id, req.index, "", [], None, len(req.prompt_ids), RequestStats(), error=message)


CALIBRATION_REPEATS = 5  # timings per point of the cost table (round robin over the points), at most
CALIBRATION_BUDGET = 0.15  # seconds of timed forwards after which fewer repeats are taken (large batches)
ANCHOR_SLOTS = 8  # from this many slots on, the table also times one slot's single token (see calibrate)


def calibrate(model: Model, cache, max_draft: int, num_slots: int | None = None) -> Controller:
    """Time forwards feeding 1, 2 and max_draft + 1 tokens to each of num_slots slots (all the cache's by
    default; their cache rows are overwritten later by prefill), and with ANCHOR_SLOTS or more one slot's token:
    the median of up to CALIBRATION_REPEATS timings per point, taken round robin over the points (one timing of
    a 6 ms step can be off by 50% on a shared machine, and one bad point skews every choice). The one-token
    point anchors the steps of fewer slots, once slots drain at the end of a job: without it the table's slope,
    which compute-bound many-slot steps set, extrapolated an 8-token step of 32 slots' table to 2 ms instead of
    the 18 ms it took (and the online scale then inflated every cost ninefold).
    The forwards are greedy steps' (no logits where the model screens its LM head); a sampled job's steps cost
    more per logit row, which the controller's online scale takes up.
    Measured once per (slots, max_draft) and model, and kept on the model: a later engine on the same model
    (e.g. `specgen bench`) reuses it; and on disk (cost_cache), where a later run on this machine finds it."""
    num_slots = cache.num_slots if num_slots is None else num_slots
    key = (num_slots, max_draft)
    table = model.calibrations.get(key)
    stored = None
    if table is None:
        stored = cost_cache.table_path(model.cost_key(), cache.dtype, num_slots, max_draft)
        table = cost_cache.load(stored)
    if table is None:
        slots = np.arange(num_slots, dtype=np.int64)
        counts = sorted({1, 2, max_draft + 1})
        batches = [build_forward_batch(slots, np.zeros(num_slots, np.int64), np.full(num_slots, q, np.int64),
                                       np.zeros(num_slots * q, np.int64), np.ones(num_slots, bool)) for q in counts]
        tokens = [q * num_slots for q in counts]
        if num_slots >= ANCHOR_SLOTS:
            batches.insert(0, build_forward_batch(slots[:1], np.zeros(1, np.int64), np.ones(1, np.int64),
                                                  np.zeros(1, np.int64), np.ones(1, bool)))
            tokens.insert(0, 1)
        model.forward_greedy(batches[0], cache, logits=False)  # warm-up
        timings: list[list[float]] = [[] for _ in batches]
        spent = 0.0
        for _ in range(CALIBRATION_REPEATS):
            for batch, times in zip(batches, timings):
                start = time.perf_counter()
                model.forward_greedy(batch, cache, logits=False)
                times.append(time.perf_counter() - start)
            spent += sum(times[-1] for times in timings)
            if spent > CALIBRATION_BUDGET:
                break
        seconds = np.array([np.median(times) for times in timings])
        table = (np.array(tokens), np.maximum.accumulate(seconds))
        cost_cache.store(stored, *table)
    model.calibrations[key] = table
    return Controller(CostModel(*table), max_draft, cache.num_slots)
