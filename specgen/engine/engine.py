"""The step loop: admit, propose, one packed forward, sample + verify all slots at once, commit."""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Iterable, Iterator

import numpy as np
import paddle

from specgen.backends.base import RowSampling
from specgen.config import TOP_LOGPROBS_MAX, EngineConfig, SamplingParams, default_threads
from specgen.engine.adaptive import Controller, StepReport
from specgen.engine.adaptive.calibrate import controller_for
from specgen.engine.grammar import ForcedDrafts, Grammars, ahead, grammar_error
from specgen.engine.logprobs import LogprobTable
from specgen.engine.memory import KvMemory
from specgen.engine.plan import StepBlocks, StepPlan, in_blocks
from specgen.engine.proposers.base import NoProposer, Proposer, SlotView
from specgen.engine.rows import Processing, processed
from specgen.engine.scheduler import Scheduler
from specgen.engine.slots import MAX_DRAFT, SlotLists, SlotTable, common_prefix, error_output, rejection
from specgen.engine.stops import stop_strings
from specgen.engine.tree import CAUSAL, main_chain, node_values, offer, reach, tree_layout, walk
from specgen.engine.types import DraftTokens, Request, RequestOutput, SlotSampling, StepUpdate
from specgen.engine.verify import accept_lengths, first_stop
from specgen.errors import ConfigError
from specgen.layers.logprobs import processed_logprobs
from specgen.models.model import Model
from specgen.models.tokenizer import TextTokenizer
from specgen.runtime.batch import build_forward_batch

PROMPT_ROWS = 256  # prompt rows whose logits prompt_logprobs computes at once (49 MB at 49,152 tokens)


def nonfinite_slots(out, batch) -> np.ndarray:
    """Slots with a NaN or Inf in the step's final hidden states: [n] int64, most often empty. One reduction
    when all is well (on the CPU in numpy: 21 us a step at batch 1, where Paddle's sum took 56-66 us inside
    the engine); the per-row search only when it is not. NaN or Inf that only the LM head's own weights would
    bring is not looked for (summing the logits cost up to 21 ms a step at 256 slots)."""
    h = out.hidden
    if np.isfinite(h.numpy().sum() if h.place.is_cpu_place() else float(paddle.sum(h))):
        return np.empty(0, np.int64)
    bad = ~paddle.isfinite(out.hidden).all(axis=1).numpy()  # [num_tokens]
    return np.unique(batch.token_slots[bad])


def _ranks(logits, tokens: np.ndarray) -> np.ndarray:
    """[r] int64 each row's rank of its token: 1 + the tokens with a larger logit (vLLM's). On the CPU in
    numpy (Paddle's broadcast compare and count took as long as the LM head itself: 1.2 s of a 3,409-token
    scoring job)."""
    if logits.place.is_cpu_place():
        x = logits.numpy()  # [r, vocab]
        return 1 + (x > x[np.arange(len(x)), tokens][:, None]).sum(axis=1)
    own = paddle.take_along_axis(logits, paddle.to_tensor(tokens[:, None]), axis=1)  # [r, 1]
    return 1 + paddle.count_nonzero(logits > own, axis=1).numpy()


def shifted(a: np.ndarray, by: np.ndarray) -> np.ndarray:
    """Each row of a [n, w] moved left by by[i] columns (the last column repeated past the end)."""
    col = np.minimum(np.arange(a.shape[1])[None, :] + by[:, None], a.shape[1] - 1)
    return np.take_along_axis(a, col, axis=1) if a.shape[1] else a


class Engine:
    """Generates completions for a stream of requests with a static batch of slots."""

    # Whether the request source yields its next item without waiting (Scheduler's `ready`);
    # None: it always does (a file being read). A worker fed by a queue sets it, so running slots never
    # wait for the next request.
    ready = None

    def __init__(self, model: Model, tokenizer: TextTokenizer | None, config: EngineConfig,
                 proposer: Proposer | None = None, adaptive: bool = False, max_draft: int = MAX_DRAFT):
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.proposer = proposer or NoProposer()
        # main-model blocks whose inputs the proposer reads as its features (EAGLE-3's), in place of the final
        # hidden states
        self.features: tuple[int, ...] = tuple(getattr(self.proposer, "features", ()))
        ctx = model.config.max_position_embeddings
        self.context_len = min(ctx, config.max_model_len) if config.max_model_len else ctx
        self.eos_ids = np.array(model.config.eos_token_ids, dtype=np.int64)
        loaded = "int8" if model.int8_product else "float32"
        if config.matmul != loaded:
            raise ConfigError(f"the model was loaded with matmul {loaded!r}, the engine asks for "
                              f"{config.matmul!r}: load it with load_model(..., matmul={config.matmul!r})")
        self.cache = model.new_cache(config.batch_size, self.context_len, config.kv_cache_dtype)
        self.kv_memory = KvMemory(self.cache, config, self.context_len)  # admission checks it
        self.table = SlotTable.empty(config.batch_size, 256)
        self.logprob_table: LogprobTable | None = None  # made when a request first asks for log-probabilities
        self.pieces: dict[int, str] = {}  # each token's text, as a log-probability entry names it (_piece)
        # each slot's logit bias and its stop token ids, made when a request first has one
        self.bias_table: SlotLists | None = None
        self.stop_table: SlotLists | None = None
        # constrained slots' grammar matchers, made when a request first has a response_format
        self.grammars: Grammars | None = None
        # the slot of each running request's sample 0, for requests of n > 1 samples: the others copy its
        # prompt's rows once it is prefilled (_source_slot)
        self.samples_of: dict[tuple[str, int], int] = {}  # by (id, index)
        self.requests: list[Request | None] = [None] * config.batch_size
        # [num_slots] the drafter caught up on the slot's prompt: the slot was attached when placed (a slot's
        # prefill verifies no drafts, so the controller detaches none then), or copied a caught-up sample 0's
        self.caught = np.zeros(config.batch_size, bool)
        self.adaptive, self.max_draft = adaptive, max_draft
        self.controller: Controller | None = None  # with `adaptive`, made when the first run starts
        self.prefix_ids: np.ndarray | None = None  # [prefix_tokens] the shared prefix, once computed
        self.prefix_hidden = None  # paddle [prefix_tokens, hidden]
        # prompt_logprobs of the prefix's own tokens, scored once (_prefix_logprobs): logprob, top ids, top
        # logprobs, rank of positions 1 .. prefix_tokens - 1
        self.prefix_scores: tuple[np.ndarray, ...] | None = None
        self.num_steps = 0  # steps run (named in a non-finite request's error)
        # tokens each expert took (MoE)
        self.expert_tokens: np.ndarray | None = None  # [num_routed_blocks, num_experts]

    def _start(self, num_requests: int, sampling: SamplingParams | None = None) -> None:
        """The adaptive controller, its step costs measured with as many slots as the job will fill at first
        (a job of 8 requests in 32 slots times 8-slot steps: 4x cheaper start-up, and the costs it will
        see), and sampled as the job samples (`sampling`: its first sampled request's settings)."""
        active = max(1, min(self.config.batch_size, num_requests))
        self.controller = controller_for(self.model, self.cache, self.max_draft, self.config, active,
                                         sampling)
        self.controller.rule_out(self.proposer.acceptance_hint, active)

    # ---- admission and retirement (per request, outside the step) ----

    def _place(self, slot: int, req: Request) -> None:
        n = len(req.prompt_ids)
        end = min(n + req.params.max_tokens, self.context_len)  # the request's last position + 1
        self.kv_memory.admit(slot, req.id, n, end)
        # A prompt that starts with the shared prefix skips it
        # (keeping at least one token of its own to prefill).
        shared = 0
        # (a prompt whose log-probabilities are asked for reads the prefix's from its final hidden states: not
        # where they are an EAGLE-3 layer's features instead)
        if (self.prefix_ids is not None and n > 1 and len(self.prefix_ids) <= n
                and (req.params.prompt_logprobs is None or not self.features)):
            if np.array_equal(self.prefix_ids, req.prompt_ids[: len(self.prefix_ids)]):
                shared = min(len(self.prefix_ids), n - 1)
        self.table.place(slot, req, end, shared)
        room = self._logprob_room(req)
        src = self._source_slot(req)
        blind = False  # the slot copies a prompt its drafter has no state of
        if src is not None and self.table.prefilled[src] and n > 1:  # the prompt but its last token, copied
            t = self.table
            prefix = int(t.prefix_len[src]) if self.prefix_ids is not None else 0
            self.cache.copy_slot(src, slot, n - 1, prefix)
            t.prefill_pos[slot] = t.num_cached[slot] = n - 1
            t.prefix_len[slot] = 0
            copy_prompt = getattr(self.proposer, "copy_prompt", None)  # the drafter's state of the prompt
            if copy_prompt is not None and self.caught[src]:
                copy_prompt(src, slot, n)
            blind = copy_prompt is not None and not self.caught[src]
            if t.prompt_logprobs[slot]:  # (the prompt's, computed by sample 0's prefill)
                room.copy(src, slot, 1, n)
        elif shared and self.table.prompt_logprobs[slot]:
            self._prefix_logprobs(slot, req, shared)
        if req.params.n > 1 and req.sample_index == 0:
            self.samples_of[(req.id, req.index)] = slot
        self._set_lists(slot, req)
        why = self._constrain(slot, req)
        assert why is None, why  # admission checked the grammar; the slot holds no output yet
        self.requests[slot] = req
        c = self.controller
        if c is not None:
            c.reset(slot)
            if blind:  # (its sample 0 was placed detached: the drafter never caught up on the prompt)
                c.detach(slot)
        self.caught[slot] = c is None or not c.detached(np.array([slot]))[0]

    def _grammar_rejection(self, req: Request) -> str | None:
        """Why `req`'s response_format cannot constrain it (no tokenizer, a grammar that does not compile
        or not over this model's vocabulary); the grammar table is made the first time a request has one."""
        spec = req.params.response_format
        if not spec:
            return None
        if self.tokenizer is None:
            return "response_format needs the model's tokenizer (this engine has none)"
        if self.grammars is None:
            try:
                self.grammars = Grammars(self.tokenizer, self.model.config.vocab_size, self.eos_ids,
                                         len(self.requests), self.config.threads or default_threads())
            except ValueError as exc:
                return f"response_format: the grammar engine cannot read this model's tokenizer ({exc})"
        return grammar_error(spec) or self.grammars.compile_error(spec)

    def _constrain(self, slot: int, req: Request) -> str | None:
        """`slot`'s grammar matcher for `req` (admitted: _grammar_rejection found nothing; placed in the slot
        table already, with any output it has: a hand-off's first token), or the slot's released; returns why
        the output breaks the grammar."""
        if self.grammars is not None:
            self.grammars.release(slot)
        if not req.params.response_format:
            return None
        return self.grammars.place(slot, req.params.response_format, self.table.output_ids(slot))

    def _source_slot(self, req: Request) -> int | None:
        """The slot of `req`'s sample 0 while it runs, for a later sample that may copy its prompt's rows (a
        drafter that keeps no state of the prompt, or copies it: Proposer.clone_safe); None."""
        if not req.sample_index or not getattr(self.proposer, "clone_safe", False):
            return None
        key = (req.id, req.index)
        s = self.samples_of.get(key)
        running = None if s is None else self.requests[s]
        return s if running is not None and (running.id, running.index) == key else None

    def _held(self, req: Request, admitting: list[Request]) -> bool:
        """Whether `req` waits for its sample 0's prefill, to copy it (the scheduler's hold): sample 0 runs
        and is not prefilled yet, or is being admitted with it."""
        if not req.sample_index or not getattr(self.proposer, "clone_safe", False):
            return False
        s = self._source_slot(req)
        return (s is not None and not self.table.prefilled[s]) or any(
            (r.id, r.index, r.sample_index) == (req.id, req.index, 0) for r in admitting)

    def _prefill_cost(self, req: Request) -> int | None:
        """Prompt tokens `req` will prefill in its first step: one for a sample that copies the rest; None:
        the scheduler's own count."""
        s = self._source_slot(req)
        return 1 if s is not None and self.table.prefilled[s] else None

    def _set_lists(self, slot: int, req: Request) -> None:
        """`slot`'s rows of bias_table and stop_table: `req`'s logit bias and stop token ids (each table made
        when a request first has one)."""
        pairs, stops = req.params.logit_bias, req.params.stop_token_ids
        if self.bias_table is not None or pairs:
            self.bias_table = self.bias_table or SlotLists.empty(len(self.requests))
            self.bias_table.set(slot, [t for t, _ in pairs], [b for _, b in pairs])
        if self.stop_table is not None or stops:
            self.stop_table = self.stop_table or SlotLists.empty(len(self.requests))
            self.stop_table.set(slot, list(stops))

    def _logprob_room(self, req: Request) -> LogprobTable | None:
        """Room in logprob_table for `req` (placed in the slot table already), made the first time a request
        asks for log-probabilities; None when it does not."""
        p = req.params
        if not p.logprobs and p.prompt_logprobs is None:
            return None
        if self.logprob_table is None:
            self.logprob_table = LogprobTable.empty(len(self.requests), 0, 0)
        self.logprob_table.fit(self.table.tokens.shape[1], max(p.top_logprobs, p.prompt_logprobs or 0))
        return self.logprob_table

    def _finish(self, slot: int, reason: str, text_cut: str | None) -> RequestOutput:
        t, req = self.table, self.requests[slot]
        out_ids = t.output_ids(slot)
        text = text_cut if text_cut is not None else self._decode(out_ids)
        logprobs = None
        if t.logprobs[slot]:
            top = min(int(t.top_logprobs[slot]), self.model.config.vocab_size)
            logprobs = self.logprob_table.entries(slot, int(t.prompt_len[slot]), out_ids, top, self._piece)
        prompt_logprobs = None
        if t.prompt_logprobs[slot]:  # (the first prompt token has none: nothing comes before it)
            top = min(int(t.prompt_top[slot]), self.model.config.vocab_size)
            prompt_logprobs = [None, *self.logprob_table.entries(slot, 1, list(req.prompt_ids[1:]), top,
                                                                 self._piece, ranked=True)]
        stats = t.stats(slot)
        if self.grammars is not None and self.grammars.active[slot]:
            stats.num_forced_tokens = int(self.grammars.num_forced[slot])
            self.grammars.release(slot)
        t.active[slot] = False
        self.requests[slot] = None
        if self.samples_of.get((req.id, req.index)) == slot:
            del self.samples_of[(req.id, req.index)]
        return RequestOutput(req.id, req.index, text, out_ids, reason, len(req.prompt_ids), stats,
                             logprobs=logprobs, prompt_logprobs=prompt_logprobs, api=req.api,
                             openai=req.openai, sample_index=req.sample_index, num_samples=req.params.n)

    def _fail(self, slot: int, why: str) -> RequestOutput:
        req = self.requests[slot]
        self.cache.clear_slot(slot)
        self.table.active[slot] = False
        if self.grammars is not None:
            self.grammars.release(slot)
        self.requests[slot] = None
        if self.samples_of.get((req.id, req.index)) == slot:
            del self.samples_of[(req.id, req.index)]
        return error_output(req, why)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    def _piece(self, token_id: int) -> str:
        """One token's text, special tokens included (a log-probability entry's `token`); each kept once
        decoded (a job's entries name the same tokens again and again: 12,288 decodes were 0.9% of a
        32-request job with top_logprobs 5)."""
        if self.tokenizer is None:
            return ""
        piece = self.pieces.get(token_id)
        if piece is None:
            piece = self.pieces[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return piece

    # ---- the loop ----

    def run(self, requests: Iterable[Request]) -> Iterator[RequestOutput]:
        """Yields outputs as requests finish (completion order)."""
        sched = self._scheduler(requests)
        if self.config.shared_prefix == "auto" and self.prefix_ids is None:
            self.share_prefix(common_prefix([r.prompt_ids for r in sched.peek(self.config.batch_size)]))
        if self.adaptive and self.controller is None:
            first = sched.peek(self.config.batch_size)
            self._start(len(first), next((r.params for r in first if r.params.temperature > 0), None))
        while sched.has_work(int(self.table.active.sum())):
            for slot, req in sched.admit():
                rejected = self._admit(slot, req)
                if rejected is not None:
                    sched.retire(slot)
                    yield rejected
            if not self.table.active.any():
                continue
            for out, slot in self.step():
                sched.retire(slot)
                yield out

    def _scheduler(self, requests: Iterable[Request]) -> Scheduler:
        return Scheduler(requests, self.config.batch_size, self.config.max_prefill_tokens,
                         self.config.prefill_chunk, ready=self.ready, cost=self._prefill_cost,
                         hold=self._held)

    def _admit(self, slot: int, req: Request) -> RequestOutput | None:
        """Place `req` in `slot`, or return its error record (a prompt the engine cannot run)."""
        why = rejection(req, self.context_len, self.model.config.vocab_size) or self._grammar_rejection(req)
        if why is not None:
            return error_output(req, why)
        self._place(slot, req)
        return None

    def step(self) -> list[tuple[RequestOutput, int]]:
        """One forward for every active slot: prefill blocks (or prompt chunks) of new slots, [last + drafts]
        of decoding ones. Returns the requests that finished, with their slots."""
        start = time.perf_counter()
        plan = self._plan()
        blocks = self._blocks(plan)
        slots, t = blocks.slots, self.table
        # A step whose slots are all greedy, unpenalized and want no log-probabilities needs no logits (a
        # screened LM head skips them; a grammar's rows that refuse the greedy token get theirs: rows.py); nor
        # does one whose sampled rows have no filter on, where the backend samples in its forward (from the
        # screen's bounds: the same tokens).
        rows = self._row_sampling(blocks)
        sampled = bool(t.temperature[slots].any())
        other = bool(t.logprobs[slots].any() or t.penalized[slots].any())
        in_forward = (sampled and not other and self.model.samples_in_forward and rows.unfiltered()
                      and not self._constrained(slots))
        out = self.model.forward(blocks.batch, self.cache, logits=(sampled and not in_forward) or other,
                                 features=self.features, sampling=rows if in_forward else None)
        targets, sampled_from = self._sample(plan, blocks, out, rows)
        forward_seconds = time.perf_counter() - start
        self._tally(out)
        # NaN / Inf: these end in error
        bad = nonfinite_slots(out, blocks.batch)
        broken = np.isin(slots, bad) if len(bad) else np.zeros(len(slots), bool)  # [num_seqs]
        emitted, accepted, path = self._verify(plan, blocks, targets)
        num_emitted = np.concatenate([accepted + 1, plan.final.astype(np.int64)])  # a mid-prompt chunk: none
        stop_ids = None if self.stop_table is None else self.stop_table.ids[slots]
        kept, by_eos = first_stop(emitted, num_emitted, self.eos_ids, plan.room[slots], t.ignore_eos[slots],
                                  stop_ids)
        by_stop, texts = stop_strings(self.tokenizer, self.requests, t, slots, emitted, kept)
        position = t.seq_len[slots] - t.prompt_len[slots]  # [num_seqs] output tokens before this step
        root_rows = t.seq_len[plan.dec] - 1 - t.prefix_len[plan.dec]  # [num_dec] own cache row of each root
        if t.logprobs[slots].any():
            self._logprobs(plan, blocks, out.logits, sampled_from, targets, path, kept)
        if t.prompt_logprobs[plan.new].any():
            self._prompt_logprobs(plan, blocks, out.hidden)
        produced = self._commit(plan, slots, emitted, kept)
        failed = {}  # {slot: why} (a grammar the kept tokens broke: never expected)
        if self._constrained(slots):  # (a broken slot's tokens are not the grammar's to judge)
            failed = self.grammars.commit(slots, emitted, np.where(broken, 0, kept), plan.forced)
        if path is not None:
            self._compact(plan.dec, root_rows, path, kept[: len(plan.dec)])
        done = (by_eos | by_stop | (t.seq_len[slots] >= t.max_len[slots]) | broken
                | (np.isin(slots, list(failed)) if failed else False))
        # (a step between probes tells the proposer only of finished requests: the n-gram pool takes them)
        if not plan.idle or plan.quiet and done.any():
            feats = out.hidden if out.features is None else out.features  # the drafter's catch-up input
            observe_seconds = self._observe(plan, blocks, produced, kept, done, feats, broken, path)
            if self.controller is not None and not plan.idle:
                self._report(plan, blocks, emitted, kept, accepted, forward_seconds, observe_seconds)
        return self._finished(slots, done, broken, by_eos | by_stop, texts, position, failed)

    def _blocks(self, plan: StepPlan) -> StepBlocks:
        """The step's packed forward: decoding blocks [last, drafts...] first, then the new slots' prompt
        chunks."""
        t = self.table
        dec, new, chunk = plan.dec, plan.new, plan.chunk
        width = plan.drafts.draft_ids.shape[1]
        dec_blocks = np.concatenate([t.tokens[dec, t.seq_len[dec] - 1][:, None], plan.drafts.draft_ids],
                                    axis=1)
        dec_mask = np.arange(width + 1)[None, :] <= plan.num_draft[:, None]  # [num_dec, width + 1]
        col_all = np.arange(t.tokens.shape[1])[None, :]
        new_start = t.prefill_pos[new]
        new_mask = (col_all >= new_start[:, None]) & (col_all < (new_start + chunk)[:, None])
        slots = np.concatenate([dec, new])
        lens = np.concatenate([plan.num_draft + 1, chunk])
        starts = np.concatenate([t.seq_len[dec] - 1, new_start])
        tree_depth = tree_mask = None
        # Tree rows only where some slot verifies a node: a block of roots alone is causal, and runs the
        # causal path (the tree-masked one cost +0.6% for 1 token, +4-7% for 3-5, one slot at position 256).
        # prompt chunks: depth = index in the block, causal
        if plan.depth is not None and plan.num_draft.any():
            chunk_index = np.arange(int(chunk.sum())) - np.repeat(np.cumsum(chunk) - chunk, chunk)
            tree_depth = np.concatenate([plan.depth[dec_mask], chunk_index])
            tree_mask = np.concatenate([plan.mask[dec_mask], np.full(len(chunk_index), CAUSAL)])
        batch = build_forward_batch(
            slots, starts, lens, np.concatenate([dec_blocks[dec_mask], t.tokens[new][new_mask]]),
            np.concatenate([np.ones(len(dec), bool), np.zeros(len(new), bool)]),
            no_logits=np.concatenate([np.zeros(len(dec), bool), ~plan.final]),
            prefix_lens=t.prefix_len[slots] if self.prefix_ids is not None else None,
            tree_depth=tree_depth, tree_mask=tree_mask)
        return StepBlocks(batch, slots, starts, lens, dec_mask)

    def _tally(self, out) -> None:
        """Steps run, and for an MoE model what its experts took (verified drafts included)."""
        self.num_steps += 1
        if out.expert_counts is not None:
            self.expert_tokens = (out.expert_counts
                                  + (self.expert_tokens if self.expert_tokens is not None else 0))

    def _logprobs(self, plan: StepPlan, blocks: StepBlocks, logits, sampled_from, targets: np.ndarray,
                  path: np.ndarray | None, kept: np.ndarray) -> None:
        """The log-probabilities of the tokens the step keeps, for the slots that ask, into logprob_table at
        the positions the commit will give the tokens: of the raw logits, or (logprobs_mode processed) of the
        distribution each row was sampled from (the processed rows `sampled_from`, temperature and
        filters)."""
        t, slots = self.table, blocks.slots
        rows = in_blocks(plan, blocks, np.arange(len(targets)))  # [num_seqs, width + 1] logit rows
        if path is not None:
            rows[: len(plan.dec)] = np.take_along_axis(rows[: len(plan.dec)], path, axis=1)
        wanted = (np.arange(rows.shape[1])[None, :] < kept[:, None]) & t.logprobs[slots][:, None]
        seq, col = np.nonzero(wanted)
        if not len(seq):  # (a slot mid-prompt)
            return
        rows = rows[seq, col]
        top = min(int(t.top_logprobs[slots].max()), logits.shape[1])
        processed = t.processed_logprobs[slots[seq]]  # [n]
        if not processed.all():
            raw = ~processed
            logprob, top_ids, top_lp = self.model.logprobs(logits, rows[raw], targets[rows[raw]], top)
            self.logprob_table.write(slots[seq[raw]], t.seq_len[slots][seq[raw]] + col[raw], logprob, top_ids,
                                     top_lp)
        if processed.any():
            s, r = slots[seq[processed]], rows[processed]
            x = paddle.gather(sampled_from, paddle.to_tensor(r)).numpy()
            logprob, top_ids, top_lp = processed_logprobs(x, t.temperature[s], t.top_k[s], t.top_p[s],
                                                          t.min_p[s], targets[r], top)
            self.logprob_table.write(s, t.seq_len[s] + col[processed], logprob, top_ids, top_lp)

    def _prompt_logprobs(self, plan: StepPlan, blocks: StepBlocks, hidden) -> None:
        """The log-probabilities of the prompt tokens the step's prompt chunks predict (each row's next
        token, where it is still the prompt's), for the slots that ask, into logprob_table at the positions
        of those tokens, with their ranks: the LM head over the rows' final hidden states (_scored)."""
        t, num_dec = self.table, len(plan.dec)
        want = np.nonzero(t.prompt_logprobs[plan.new])[0]  # [m] indices into plan.new
        lens = plan.chunk[want]
        block_start = np.cumsum(blocks.lens) - blocks.lens  # [num_seqs] packed row of each block's first
        off = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)  # [r] index in the chunk
        rows = np.repeat(block_start[num_dec + want], lens) + off  # [r] packed rows
        slot = np.repeat(plan.new[want], lens)  # [r]
        pos = np.repeat(t.prefill_pos[plan.new[want]], lens) + off  # [r] each row's position
        keep = pos + 1 < t.prompt_len[slot]  # (a prompt's last row predicts its first output token)
        rows, slot, pos = rows[keep], slot[keep], pos[keep]
        if len(rows):
            top = min(int(t.prompt_top[slot].max()), self.model.config.vocab_size)
            self.logprob_table.write(slot, pos + 1, *self._scored(hidden, rows, t.tokens[slot, pos + 1], top))

    def _prefix_logprobs(self, slot: int, req: Request, shared: int) -> None:
        """The prompt entries of positions [1, shared] of `slot`, whose prompt reads its first `shared`
        positions from the shared prefix: those the prefix's own tokens hold, scored once for every request
        (with the most top tokens a request may ask), and where the prompt goes past the prefix, its first
        own token's, from the prefix's last row."""
        p, vocab = len(self.prefix_ids), self.model.config.vocab_size
        top, m = min(req.params.prompt_logprobs, vocab), min(shared, p - 1)
        if m:
            if self.prefix_scores is None:  # rows 0 .. p - 2 predict the prefix's tokens 1 .. p - 1
                self.prefix_scores = self._scored(self.prefix_hidden, np.arange(p - 1), self.prefix_ids[1:],
                                                  min(TOP_LOGPROBS_MAX, vocab))
            logprob, top_ids, top_lp, rank = self.prefix_scores
            self.logprob_table.write(np.full(m, slot), np.arange(1, m + 1), logprob[:m], top_ids[:m, :top],
                                     top_lp[:m, :top], rank[:m])
        if shared == p:  # (the request's token after the prefix)
            self.logprob_table.write(np.array([slot]), np.array([p]), *self._scored(
                self.prefix_hidden, np.array([p - 1]), np.array([req.prompt_ids[p]]), top))

    def _scored(self, hidden, rows: np.ndarray, targets: np.ndarray, top: int):
        """(logprob [r], top ids [r, top], top logprobs [r, top], rank [r]) of each target token at the LM
        head over hidden[rows] (r >= 1; rank: 1 + the tokens more likely, vLLM's), PROMPT_ROWS rows at a
        time."""
        parts = []
        for a in range(0, len(rows), PROMPT_ROWS):
            b = slice(a, a + PROMPT_ROWS)
            logits = self.model.logits(paddle.gather(hidden, paddle.to_tensor(rows[b])))
            logprob, top_ids, top_lp = self.model.logprobs(logits, np.arange(len(rows[b])), targets[b], top)
            parts.append((logprob, top_ids, top_lp, _ranks(logits, targets[b])))
        return tuple(np.concatenate(x) for x in zip(*parts))

    @classmethod
    def _verify(cls, plan: StepPlan, blocks: StepBlocks, targets: np.ndarray):
        """The model's choices back into blocks, and what they accept: (emitted [num_seqs, width + 1] int64
        the tokens each block emits, in order (a tree's along its accepted path); accepted [num_dec] int64
        drafts accepted; path [num_dec, width + 1] int64 a tree's accepted path (block indices), None for
        chains)."""
        num_dec = len(plan.dec)
        emitted = in_blocks(plan, blocks, targets)
        if plan.depth is None:
            return emitted, accept_lengths(plan.drafts.draft_ids, plan.num_draft, emitted[:num_dec]), None
        accepted, path = walk(plan.drafts.draft_ids, plan.drafts.parents, plan.num_draft, emitted[:num_dec])
        emitted[:num_dec] = np.take_along_axis(emitted[:num_dec], path, axis=1)
        return emitted, accepted, path

    def _report(self, plan: StepPlan, blocks: StepBlocks, emitted, kept, accepted, forward_seconds: float,
                observe_seconds: float) -> None:
        """The controller's lesson of the step. A tree's acceptance is its main chain's (the first child at
        each node)."""
        num_dec = len(plan.dec)
        offered, num_offered = plan.drafts.draft_ids, plan.num_avail
        if plan.depth is not None:
            offered, num_offered = main_chain(offered, plan.drafts.parents, plan.num_avail)
        emitted, kept, num_draft = emitted[:num_dec], kept[:num_dec], plan.num_draft
        if plan.forced is not None:  # the drafter's own drafts only: a grammar's forced ones teach nothing
            f = plan.forced  # [num_dec] (a tree's forced nodes are its trunk: its main chain's first)
            offered, emitted = shifted(offered, f), shifted(emitted, f)
            num_offered, num_draft, kept = (np.maximum(v - f, 0) for v in (num_offered, num_draft, kept))
        self.controller.end_step(StepReport(
            slots=plan.dec, draft_ids=offered, num_avail=num_offered, num_draft=num_draft,
            source=plan.drafts.source, emitted=emitted, kept=kept,
            num_tokens=len(blocks.batch.token_ids), forward_seconds=forward_seconds,
            draft_seconds=plan.draft_seconds + observe_seconds, rated=self._rated(plan, accepted)))

    def _finished(self, slots, done, broken, stopped, texts, position,
                  failed: dict[int, str]) -> list[tuple[RequestOutput, int]]:
        """The outputs of the requests the step ended (one Python iteration per finished request, not per
        slot)."""
        finished = []
        for i in np.nonzero(done)[0]:
            s = int(slots[i])
            if s in failed:
                finished.append((self._fail(s, failed[s]), s))
            elif broken[i]:
                why = ("non-finite values (NaN or Inf) in the model's output at engine step "
                       f"{self.num_steps}, output token {int(position[i])}")
                finished.append((self._fail(s, why), s))
            else:
                finished.append((self._finish(s, "stop" if stopped[i] else "length", texts.get(s)), s))
        return finished

    def _plan(self) -> StepPlan:
        """Decoding slots and their drafts (the controller's choice of how many), prefilling slots and
        chunks."""
        t = self.table
        dec = np.nonzero(t.active & t.prefilled)[0]  # [num_dec]
        new, chunk = self._prefill_chunks()  # [num_new] slots prefilling this step and their chunk lengths
        room = t.max_len - t.seq_len  # [num_slots]
        final = t.prefill_pos[new] + chunk == t.prompt_len[new]
        c = self.controller
        view = SlotView(dec, t.tokens, t.seq_len[dec], np.minimum(room[dec] - 1, MAX_DRAFT))
        forced = self._forced(view)
        # Nothing to draft: speculation is ruled out for good (copies included), or every slot is detached
        # from a drafter that then offers nothing (with copies, detached slots still copy), or from an n-gram
        # job whose drafts do not pay, or from a head whose copies do not pay over the job, between the
        # controller's probes (Controller.probing); a grammar's forced tokens are still drafted.
        detached = c is not None and bool(c.detached(np.concatenate([dec, new])).all())
        copies = getattr(self.proposer, "copies_when_detached", False)
        probe = c is None or c.probing(detached and (copies or getattr(self.proposer, "probes_when_detached",
                                                                         False)), copies=copies)
        idle_detached = detached and getattr(self.proposer, "idle_when_detached", False)
        if c is not None and (c.off or idle_detached or not probe):
            drafts = DraftTokens.none(len(dec), 0) if forced is None else DraftTokens(forced.ids, forced.num)
            return StepPlan(dec, new, chunk, final, room, drafts, drafts.num_draft, drafts.num_draft, 0.0,
                            idle=True, forced=None if forced is None else forced.num,
                            quiet=not (c.off or idle_detached))
        draft_start = time.perf_counter()
        if forced is None:
            drafts = self.proposer.propose(view)
        else:  # the drafter drafts after the forced tokens, placed past each slot's length (scratch room)
            width = forced.ids.shape[1]
            t.tokens[dec[:, None], t.seq_len[dec][:, None] + np.arange(width)] = forced.ids
            drafts = ahead(forced, self.proposer.propose(SlotView(dec, t.tokens, view.seq_lens + forced.num,
                                                                  view.max_draft - forced.num)))
        draft_seconds = time.perf_counter() - draft_start
        if self._constrained(dec):  # up to the first draft the grammar rejects
            drafts = dataclasses.replace(drafts, num_draft=self.grammars.cut(dec, drafts))
        least = np.zeros(len(dec), np.int64) if forced is None else forced.num  # forced drafts are verified
        if drafts.parents is not None:
            return self._plan_tree(dec, new, chunk, final, room, view, drafts, draft_seconds, least)
        num_avail = np.minimum(drafts.num_draft, view.max_draft)  # [num_dec]
        num_draft = num_avail
        if c is not None:  # how many of the drafter's own drafts, after the forced ones (what it learns from)
            least = np.minimum(least, num_avail)
            own = num_avail - least
            num_draft = least + np.minimum(own, c.choose(dec, own, int(chunk.sum()), drafts.source))
        return StepPlan(dec, new, chunk, final, room, drafts, num_avail, num_draft, draft_seconds,
                        forced=None if forced is None else np.minimum(least, num_draft))

    def _constrained(self, slots: np.ndarray) -> bool:
        return self.grammars is not None and bool(self.grammars.active[slots].any())

    def _forced(self, view: SlotView) -> ForcedDrafts | None:
        """The tokens the grammars of the decoding slots force next, where forced drafts are on and the
        drafter drafts from a slot's text alone (it then drafts after them); None where none is forced."""
        if not (self.config.forced_drafts and getattr(self.proposer, "context_only", False)
                and self._constrained(view.slots)):
            return None
        forced = self.grammars.forced(view.slots, view.max_draft)
        return forced if forced.num.any() else None

    @staticmethod
    def _rated(plan: StepPlan, accepted: np.ndarray) -> tuple[float, float] | None:
        """(drafts accepted, the drafter's expected count) over the verified nodes that carry its
        probabilities."""
        scores = plan.drafts.scores
        if scores is None or not len(plan.dec):
            return None
        verified = np.arange(scores.shape[1])[None, :] < plan.num_draft[:, None]  # [num_dec, width]
        # not copies
        own = np.ones(len(plan.dec), bool) if plan.drafts.source is None else plan.drafts.source == 0
        return (float(accepted[: len(plan.dec)][own].sum()),
                float(np.where(verified & own[:, None], scores, 0.0).sum()))

    def _plan_tree(self, dec, new, chunk, final, room, view: SlotView, drafts: DraftTokens,
                   draft_seconds: float, least: np.ndarray) -> StepPlan:
        """_plan for token trees (tree.offer cuts what a step may verify); the controller's node budget keeps
        a prefix of each tree."""
        drafts, num_avail = offer(drafts, view.max_draft,
                                  self.context_len - self.table.seq_len[dec])  # [num_dec]
        num_draft = num_avail
        c = self.controller
        if c is not None:
            source = np.zeros(len(dec), np.int64) if drafts.source is None else drafts.source
            # (the drafter's scores are calibrated only where it gave them)
            gains = node_values(drafts, c.acceptance.rate(source, dec), lambda scores: c.calibrated(scores))
            num_draft = np.minimum(num_avail,
                                   c.choose(dec, num_avail, int(chunk.sum()), drafts.source, gains))
        num_draft = np.maximum(num_draft, np.minimum(least, num_avail))  # forced nodes: a chain from the root
        # every node offered stays in the plan: the controller scores the tree's main chain against what came
        # out even where it verified fewer nodes (shadow acceptance; with none kept, a budget of 0 would
        # stick)
        width = int(num_avail.max(initial=0))
        drafts = DraftTokens(drafts.draft_ids[:, :width], num_draft, drafts.source, drafts.parents[:, :width],
                             None if drafts.scores is None else drafts.scores[:, :width])
        depth, mask = tree_layout(drafts.parents)
        return StepPlan(dec, new, chunk, final, room, drafts, num_avail, num_draft, draft_seconds, depth,
                        mask, forced=np.minimum(least, num_draft) if least.any() else None)

    def _compact(self, dec: np.ndarray, root_rows: np.ndarray, path: np.ndarray, kept: np.ndarray) -> None:
        """Tree blocks were written at root row + block index; the accepted path's K/V move to
        root row + depth, the rows its positions own (only where they differ: never for a chain-shaped
        path). Rows past the new length stay stale, as rejected chain drafts do (kv_cache.py's no-rollback
        invariant)."""
        depth = np.arange(path.shape[1])[None, :]  # [1, width + 1]
        # (depth 0: the root, never moved)
        move = (depth < kept[:, None]) & (path != depth)  # [num_dec, width + 1]
        if move.any():
            seq, d = np.nonzero(move)
            self.cache.move_rows(dec[seq], root_rows[seq] + path[seq, d], root_rows[seq] + d)

    def _row_sampling(self, blocks: StepBlocks) -> RowSampling:
        """How each logit row of the step is sampled: its slot's settings, and for sampled rows the noise
        stream's (request key, output position)."""
        t, batch = self.table, blocks.batch
        row_tok = batch.logit_rows  # [num_logits]
        row_slot = batch.token_slots[row_tok]
        temperature = t.temperature[row_slot]
        key = position = None
        if temperature.any():
            key, position = t.rng_key[row_slot], batch.model_positions[row_tok] + 1 - t.prompt_len[row_slot]
        return RowSampling(temperature, t.top_k[row_slot], t.top_p[row_slot], t.min_p[row_slot], key,
                           position)

    def _sample(self, plan: StepPlan, blocks: StepBlocks, out, rows: RowSampling):
        """The main model's own choice at every logit row ([num_logits] int64): greedy, or the counter-based
        sample of the row's (request, output position), by the backend's sampler (or its forward's:
        ForwardOutput.sampled); rows of penalized slots processed first (engine/penalties.py), rows of
        constrained slots masked by their grammars. Returns (the choices, the logits they were made from:
        processed where a slot's are; None where the forward sampled)."""
        if out.sampled:
            return out.greedy, out.logits
        t = self.table
        logits, greedy = out.logits, out.greedy
        if t.penalized[blocks.slots].any() or self._constrained(blocks.slots):
            logits, greedy = processed(Processing(t, self.model.logits, self.eos_ids, self.bias_table,
                                                  self.stop_table, self.grammars), plan, blocks, out)
        return self.model.sample(logits, rows, greedy), logits

    def _commit(self, plan: StepPlan, slots: np.ndarray, emitted: np.ndarray, kept: np.ndarray) -> np.ndarray:
        """Tokens, lengths and statistics of the step; returns [num_seqs] int64: 1 where the block emitted (a
        decode block, a prompt's last chunk)."""
        t, dec, new = self.table, plan.dec, plan.new
        width = emitted.shape[1] - 1
        col = np.arange(width + 1)[None, :]
        keep_mask = col < kept[:, None]
        t.tokens[np.repeat(slots, kept), (t.seq_len[slots][:, None] + col)[keep_mask]] = emitted[keep_mask]
        t.seq_len[slots] += kept
        t.prefill_pos[new] += plan.chunk
        t.prefilled[new] = plan.final
        t.num_chunks[new] += 1
        produced = np.concatenate([np.ones(len(dec), np.int64), plan.final.astype(np.int64)])
        t.num_steps[slots] += produced
        t.num_draft[dec] += plan.num_draft
        t.num_accepted[slots] += kept - produced
        # [num_dec] the deepest draft verified (a tree: its deepest node; depth <= MAX_DRAFT)
        deepest = plan.num_draft if plan.depth is None else reach(plan.depth, plan.num_draft)
        width = min(width, MAX_DRAFT)
        if width:
            t.accepted_per_pos[slots, :width] += (col[:, :width] < (kept - 1)[:, None])
            t.drafted_per_pos[dec, :width] += (col[:, :width] < deepest[:, None])
        return produced

    @staticmethod
    def _next_depth(plan: StepPlan) -> int:
        """Drafts worth preparing for the next step, under the controller: one more than this step verified
        at most (one after a budget of 0: enough for shadow acceptance), not always k. For a tree, one deeper
        than the deepest node verified from the drafter's own trees (a pass of the EAGLE layer per depth;
        copied chains, source 1, do not deepen them)."""
        if plan.depth is None:
            return int(plan.num_draft.max(initial=0)) + 1
        own = slice(None) if plan.drafts.source is None else plan.drafts.source == 0
        return int(reach(plan.depth, plan.num_draft)[own].max(initial=0)) + 1

    def _observe(self, plan: StepPlan, blocks: StepBlocks, produced, kept, done, hidden, broken,
                 path) -> float:
        """Tell the proposer what the step committed (its drafts for the next step are prepared now); returns
        the seconds it took."""
        t, slots, lens = self.table, blocks.slots, blocks.lens
        all_drafts = np.concatenate([plan.num_draft, np.zeros(len(plan.new), np.int64)])
        block_start = np.concatenate([[0], np.cumsum(lens)[:-1]]).astype(np.int64)
        # positions whose input was right and whose next token is known (a mid-prompt chunk: all of them)
        num_valid = np.where(produced == 1, lens - 1 - all_drafts + kept, lens)
        # after any shared prefix
        first_block = t.prefill_pos[plan.new] - plan.chunk == t.prefix_len[plan.new]
        catch_up = np.concatenate([np.zeros(len(plan.dec), np.int64),
                                   np.where(first_block, t.prefix_len[plan.new], 0)])
        c = self.controller
        depth = MAX_DRAFT if c is None else self._next_depth(plan)
        start = time.perf_counter()
        self.proposer.observe(StepUpdate(
            slots=slots, block_start=block_start, first_pos=blocks.starts, num_valid=num_valid, finished=done,
            tokens=t.tokens, hidden=hidden, prefix_len=catch_up, prefix_hidden=self.prefix_hidden,
            max_draft_next=depth, detached=None if c is None else c.detached(slots),
            seq_lens=t.seq_len[slots], prompt_lens=t.prompt_len[slots], broken=broken, tree_path=path,
            sampling=SlotSampling(t.temperature[slots], t.top_k[slots], t.top_p[slots], t.rng_key[slots],
                                  t.min_p[slots])))
        return time.perf_counter() - start

    def share_prefix(self, prefix_ids) -> int:
        """Compute the KV of `prefix_ids` once, into the cache's shared prefix; prompts placed afterwards that
        start with it read it from there (cascade attention) instead of prefilling and storing it per slot. A
        prefix shorter than `min_shared_prefix` is not worth it. Returns the tokens shared."""
        if len(prefix_ids) < self.config.min_shared_prefix or self.table.active.any():
            return 0
        n = min(len(prefix_ids), self.context_len - 1)
        ids = np.asarray(prefix_ids[:n], dtype=np.int64)
        # (room for the prefix: reserved by forward)
        pre = self.model.new_cache(1, n, self.config.kv_cache_dtype)
        batch = build_forward_batch(np.zeros(1, np.int64), np.zeros(1, np.int64), np.array([n]), ids,
                                    np.zeros(1, bool))
        out = self.model.forward(batch, pre, features=self.features)
        self.cache.prefix, self.prefix_scores = pre, None
        # [n, hidden] the drafter's catch-up input (EAGLE-3: its features [n, C hidden])
        self.prefix_ids, self.prefix_hidden = ids, out.hidden if out.features is None else out.features
        return n

    def memory(self) -> dict[str, Any]:
        """KV cache bytes the run needed at its peak: every slot's rows up to the longest one (plus the shared
        prefix, once), and the same without sharing (every slot holding the prefix itself). The allocation
        rounds these up (it grows by doubling). For an MoE model also the tokens each expert of each routed
        block took (an array: workers' totals add up, as the bytes do)."""
        c = self.cache
        prefix = c.prefix.nbytes() if c.prefix is not None else 0
        out: dict[str, Any] = {"kv_cache_bytes": c.nbytes(c.peak_own) + prefix,
                               "kv_cache_bytes_unshared": c.nbytes(c.peak_position)}
        if self.expert_tokens is not None:
            out["expert_tokens"] = self.expert_tokens
        return out

    def _prefill_chunks(self) -> tuple[np.ndarray, np.ndarray]:
        """Slots still prefilling and how many prompt tokens each feeds this step: the rest of its prompt, or
        at most `prefill_chunk` of it; with chunking, in slot order while `max_prefill_tokens` lasts (at least
        one)."""
        t, cfg = self.table, self.config
        new = np.nonzero(t.active & ~t.prefilled)[0]  # [num_new]
        chunk = t.prompt_len[new] - t.prefill_pos[new]
        if cfg.prefill_chunk and len(new):
            chunk = np.minimum(chunk, cfg.prefill_chunk)
            fits = np.cumsum(chunk) <= cfg.max_prefill_tokens
            fits[0] = True
            new, chunk = new[fits], chunk[fits]
        return new, chunk.astype(np.int64)
