"""Draft-model drafting: a smaller model with the main model's vocabulary proposes k tokens per slot (greedy,
or for sampled requests sampled with the main model's own noise), one forward per draft position over every
drafting slot at once; the main model verifies them in its own step.

Cache invariant: the draft keeps its own KV cache in the main model's slot layout. After each step, for a slot
it caught up, positions [0, valid) hold exact entries (valid = the tokens the main model has processed or
committed); the draft chain's entries past them are overwritten by the next catch-up, as the main cache's
rejected drafts are. A prompt is caught up chunk by chunk as the main model prefills it; a decoding slot feeds
its committed tokens [valid, seq_len): the tokens the last verification accepted plus the main model's own. A
slot the controller detached catches up whatever it missed when it drafts again. A prompt prefix the main
model shares (cascade attention) is shared by the draft too: computed once into its cache's shared prefix,
each slot's own rows starting after it. With a prompt window the draft reads only a prompt's last positions
(its own positions start there, as an MTP head's do), so a long prompt does not cost it a prefill of its own
per request. Past the draft's context (a draft with a shorter one than the main model) a slot gets no drafts
and decodes plainly.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import paddle

from specgen.backends.base import RowSampling
from specgen.config import EngineConfig
from specgen.engine.proposers.base import Drafting, SlotView, checkpoint_key, prepared_once
from specgen.engine.types import DraftTokens, SlotSampling, StepUpdate
from specgen.errors import CheckpointError
from specgen.models.loaded import load_model
from specgen.models.model import Model
from specgen.models.tokenizer import TextTokenizer
from specgen.runtime.batch import build_forward_batch
from specgen.runtime.kv_cache import KVCache


class DraftModelProposer:
    """Drafts k tokens per slot with a separate draft model; drafts for the next step are made in observe."""

    acceptance_hint = None
    idle_when_detached = True  # a detached slot's draft neither catches up nor drafts
    probes_when_detached = False
    copies_when_detached = False

    def __init__(self, draft: Model, k: int, prompt_window: int = 0):
        """prompt_window: a prompt's last positions the draft reads (0: all); its own positions start
        there."""
        self.draft, self.k, self.prompt_window = draft, k, prompt_window
        self.cache: KVCache | None = None  # made at the first observe, with the main cache's slots
        self.drafts = np.zeros((0, k), np.int64)  # [num_slots, k] drafts ready for each slot's next step
        self.num_drafts = np.zeros(0, np.int64)  # [num_slots]
        self.valid = np.zeros(0, np.int64)  # [num_slots] leading positions whose draft-cache entries are
        # exact
        self.prefix_lens = np.zeros(0, np.int64)  # [num_slots] positions each slot reads from the shared
        # prefix
        self.shift = np.zeros(0, np.int64)  # [num_slots] main-model position - draft position (prompt window)

    def propose(self, view: SlotView) -> DraftTokens:
        if self.cache is None:
            return DraftTokens.none(len(view.slots), self.k)
        return DraftTokens(self.drafts[view.slots], np.minimum(self.num_drafts[view.slots], view.max_draft))

    def _ensure(self, num_slots: int) -> None:
        if self.cache is None:
            self.cache = self.draft.new_cache(num_slots, self.draft.max_len)
            self.valid = np.zeros(num_slots, np.int64)
            self.prefix_lens = np.zeros(num_slots, np.int64)
            self.shift = np.zeros(num_slots, np.int64)
            self.drafts = np.zeros((num_slots, self.k), np.int64)
            self.num_drafts = np.zeros(num_slots, np.int64)

    clone_safe = True  # copy_prompt gives a sample its sample 0's rows of the prompt

    def copy_prompt(self, src: int, dst: int, n: int) -> None:
        """`dst` takes `src`'s draft cache rows of a prompt of `n` tokens (the draft's KV of a position
        depends on the tokens up to it: the prompt's alone), a shared prefix's rows as its own, as the engine
        copies the main cache's (a sample given its sample 0's prefill); the draft feeds the rest at dst's
        first step."""
        if self.cache is None:  # (nothing observed yet: speculation ruled out before any step)
            return
        shift = int(self.shift[src])
        end = min(n, int(self.valid[src]))  # main-model positions [.., end) exact in src's rows
        pre = int(self.prefix_lens[src]) if self.cache.prefix is not None else 0
        if end - shift > 0:
            self.cache.copy_slot(src, dst, end - shift, pre)
        self.shift[dst], self.valid[dst], self.prefix_lens[dst] = shift, max(end, shift), 0
        self.num_drafts[dst] = 0

    def export_slot(self, slot: int, seq_len: int) -> dict:
        """`slot`'s drafting state, for a hand-off to another engine (import_slot): the draft cache's rows up
        to the last one its chain may have written (its positions [0, seq_len - shift + k)), a shared prefix's
        rows first, and its boundary, window shift and the drafts ready for the next step."""
        if self.cache is None:
            return {}
        shift = int(self.shift[slot])
        pre = int(self.prefix_lens[slot]) if self.cache.prefix is not None else 0
        n = min(seq_len - shift + self.k, pre + self.cache.capacity)
        state = {name: np.array(getattr(self, name)[slot])
                 for name in ("valid", "shift", "drafts", "num_drafts")}
        state.update({f"cache.{j}": pieces for j, pieces in enumerate(self.cache.export_slot(slot, n, pre))})
        return state

    def import_slot(self, slot: int, state: dict, num_slots: int) -> None:
        """`slot` takes export_slot's state (an engine of num_slots slots); a shared prefix's rows are its own
        now."""
        self._ensure(num_slots)
        if not state:
            return
        for name in ("valid", "shift", "drafts", "num_drafts"):
            getattr(self, name)[slot] = state[name]
        self.prefix_lens[slot] = 0
        self.cache.import_slot(slot, [state[f"cache.{j}"] for j in range(2 * self.cache.num_layers)])

    def observe(self, update: StepUpdate) -> None:
        self._ensure(update.tokens.shape[0])
        if update.broken is not None and update.broken.any():
            for slot in update.slots[update.broken]:
                self.cache.clear_slot(int(slot))
        pre = update.prefix_len if update.prefix_len is not None else np.zeros(len(update.slots), np.int64)
        fresh = update.first_pos - pre == 0  # [num_seqs] a slot's first block: a new request
        shift = np.zeros(len(pre), np.int64)  # [num_seqs] a new request's prompt positions before its window
        if self.prompt_window and update.prompt_lens is not None:
            shift = np.maximum(update.prompt_lens - self.prompt_window, 0)
        # positions read from the shared prefix (none for a request whose window starts past position 0)
        shared = self._share_prefix(update, fresh, np.where(shift > 0, 0, pre))
        new = update.slots[fresh]
        self.prefix_lens[new], self.shift[new] = shared[fresh], shift[fresh]
        self.valid[new] = np.maximum(shared[fresh], shift[fresh])
        self.num_drafts[update.slots] = 0
        seq_lens, prompt_lens = update.seq_lens, update.prompt_lens
        if seq_lens is None or prompt_lens is None:
            return
        # slots caught up: every running one not detached by the controller; a prompt chunk's tokens as the
        # main model prefilled them, a decoding slot's up to its last committed token (it then drafts)
        decoding = seq_lens > prompt_lens
        live = ~update.finished
        if update.detached is not None:
            live &= ~update.detached
        ends_all = np.where(decoding, seq_lens, update.first_pos + update.num_valid)  # [num_seqs]
        sel = np.nonzero(live)[0]
        # room for the draft to write (past its context the slot goes on without drafts), and something
        # to feed
        room = ends_all[sel] - self.shift[update.slots[sel]] < self.draft.max_len
        sel = sel[room & (ends_all[sel] > self.valid[update.slots[sel]])]
        if not len(sel):
            return
        slots, ends = update.slots[sel], ends_all[sel]  # [n] main-model positions
        shift = self.shift[slots]  # [n]
        starts = self.valid[slots]
        lens = ends - starts  # [n] >= 1: at least the last committed token
        seq = np.repeat(np.arange(len(slots)), lens)
        pos = starts[seq] + np.arange(len(seq)) - np.concatenate([[0], np.cumsum(lens)[:-1]])[seq]
        tokens = update.tokens[slots[seq], pos]  # [num_tokens] the committed tokens fed
        plens = self.prefix_lens[slots] if self.cache.prefix is not None else None
        wants = decoding[sel]  # [n] drafting next step
        choose = _DraftChoice(self.draft, update.sampling, sel[wants], prompt_lens[sel[wants]])
        out = self.draft.forward(build_forward_batch(slots, starts - shift, lens, tokens,
                                                     np.zeros(len(slots), bool), prefix_lens=plens),
                                 self.cache, logits=choose.sampled)
        self.valid[slots] = ends
        if not wants.any():
            return
        rows = np.nonzero(wants)[0]
        logits = paddle.gather(out.logits, paddle.to_tensor(rows)) if choose.sampled else None
        slots, ends, shift = slots[rows], ends[rows], shift[rows]
        plens = plens[rows] if plens is not None else None
        depth = max(1, min(self.k, update.max_draft_next))
        drafts = np.zeros((len(slots), self.k), np.int64)
        drafts[:, 0] = choose(logits, out.greedy[rows], ends)  # [n] the token after each slot's last one
        for j in range(1, depth):  # one forward per draft position, over every drafting slot
            positions = ends + j - 1 - shift  # the draft's own
            ok = positions < self.draft.max_len - 1
            if not ok.all():
                break
            batch = build_forward_batch(slots, positions, np.ones(len(slots), np.int64), drafts[:, j - 1],
                                        np.zeros(len(slots), bool), prefix_lens=plens)
            step = self.draft.forward(batch, self.cache, logits=choose.sampled)
            drafts[:, j] = choose(step.logits, step.greedy, ends + j)
        else:
            j = depth
        self.drafts[slots] = drafts
        self.num_drafts[slots] = depth if j == depth else j

    def _share_prefix(self, update: StepUpdate, fresh: np.ndarray, pre: np.ndarray) -> np.ndarray:
        """[num_seqs] positions each new request reads from the draft's shared prefix (0: none). The first new
        request after the main model shared a prefix makes the draft's: its KV of those tokens computed once
        into the draft cache's shared prefix, as the main cache's (a request sharing more than that computes
        its own)."""
        use = fresh & (pre > 0)
        if not use.any():
            return np.zeros(len(pre), np.int64)
        if self.cache.prefix is None:
            j = int(np.nonzero(use)[0][0])
            n = int(pre[j])
            ids = update.tokens[update.slots[j], :n]
            prefix = self.draft.new_cache(1, n)
            self.draft.forward(build_forward_batch(np.zeros(1, np.int64), np.zeros(1, np.int64),
                                                   np.array([n]), ids, np.zeros(1, bool)),
                               prefix, logits=False)
            self.cache.prefix, self.prefix_ids = prefix, ids
        n = len(self.prefix_ids)
        ok = use & (pre <= n)
        if ok.any():  # the same tokens (the main model shares one prefix per job; checked all the same)
            rows = update.tokens[update.slots[ok], :n]  # [m, n]
            beyond = np.arange(n)[None, :] >= pre[ok][:, None]  # positions past each one's own prefix
            ok[ok] = ((rows == self.prefix_ids[None, :]) | beyond).all(axis=1)
        return np.where(ok, pre, 0)


class _DraftChoice:
    """How the draft picks each draft: greedy for greedy requests; for sampled ones, the counter-based sample
    of its own distribution with the noise the main model will use at that output position
    (layers/sampling.py's rule, by the draft's backend's sampler), so that where the two distributions are
    close the draft proposes the very token verification will sample."""

    def __init__(self, draft, sampling: SlotSampling | None, sel: np.ndarray, prompt_lens: np.ndarray):
        self.draft, self.sampling, self.sel, self.prompt_lens = draft, sampling, sel, prompt_lens
        self.sampled = sampling is not None and bool((sampling.temperature[sel] > 0).any())

    def __call__(self, logits, greedy: np.ndarray, token_index: np.ndarray) -> np.ndarray:
        """[n] the draft for token index `token_index` (the committed tokens' count before it) of each
        sequence, from the draft's logits [n, vocab] (None when every one is greedy) and their argmax [n]."""
        if not self.sampled:
            return greedy
        s, sel = self.sampling, self.sel
        min_p = np.zeros(len(sel)) if s.min_p is None else s.min_p[sel]
        rows = RowSampling(s.temperature[sel], s.top_k[sel], s.top_p[sel], min_p, s.rng_key[sel],
                           token_index - self.prompt_lens)
        return self.draft.sample(logits, rows, greedy)


def check_vocabulary(main: TextTokenizer | None, draft: TextTokenizer | None, main_size: int, draft_size: int,
                     where: str) -> None:
    """The draft must share the main model's vocabulary: the same size and, token by token, the same
    strings."""
    if main_size != draft_size:
        raise CheckpointError(f"{where}: the draft model's vocabulary has {draft_size} tokens, the main "
                              f"model's {main_size}; a draft model must share the main model's vocabulary")
    if main is None or draft is None:
        return
    a, b = main.tokenizer, draft.tokenizer
    for i in range(min(a.get_vocab_size(), b.get_vocab_size(), main_size)):
        if a.id_to_token(i) != b.id_to_token(i):
            raise CheckpointError(f"{where}: token {i} differs ({a.id_to_token(i)!r} in the main model, "
                                  f"{b.id_to_token(i)!r} in the draft); a draft model must share the main "
                                  "model's vocabulary")


def build_draft_model_proposer(d: Drafting) -> DraftModelProposer:
    """The draft checkpoint (d.draft_model) loaded beside d.model with the main model's load settings
    (backend, dtype, quantization, threads: d.main, its api.LoadedModel; defaults without one), its vocabulary
    checked against the main model's; loaded once per main model."""
    model, main = d.model, d.main
    path = str(d.draft_model)

    def make() -> Model:
        settings = main.engine if main is not None else EngineConfig(dtype=model.dtype)
        loaded = load_model(path, settings, quantization=draft_quantization(model, settings.quantization))
        check_vocabulary(main.tokenizer if main is not None else None, loaded.tokenizer,
                         model.config.vocab_size, loaded.config.vocab_size, path)
        return loaded.model

    draft = prepared_once(model, checkpoint_key(path, "draft_model"), make)
    proposer = DraftModelProposer(draft, d.k, d.section.prompt_window)
    proposer.acceptance_hint = recorded_acceptance(Path(path))
    return proposer


def recorded_acceptance(directory: Path) -> float | None:
    """The held-out first-draft acceptance `specgen make-draft --data` recorded in the draft's config.json, if
    any: the controller rules the draft out before the first step where even that could not pay (32 slots of
    short requests otherwise each drafted until they detached: 0.95x of plain decoding on math)."""
    try:
        value = json.loads((directory / "config.json").read_text())["specgen_draft"]["training"]["eval_acc"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def draft_quantization(model: Model, main_mode: str) -> str:
    """The draft quantizes with the main model: its mode when one was asked for; under auto, to 8-bit blocks
    (wint8) beside a main model kept in blocks (a float draft is not rounded to 4 bits: a distilled draft of
    the default model agreed with it 0.21 instead of 0.34 of the time on math in Q4_1, 0.34 in Q8_0), else as
    the draft's checkpoint stores it."""
    if main_mode != "auto":
        return main_mode
    return "wint8" if model.weights.block_kinds else "auto"

