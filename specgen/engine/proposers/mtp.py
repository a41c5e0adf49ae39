"""MTP drafting: an MTP head (specgen/drafters/mtp.py) drafts the next tokens of each slot, its own KV cache
brought up to date after every step; where the slot's text repeats itself, drafts are copied from it instead.

Cache invariant: after each step the head's cache holds exact entries for every position whose main-model
hidden state was verified from the slot's window on (positions [shift, seq_len - 1), stored at head positions
[0, seq_len - 1 - shift); shift = prompt length - prompt_window, or 0); entries past that were written by the
draft chain and are overwritten by the next catch-up, like the main cache's rejected drafts.

Multi-layer MTP (DeepSeek-V3's num_nextn_predict_layers > 1): module i at position p takes module i - 1's
output there (module 0: the main model's hidden state) and token p + 1 + i, and predicts token p + 2 + i; each
module has its own cache. Module i is exact at positions p + 1 + i < seq_len, so it lags module 0 by up to i
positions: each step it catches up from its own `valid` boundary to the last verified position, feeding the
drafts of the modules before it where the token is not committed yet (those entries are overwritten next
step). The module before it produced this step's outputs from one position later at most; that one row is
carried from the step that computed it. Drafts: module i's argmax at the last position is draft i + 1; the
last module chains itself for drafts past the number of modules.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import paddle

from specgen.backends.base import MtpPass, PreparedHead
from specgen.drafters.mtp import (
    MtpHeadWeights,
    load_draft_vocab,
    load_mtp_weights,
    prompt_window,
    shipped_head,
    training_setting,
)
from specgen.engine.proposers.base import Drafting, SlotView, checkpoint_key, prepared_once
from specgen.engine.proposers.ngram import ngram_match, ngram_match_native
from specgen.engine.types import DraftTokens, StepUpdate
from specgen.errors import CheckpointError, EngineError
from specgen.kernels import host
from specgen.models.model import Model
from specgen.runtime.kv_cache import KVCache


@dataclass(frozen=True)
class CatchUp:
    """One step's catch-up of a head's cache: the tokens it runs (grouped by sequence, in order) and the
    drafts wanted."""

    tokens: np.ndarray  # [num_slots, capacity] int64 every slot's committed tokens
    slots: np.ndarray  # [num_seqs] int64 slots catching up
    seq: np.ndarray  # [num_tokens] int64 sequence of each catch-up token
    pos: np.ndarray  # [num_tokens] int64 main-model position of each catch-up token
    rows: np.ndarray  # [num_tokens] int64 row of `hidden` with the main model's hidden state there
    next_ids: np.ndarray  # [num_tokens] int64 token pos + 1
    hidden: paddle.Tensor  # [num_rows, hidden] the step's hidden states (and the shared prefix's, appended)
    start: np.ndarray  # [num_seqs] int64 first catch-up position of each sequence
    total: np.ndarray  # [num_seqs] int64 catch-up tokens of each sequence (>= 1)
    shift: np.ndarray  # [num_seqs] int64 main position - head position
    seq_lens: np.ndarray  # [num_seqs] int64 committed tokens
    want: np.ndarray  # [num_seqs] bool the sequence wants drafts (not copies)
    depth: int  # drafts worth preparing per sequence
    draw: np.ndarray | None  # [4, num_seqs] float64 MtpPass.draw's columns for every sequence; None: argmax


class MtpProposer:
    """Drafts k tokens per slot with an MTP head; its cache is brought up to date after every step.

    With copy_min > 0 a slot whose last copy_min (up to COPY_MAX) tokens occurred earlier in its prompt or
    output gets what followed there instead (n-gram lookup, ngram.py), the head's drafts elsewhere: the head,
    trained on short windows, hardly copies from far back, where summarization and RAG answers come from."""

    # Longest tail looked up (a longer match wins over a shorter one). 8 rather than n-gram's 3: where the
    # head is the alternative, the better source pays more (batch 8, k = 2, every draft verified: tokens per
    # step 1.69 -> 1.71 on summarization, 2.02 -> 2.06 on code rewriting, RAG unchanged).
    COPY_MAX = 8
    # per-slot arrays a hand-off carries as they are (export_slot)
    SLOT_ARRAYS = ("shift", "drafts", "num_drafts", "drafts_at", "copy_ids", "copy_num", "copy_at")

    def __init__(self, model: Model, heads: Sequence[PreparedHead], k: int,
                 acceptance_hint: float | None = None, copy_min: int = 0, prompt_window: int = 0, lib=None):
        """heads: the head's modules (one, or several for multi-layer MTP), prepared for the model's backend;
        lib: ngram.cc's library for the copies (None: the numpy reference)."""
        self.model, self.heads, self.k = model, list(heads), k
        # Prompt positions the head's cache holds (0: all): only a prompt's last prompt_window positions are
        # caught up, stored from the head's position 0 on (its positions are the main model's minus the slot's
        # shift; rotary attention depends only on distances), so the head is not asked to attend further back
        # than it learned, and a long prompt's catch-up is no longer every position.
        self.prompt_window = prompt_window
        # the head's held-out position-1 accuracy, when training recorded it
        self.acceptance_hint = acceptance_hint
        self.idle_when_detached = copy_min == 0  # with copies, detached slots still copy
        self.probes_when_detached = False  # copies do not count toward detaching
        # detached slots copy: while every slot is detached and the job's copies do not pay, the proposer is
        # asked on the controller's probes only (Controller.probing)
        self.copies_when_detached = copy_min > 0
        self.copy_min = copy_min
        self._lib = lib if copy_min and max(k, self.COPY_MAX, copy_min) <= host.NATIVE_MAX else None
        self.cache: KVCache | None = None
        self.drafts = np.zeros((0, k), np.int64)  # [num_slots, k] drafts ready for each slot's next step
        self.num_drafts = np.zeros(0, np.int64)  # [num_slots]

    def propose(self, view: SlotView) -> DraftTokens:
        if self.cache is None:
            return DraftTokens.none(len(view.slots), self.k)
        slots = view.slots
        drafts, num = self.drafts[slots], self.head_drafts(view)  # [num_seqs, k], [num_seqs]
        if not self.copy_min or not len(slots):
            return DraftTokens(drafts, np.minimum(num, view.max_draft))
        use = self._copying(view)
        drafts = np.where(use[:, None], self.copy_ids[slots], drafts)
        num = np.where(use, self.copy_num[slots], num)
        return DraftTokens(drafts, np.minimum(num, view.max_draft), use.astype(np.int64))

    def head_drafts(self, view: SlotView) -> np.ndarray:
        """[num_seqs] the head's drafts ready for each slot's committed text: none where they were made for
        another length (steps the proposer was not told of: Controller.probing's quiet steps after a PD
        hand-off brought them in)."""
        return np.where(self.drafts_at[view.slots] == view.seq_lens, self.num_drafts[view.slots], 0)

    def _copying(self, view: SlotView) -> np.ndarray:
        """[num_seqs] bool: slots whose next drafts are copies (a tail of >= copy_min tokens occurred before;
        their copy_ids / copy_num current for the committed text)."""
        stale = self.copy_at[view.slots] != view.seq_lens  # copies observe found for another length (or none)
        if stale.any():
            self._find_copies(view.tokens, view.slots[stale], view.seq_lens[stale])
        return self.copy_num[view.slots] > 0

    def _find_copies(self, tokens: np.ndarray, slots: np.ndarray, seq_lens: np.ndarray) -> np.ndarray:
        """n-gram drafts of tails of copy_min..COPY_MAX tokens of these slots (none where no such tail
        occurred before), kept per slot with the length they were found for; returns [len(slots)] bool:
        found."""
        n_max = max(self.COPY_MAX, self.copy_min)
        if self._lib is not None:
            copy = ngram_match_native(self._lib, tokens, slots, seq_lens, self.k, self.copy_min, n_max)[0]
        else:
            copy = ngram_match(tokens[slots], seq_lens, self.k, self.copy_min, n_max)[0]
        self.copy_ids[slots], self.copy_num[slots], self.copy_at[slots] = (
            copy.draft_ids, copy.num_draft, seq_lens)
        return copy.num_draft > 0

    def _ensure(self, num_slots: int) -> None:
        if self.cache is None:
            self.caches = [self.model.new_cache(num_slots, self.model.max_len, num_layers=1)
                           for _ in self.heads]
            self.cache = self.caches[0]
            # modules i >= 1: positions [.., valid[i]) of each slot are exact (main-model positions), and
            # carry[i] is module i - 1's output at position valid[i] (used when module i - 1 starts one
            # position later)
            self.valid = np.zeros((len(self.heads), num_slots), np.int64)
            hidden = self.model.config.hidden_size
            self.carry = [paddle.zeros([num_slots, hidden], self.model.dtype) for _ in self.heads]
            self.drafts = np.zeros((num_slots, self.k), np.int64)
            self.num_drafts = np.zeros(num_slots, np.int64)
            self.drafts_at = np.full(num_slots, -1, np.int64)  # [num_slots] the length they were made for
            # copy_min > 0: each slot's copied drafts [num_slots, k], their count, and the length they are for
            self.copy_ids = np.zeros((num_slots, self.k), np.int64)
            self.copy_num = np.zeros(num_slots, np.int64)
            self.copy_at = np.full(num_slots, -1, np.int64)
            self.shift = np.zeros(num_slots, np.int64)  # [num_slots] main position - head position

    @property
    def clone_safe(self) -> bool:
        """A sample may copy another's prompt rows (copy_prompt gives it the head's too): with one module
        (module i >= 1 is exact i positions behind module 0, its boundary and carried row those of the
        sample's own tokens: several modules prefill each sample)."""
        return len(self.heads) == 1

    def copy_prompt(self, src: int, dst: int, n: int) -> None:
        """`dst` takes `src`'s head cache rows of a prompt of `n` tokens but its last (the rows of positions
        [shift, n - 1): the prompt's alone; position n - 1 pairs with the sample's own first token), as the
        engine copies the main cache's (a sample given its sample 0's prefill); the head catches up the rest
        at dst's first step."""
        if self.cache is None:  # (nothing observed yet: speculation ruled out before any step)
            return
        shift = int(self.shift[src])
        if n - 1 - shift > 0:
            self.cache.copy_slot(src, dst, n - 1 - shift)
        self.shift[dst], self.valid[:, dst] = shift, shift
        self.num_drafts[dst], self.copy_at[dst] = 0, -1

    def export_slot(self, slot: int, seq_len: int) -> dict:
        """`slot`'s drafting state, for a hand-off to another engine (import_slot): each module's cache rows
        up to the last one its chained drafts may have written (head positions [0, seq_len - shift + k)), its
        boundaries, carried rows, the drafts ready for the next step and the copies found."""
        if self.cache is None:
            return {}
        shift = int(self.shift[slot])
        n = min(seq_len - shift + self.k, self.cache.capacity)
        state = {name: np.array(getattr(self, name)[slot]) for name in self.SLOT_ARRAYS}
        state["valid"] = self.valid[:, slot].copy()
        for i, cache in enumerate(self.caches):
            state.update({f"cache{i}.{j}": pieces for j, pieces in enumerate(cache.export_slot(slot, n))})
            state[f"carry{i}"] = self.carry[i][slot].numpy()
        return state

    def import_slot(self, slot: int, state: dict, num_slots: int) -> None:
        """`slot` takes export_slot's state (an engine of num_slots slots)."""
        self._ensure(num_slots)
        if not state:
            return
        for name in self.SLOT_ARRAYS:
            getattr(self, name)[slot] = state[name]
        self.valid[:, slot] = state["valid"]
        for i, cache in enumerate(self.caches):
            cache.import_slot(slot, [state[f"cache{i}.{j}"] for j in range(2 * cache.num_layers)])
            self.carry[i][slot] = paddle.to_tensor(state[f"carry{i}"])

    def observe(self, update: StepUpdate) -> None:
        self._ensure(update.tokens.shape[0])
        c = self._catch_up(update)
        if c is not None:
            self._draft(c)

    def _catch_up(self, update: StepUpdate) -> CatchUp | None:
        """The head's catch-up this step (None: no slot takes part): every position of each live slot whose
        main hidden state and next token became known, from its window on; slots whose next drafts are copies
        only catch up (CatchUp.want False)."""
        if update.broken is not None and update.broken.any():
            for slot in update.slots[update.broken]:
                for cache in self.caches:
                    cache.clear_slot(int(slot))
        if update.finished.any():  # a finished request's drafts and copies are not its slot's next request's
            # (whose first steps the proposer may not be told of: Controller.probing)
            done = update.slots[update.finished]
            self.num_drafts[done], self.copy_at[done], self.copy_num[done] = 0, -1, 0
        live = ~update.finished & (update.num_valid > 0)
        # Slots whose next drafts are copies (found now, from the committed text, for propose) need the head's
        # pass only to catch its cache up: no LM head, no chained drafts (the fused pass leaves them out of
        # last_rows).
        copying = np.zeros(len(live), bool)
        if self.copy_min and update.seq_lens is not None and live.any():
            copying[live] = self._find_copies(update.tokens, update.slots[live], update.seq_lens[live])
        if update.detached is not None:  # drafts stopped paying for these slots: no more head passes for them
            self.num_drafts[update.slots[update.detached]] = 0
            live &= ~update.detached
        if not live.any():
            return None
        slots, first, nv = update.slots[live], update.first_pos[live], update.num_valid[live]
        copying = copying[live]
        index = np.nonzero(live)[0]  # [num_seqs] each sequence's index in the update
        # A slot's first block after a shared prefix also catches up the prefix positions (the head's own
        # cache is per slot), from the prefix's hidden states, kept once, appended after the forward's rows.
        pre = update.prefix_len[live] if update.prefix_len is not None else np.zeros(len(slots), np.int64)
        start, total = first - pre, nv + pre  # [num_seqs]
        new = start == 0  # a slot's first block: a new request, and its window of the prompt
        if self.prompt_window and update.prompt_lens is not None:
            self.shift[slots[new]] = np.maximum(update.prompt_lens[live][new] - self.prompt_window, 0)
        else:
            self.shift[slots[new]] = 0
        self.valid[:, slots[new]] = self.shift[slots[new]]
        shift = self.shift[slots]  # [num_seqs]
        skip = np.clip(shift - start, 0, total)  # leading positions before the slot's window
        start, total = start + skip, total - skip
        block_start = update.block_start[live]
        # [num_seqs] committed tokens (a prompt being prefilled is all known)
        seq_lens = update.seq_lens[live] if update.seq_lens is not None else first + nv + 1
        if not total.all():  # blocks wholly before their window (chunks of a long prompt): no pass
            self.num_drafts[slots[total == 0]] = 0
            keep = total > 0
            if not keep.any():
                return None
            slots, first, nv, copying, shift, start, total, block_start, seq_lens, index = (
                x[keep] for x in (slots, first, nv, copying, shift, start, total, block_start, seq_lens,
                                  index))
        seq = np.repeat(np.arange(len(slots)), total)  # [num_tokens] block of each catch-up token
        # [num_tokens] main-model position of each catch-up token
        pos = start[seq] + np.arange(len(seq)) - np.concatenate([[0], np.cumsum(total)[:-1]])[seq]
        num_rows = int(update.hidden.shape[0])
        offset = pos - first[seq]  # [num_tokens] block index (< 0: a shared-prefix position)
        if update.tree_path is not None:  # a tree's accepted path: its positions' rows are the path's nodes
            tp = update.tree_path  # [num_dec, width + 1]
            on = (index[seq] < len(tp)) & (offset >= 0)
            node = tp[np.minimum(index[seq], len(tp) - 1), np.clip(offset, 0, tp.shape[1] - 1)]
            offset = np.where(on, node, offset)
        rows = np.where(pos < first[seq], num_rows + pos,  # a shared-prefix position -> its prefix row
                        block_start[seq] + offset)  # rows of the main forward
        next_ids = update.tokens[slots[seq], pos + 1]  # token i+1 for position i
        hidden = update.hidden if not pre.any() else paddle.concat([update.hidden, update.prefix_hidden])
        depth = max(1, min(self.k, update.max_draft_next))  # chained drafts worth computing for the next step
        want = ~copying
        self.num_drafts[slots] = np.where(want, depth, 0)
        self.drafts_at[slots] = seq_lens
        return CatchUp(update.tokens, slots, seq, pos, rows, next_ids, hidden, start, total, shift, seq_lens,
                       want, depth, _draw(update, index, seq_lens))

    def _draft(self, c: CatchUp) -> None:
        """The head's pass over the catch-up, and its drafts for the slots that want them."""
        single = len(self.heads) == 1
        drafts, out = self.heads[0].run(self.cache, MtpPass(
            token_slots=c.slots[c.seq], positions=c.pos - c.shift[c.seq], token_ids=c.next_ids, rows=c.rows,
            hidden=c.hidden, seq_lens=c.total, last_rows=(np.cumsum(c.total) - 1)[c.want],
            depth=c.depth if single else 1, draw=None if c.draw is None else c.draw[:, c.want]))
        if single:
            self.drafts[c.slots[c.want], :c.depth] = drafts
            return
        chain = np.zeros((len(c.slots), len(self.heads) + c.depth), np.int64)  # [num_seqs, ..] drafts so far
        chain[c.want, :1] = drafts
        self._later_modules(c.tokens, c.slots, c.start, c.start + c.total - 1, c.seq_lens, c.shift, c.want,
                            c.depth, out, chain, c.draw)
        self.drafts[c.slots[c.want], :c.depth] = chain[c.want, :c.depth]

    def _later_modules(self, tokens: np.ndarray, slots: np.ndarray, start: np.ndarray, end: np.ndarray,
                       seq_lens: np.ndarray, shift: np.ndarray, want: np.ndarray, depth: int, out,
                       chain, draw: np.ndarray | None = None) -> None:
        """Modules 1.. of a multi-layer head, after module 0 caught up positions [start, end] of each sequence
        (main positions; its block outputs `out`) and drafted chain[:, 0] for the wanted ones."""
        prev_start, prev_total = start, end - start + 1  # module i - 1's pass
        for i in range(1, len(self.heads)):
            begin = self.valid[i, slots]  # [num_seqs]
            if ((begin < prev_start - 1) | (begin > prev_start)).any():
                raise EngineError("MTP module caches out of step (module lags by more than one position)")
            total = end - begin + 1  # [num_seqs] >= 1
            seq = np.repeat(np.arange(len(slots)), total)
            pos = begin[seq] + np.arange(len(seq)) - np.concatenate([[0], np.cumsum(total)[:-1]])[seq]
            offsets = np.concatenate([[0], np.cumsum(prev_total)[:-1]])  # [num_seqs] rows of
            # `out` per sequence
            num_out = int(out.shape[0])
            rows = np.where(pos < prev_start[seq], num_out + seq,  # the carried row
                            offsets[seq] + pos - prev_start[seq])
            hidden = paddle.concat([out, paddle.gather(self.carry[i], paddle.to_tensor(slots))])
            idx = pos + 1 + i  # the input token's position: committed, or a draft of an earlier module
            lens = seq_lens[seq]
            ids = tokens[slots[seq], np.minimum(idx, lens - 1)]
            ids = np.where(idx >= lens, chain[seq, np.clip(idx - lens, 0, chain.shape[1] - 1)], ids)
            drafting = want & (depth > i)
            last = i == len(self.heads) - 1
            d = max(1, depth - i) if last else 1  # the last module chains itself for the drafts past it
            later = None  # module i drafts draft i + 1: one output position later
            if draw is not None:
                later = draw[:, drafting].copy()
                later[3] += i
            drafts, new_out = self.heads[i].run(self.caches[i], MtpPass(
                token_slots=slots[seq], positions=pos - shift[seq], token_ids=ids, rows=rows, hidden=hidden,
                seq_lens=total, last_rows=(np.cumsum(total) - 1)[drafting], depth=d, draw=later))
            chain[drafting, i:i + d] = drafts
            # module i's new boundary; the row it will start from when module i - 1 starts one later
            valid = np.minimum(end + 1, seq_lens - 1 - i)
            take = (valid < np.minimum(end + 1, seq_lens - i)) & (valid >= prev_start)
            if take.any():
                src = offsets[take] + valid[take] - prev_start[take]
                self.carry[i] = paddle.scatter(self.carry[i], paddle.to_tensor(slots[take]),
                                               paddle.gather(out, paddle.to_tensor(src)))
            self.valid[i, slots] = valid
            out, prev_start, prev_total = new_out, begin, total



def _draw(update: StepUpdate, index: np.ndarray, seq_lens: np.ndarray) -> np.ndarray | None:
    """MtpPass.draw's columns for the update's sequences `index` ([num_seqs]; committed tokens seq_lens):
    sampled ones draw their drafts coupled to the tokens verification will sample at output positions
    seq_lens - prompt length on. None where none samples (or the prompt lengths are unknown)."""
    s = update.sampling
    if s is None or update.prompt_lens is None or not (s.temperature[index] > 0).any():
        return None
    t = s.temperature[index]
    key = s.rng_key[index].astype(np.uint64)
    inv_t = np.where(t > 0, 1.0 / np.where(t > 0, t, 1.0), 0.0)
    return np.stack([inv_t, (key >> np.uint64(32)).astype(np.float64),
                     (key & np.uint64(0xFFFFFFFF)).astype(np.float64),
                     (seq_lens - update.prompt_lens[index]).astype(np.float64)])


def build_mtp_proposer(d: Drafting) -> MtpProposer:
    """The head comes from speculative.mtp.model (--mtp-model) or speculative.draft_model (--draft-model),
    else from the package when it ships one for this main model."""
    c, model = d.section, d.model
    path = c.model or d.draft_model or shipped_head(str(model.source))
    if path is None:
        raise CheckpointError("--method mtp needs an MTP head: give --mtp-model DIR (DeepSeek-V3 or "
                              "ERNIE-4.5 layout; `specgen train-mtp` trains one); "
                              "the main checkpoint has none")
    where = Path(path).resolve()
    heads = prepared_once(model, checkpoint_key(where, "mtp", c.quantize), lambda: [
        model.backend.prepare_drafter(model, m, c.quantize)
        for m in MtpHeadWeights.read_modules(load_mtp_weights(path), str(path), model,
                                             load_draft_vocab(path))])
    return MtpProposer(model, heads, d.k, training_setting(where, "eval_acc"), c.copy, prompt_window(where),
                       d.lib)
