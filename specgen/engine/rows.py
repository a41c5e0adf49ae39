"""The logit rows a step samples from, processed before sampling where a request asks: penalties, logit bias
and min_tokens (engine/penalties.py), and the tokens a response_format's grammar allows (engine/grammar.py).

Every row is processed as plain decoding processes the position it stands for: with the committed tokens and
the drafts before it on its path (a chain's earlier drafts, a tree node's ancestors), so speculation changes
no token. Rows of other slots are left as the model gave them (their greedy choice too: a screened LM head's).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import paddle

from specgen.engine import penalties
from specgen.engine.grammar import Grammars
from specgen.engine.plan import StepBlocks, StepPlan, in_blocks
from specgen.engine.slots import SlotLists, SlotTable


@dataclass(frozen=True)
class Processing:
    """What processes rows: the slot table (penalties, min_tokens, sampling), the model's LM head, the EOS
    ids, and the tables made when a request first has a logit bias, stop token ids or a grammar (None
    before)."""

    table: SlotTable
    head: Callable[[paddle.Tensor], paddle.Tensor]  # the LM head: final normed hidden rows -> logits
    eos_ids: np.ndarray  # [num_eos] int64
    bias_table: SlotLists | None
    stop_table: SlotLists | None
    grammars: Grammars | None


@dataclass(frozen=True)
class Picked:
    """The processed rows: their blocks and positions in the step, and their logit rows."""

    seq: np.ndarray  # [n] int64 block of each processed row
    col: np.ndarray  # [n] int64 its position in the block (a tree: block index)
    rows: np.ndarray  # [num_seqs, width + 1] int64 each block position's logit row
    fed: np.ndarray  # [num_seqs, width + 1] bool the block positions with a logit row


def processed(p: Processing, plan: StepPlan, blocks: StepBlocks, out):
    """(logits, greedy) with the rows of penalized and constrained slots processed (the grammar wins over
    min_tokens: a row it would leave empty keeps the grammar's tokens). A step without logits (every
    processed row constrained and greedy, none penalized): the model's greedy token stands where the grammar
    allows it (the argmax over all allowed tokens then), and only the rows where it does not get their logits
    from the LM head (returned logits None)."""
    t, slots, logits = p.table, blocks.slots, out.logits
    constrained = np.zeros(len(slots), bool) if p.grammars is None else p.grammars.active[slots]  # [num_seqs]
    rows = in_blocks(plan, blocks, np.arange(len(blocks.batch.logit_rows)))  # [num_seqs, width + 1]
    fed = np.zeros(rows.shape, bool)
    fed[: len(plan.dec)] = blocks.dec_mask
    fed[len(plan.dec):, 0] = plan.final
    seq, col = np.nonzero(fed & (t.penalized[slots] | constrained)[:, None])  # [n]
    pick = Picked(seq, col, rows, fed)
    picked = rows[seq, col]  # [n] the processed logit rows
    if logits is None:
        return None, _lazy_greedy(p, plan, blocks, pick, constrained, out)
    whole = np.array_equal(picked, np.arange(logits.shape[0]))
    # [n, vocab] a copy of the processed rows (gathered first unless all are)
    x = logits.numpy() if whole else paddle.gather(logits, paddle.to_tensor(picked)).numpy()
    if t.penalized[slots[seq]].any():
        _penalize(p, plan, blocks, pick, x)
    if constrained.any():
        at, ok = _allowed(p, plan, blocks, pick, constrained)
        masked = x[at]  # [r, vocab]
        # (a row after a draft that ends the grammar, EOS, allows nothing: it is never kept, and stays
        # unmasked)
        np.copyto(masked, -np.inf, where=~ok & ok.any(axis=1)[:, None])
        empty = np.isneginf(masked).all(axis=1)
        if empty.any():  # min_tokens held back what alone the grammar allows (EOS): the grammar wins
            raw = paddle.gather(logits, paddle.to_tensor(picked[at[empty]])).numpy()
            masked[empty] = np.where(ok[empty], raw, -np.inf)
        x[at] = masked
    if out.greedy is not None:
        greedy = out.greedy.copy()
    elif whole:
        greedy = np.zeros(len(picked), np.int64)
    else:
        greedy = paddle.argmax(logits, axis=-1).numpy().astype(np.int64)
    greedy[picked] = x.argmax(axis=-1)  # the lowest id on a tie
    # sampled rows: the sampler reads the processed rows (so do processed log-probabilities)
    if (t.temperature[slots[seq]] > 0).any() or (t.logprobs & t.processed_logprobs)[slots[seq]].any():
        logits = paddle.scatter(logits, paddle.to_tensor(picked), paddle.to_tensor(x))
    return logits, greedy


def _lazy_greedy(p: Processing, plan: StepPlan, blocks: StepBlocks, pick: Picked, constrained: np.ndarray,
                 out) -> np.ndarray:
    """Greedy tokens of a step without logits whose processed rows are all constrained: the model's own
    where the grammar allows it (it is the lowest-id argmax over all tokens, so over the allowed ones too),
    else the argmax of the row's logits (the LM head over its hidden state) over the allowed tokens."""
    greedy = out.greedy.copy()  # [num_logits]
    at, ok = _allowed(p, plan, blocks, pick, constrained)
    rows = pick.rows[pick.seq[at], pick.col[at]]  # [r] logit rows
    redo = ~ok[np.arange(len(at)), greedy[rows]] & ok.any(axis=1)  # [r]
    if redo.any():
        hidden = paddle.gather(out.hidden, paddle.to_tensor(blocks.batch.logit_rows[rows[redo]]))
        x = p.head(hidden).numpy()  # [redo, vocab]
        greedy[rows[redo]] = np.where(ok[redo], x, -np.inf).argmax(axis=-1)
    return greedy


def _penalize(p: Processing, plan: StepPlan, blocks: StepBlocks, pick: Picked, x: np.ndarray) -> None:
    """Penalties, logit bias and min_tokens into the processed rows `x` [n, vocab] (rows of slots without
    them are left as they are: their entries' penalties are neutral)."""
    t, seq, col, rows = p.table, pick.seq, pick.col, pick.rows
    width = rows.shape[1] - 1
    ps, n, vocab = blocks.slots[seq], len(seq), x.shape[1]
    tokens = t.tokens[ps]  # [n, capacity] each row's slot's tokens
    out_row, out_tok = penalties.row_tokens(tokens, t.prompt_len[ps], t.seq_len[ps])
    dec = seq < len(plan.dec)
    if dec.any() and width:  # the drafts on each verified position's path
        where = np.full(rows.shape, -1)
        where[seq, col] = np.arange(n)
        i, b, a = np.nonzero(penalties.on_path(plan.num_draft, plan.drafts.parents, width))
        at = where[i, b]
        out_row = np.concatenate([out_row, at[at >= 0]])
        out_tok = np.concatenate([out_tok, plan.drafts.draft_ids[i[at >= 0], a[at >= 0] - 1]])
    rep = t.repetition_penalty[ps] != 1  # only these rows need their prompt's tokens
    prompt = penalties.row_tokens(tokens[rep], np.zeros(int(rep.sum()), np.int64), t.prompt_len[ps[rep]])
    prompt = (np.nonzero(rep)[0][prompt[0]], prompt[1])
    bias = (np.zeros(0, np.int64),) * 2 + (np.zeros(0),)
    if p.bias_table is not None:
        br, bc = np.nonzero(p.bias_table.ids[ps] >= 0)
        bias = (br, p.bias_table.ids[ps][br, bc], p.bias_table.values[ps][br, bc])
    depth = col.copy()  # each row's output tokens after the committed ones (a tree node: its depth)
    if plan.depth is not None:
        depth[dec] = plan.depth[seq[dec], col[dec]]
    # rows short of min_tokens: EOS and their stop ids masked
    held = np.nonzero(t.seq_len[ps] - t.prompt_len[ps] + depth < t.min_tokens[ps])[0]
    eos = (np.repeat(held, len(p.eos_ids)), np.tile(p.eos_ids, len(held)))
    if p.stop_table is not None:
        stops = p.stop_table.ids[ps[held]]
        sr, sc = np.nonzero(stops >= 0)
        eos = (np.concatenate([eos[0], held[sr]]), np.concatenate([eos[1], stops[sr, sc]]))
    touched = penalties.Touched.gather(vocab, (out_row, out_tok), prompt, bias, eos)
    factors = penalties.RowPenalties(t.repetition_penalty[ps], t.presence_penalty[ps],
                                     t.frequency_penalty[ps])
    at = (touched.row, touched.token)
    x[at] = penalties.apply(x[at], touched, factors)  # rounded to the model's dtype


def _allowed(p: Processing, plan: StepPlan, blocks: StepBlocks, pick: Picked,
             constrained: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The processed rows of constrained slots (at [r]: indices into pick's rows) and the tokens the
    grammar's state at each allows (ok [r, vocab] bool)."""
    num_dec, seq, col = len(plan.dec), pick.seq, pick.col
    blk = np.nonzero(constrained & pick.fed[:, 0])[0]  # [m] constrained blocks with rows
    drafts = [plan.drafts.draft_ids[b, : plan.num_draft[b]].tolist() if b < num_dec else [] for b in blk]
    parents = None
    if plan.drafts.parents is not None:
        parents = np.zeros((len(blk), plan.drafts.parents.shape[1]), np.int64)
        parents[blk < num_dec] = plan.drafts.parents[blk[blk < num_dec]]
    lens = np.array([len(d) + 1 for d in drafts], np.int64)
    first = np.cumsum(lens) - lens  # [m] each block's first mask row
    allowed = p.grammars.masks(blocks.slots[blk], first, drafts, parents, int(lens.sum()))
    offset = np.full(len(blocks.slots), -1, np.int64)
    offset[blk] = first
    at = np.nonzero(offset[seq] >= 0)[0]  # processed rows of constrained blocks
    return at, allowed[offset[seq[at]] + col[at]]
