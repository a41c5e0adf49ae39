"""Medusa heads (Cai et al., 2024): K heads on the main model's last hidden state, head i guessing the token
i + 1 places after the next one; their top-k guesses make a token tree of a static shape (Medusa's choices).

A head is `num_layers` residual blocks x + SiLU(x W + b) and its own LM head, or the main model's (their
checkpoints: specgen/drafters/medusa.py). After each step
the heads read the hidden state of every slot's last position whose next token is known (a tree's accepted
path: StepUpdate.tree_path) and keep their top-k per head; the next step's tree takes, for the node at path
(r_1, ..., r_d), head d's r_d-th guess. Drafts only: the engine's tree walk keeps the output exact.
"""
from __future__ import annotations

import copy

import numpy as np
import paddle
import paddle.nn.functional as F

from specgen.drafters.medusa import WEIGHTS, MedusaHeads, load_medusa, shipped_heads
from specgen.engine.proposers.base import Drafting, SlotView, checkpoint_key, prepared_once
from specgen.engine.types import DraftTokens, StepUpdate
from specgen.errors import CheckpointError


def tree_to_depth(paths: tuple[tuple[int, ...], ...], depth: int) -> tuple[tuple[int, ...], ...]:
    """A static tree's paths cut to `depth` (--num-speculative-tokens: every tree method's depth), in order,
    without repeats."""
    return tuple(dict.fromkeys(p[:depth] for p in paths))


def tree_template(paths: tuple[tuple[int, ...], ...], num_heads: int, topk: int):
    """(head [n] int64, rank [n] int64, parents [n] int64) of the nodes of `paths` (and their prefixes) that
    the heads can fill (depth <= num_heads, rank < topk), parents first."""
    keep = {p[:d] for p in paths for d in range(1, len(p) + 1)}
    nodes = sorted((p for p in keep if len(p) <= num_heads and all(r < topk for r in p)),
                   key=lambda p: (len(p), p))
    index = {p: i + 1 for i, p in enumerate(nodes)}  # block index (0: the root)
    head = np.array([len(p) - 1 for p in nodes], np.int64)
    rank = np.array([p[-1] for p in nodes], np.int64)
    parents = np.array([index.get(p[:-1], 0) for p in nodes], np.int64)
    return head, rank, parents


class MedusaProposer:
    """Token trees from Medusa heads' top-k guesses."""

    acceptance_hint = None
    idle_when_detached = True  # no head passes for detached slots
    probes_when_detached = False
    copies_when_detached = False

    def __init__(self, heads: MedusaHeads, topk: int, paths: tuple[tuple[int, ...], ...],
                 lm_head: paddle.Tensor | None = None):
        """lm_head: the main model's [hidden, vocab], for heads that share it."""
        self.heads, self.topk = heads, topk
        self.head, self.rank, self.parents = tree_template(paths, heads.num_heads, topk)
        self.topk = int(self.rank.max(initial=0)) + 1  # guesses the template uses per head
        # A few rows a step: Paddle's per-operator overhead is most of the heads' cost (four heads one by one,
        # with a host copy each: 3.4 ms a step at batch 1, a quarter of the default model's step), so all
        # heads run as one product where they can, with one host copy. (numpy is no way out: beside Paddle's
        # threads its products ran ~30x slower here.)
        vocab = None if heads.draft_vocab is None else paddle.to_tensor(heads.draft_vocab)
        # [K] [hidden, vocab'] each head's LM head over the draft vocabulary (vocab' = vocab without one); a
        # shared one is one tensor, so that all heads' logits are one product
        self.shared = heads.lm_heads is None
        lms = [lm_head] if self.shared else heads.lm_heads
        self.lm = [lm if vocab is None or heads.lm_draft_columns else paddle.gather(lm, vocab, axis=1)
                   for lm in lms]
        self.lm_bias: list[paddle.Tensor | None] = [None] * heads.num_heads  # [K] [vocab'] (Hydra's LM heads)
        self.guesses = np.zeros((0, len(self.head)), np.int64)  # [num_slots, width] node tokens of
        # the next step
        self.ready = np.zeros(0, bool)  # [num_slots] guesses made from the slot's current request
        self._prepare_blocks()

    def _prepare_blocks(self) -> None:
        """One-layer heads stacked, W [hidden, K hidden] and b [K hidden], so that all heads are one
        product."""
        self.stacked = None
        if all(len(layers) == 1 for layers in self.heads.blocks):
            self.stacked = (paddle.concat([layers[0][0] for layers in self.heads.blocks], axis=1),
                            paddle.concat([layers[0][1] for layers in self.heads.blocks]))

    def fresh(self) -> "MedusaProposer":
        """A proposer sharing these prepared heads, with no slot state: one per engine (preparing the heads,
        the shared LM head's draft-vocabulary columns above all, took 80-110 ms per engine)."""
        new = copy.copy(self)
        new.guesses, new.ready = np.zeros((0, len(self.head)), np.int64), np.zeros(0, bool)
        return new

    def _grow(self, num_slots: int) -> None:
        if len(self.ready) < num_slots:
            n = num_slots - len(self.ready)
            self.guesses = np.concatenate([self.guesses, np.zeros((n, *self.guesses.shape[1:]), np.int64)])
            self.ready = np.concatenate([self.ready, np.zeros(n, bool)])

    def propose(self, view: SlotView) -> DraftTokens:
        n, width = len(view.slots), len(self.head)
        self._grow(int(view.slots.max(initial=-1)) + 1)
        ids = self.guesses[view.slots]  # [num_seqs, width]
        num = np.where(self.ready[view.slots], width, 0).astype(np.int64)
        return DraftTokens(ids, num, None, np.broadcast_to(self.parents, (n, width)).copy())

    # its state is the guesses from a slot's last hidden state: a sample that copies its prompt's rows and
    # prefills the last token makes its own
    clone_safe = True

    def export_slot(self, slot: int, seq_len: int) -> dict:
        """`slot`'s guesses for its next step, for a hand-off to another engine (import_slot)."""
        self._grow(slot + 1)
        return {"guesses": self.guesses[slot].copy(), "ready": np.array(self.ready[slot])}

    def import_slot(self, slot: int, state: dict, num_slots: int) -> None:
        self._grow(num_slots)
        self.guesses[slot], self.ready[slot] = state["guesses"], state["ready"]

    def observe(self, update: StepUpdate) -> None:
        slots = update.slots
        self._grow(int(slots.max(initial=-1)) + 1)
        self.ready[slots[update.finished]] = False
        j = update.num_valid - 1  # [num_seqs] the last position whose next token is known
        # ... and it is the slot's last but one (not a prompt chunk with more of the prompt to come)
        live = (j >= 0) & ~update.finished & (update.first_pos + j == update.seq_lens - 2)  # [num_seqs]
        if update.detached is not None:  # drafts stopped paying for these slots: no more head passes for them
            self.ready[slots[update.detached]] = False
            live &= ~update.detached
        if not live.any():
            return
        index = j.copy()
        if update.tree_path is not None:
            d = len(update.tree_path)
            index[:d] = update.tree_path[np.arange(d), np.maximum(j[:d], 0)]
        rows = (update.block_start + index)[live]
        x0 = paddle.gather(update.hidden, paddle.to_tensor(rows))  # [num_live, hidden]
        root = update.tokens[slots[live], update.seq_lens[live] - 1]  # [num_live] the next step's root token
        self.guesses[slots[live]] = self.draft(x0, root)
        self.ready[slots[live]] = True

    def top(self, h: int, x: paddle.Tensor) -> paddle.Tensor:
        """[rows, topk] columns of the draft vocabulary (int64, on the device): head h's LM head over its
        output x [rows, hidden], best first."""
        logits = paddle.matmul(x, self.lm[0 if self.shared else h])  # [rows, vocab']
        if self.lm_bias[h] is not None:
            logits = logits + self.lm_bias[h]
        return paddle.topk(logits, self.topk, axis=-1)[1]

    def ids(self, columns: np.ndarray) -> np.ndarray:
        """Token ids of draft-vocabulary columns."""
        return columns if self.heads.draft_vocab is None else self.heads.draft_vocab[columns]

    def draft(self, x0: paddle.Tensor, root: np.ndarray) -> np.ndarray:
        """[num_live, width] the tree's node tokens from the hidden states x0 [num_live, hidden] (Medusa heads
        do not read the root token [num_live])."""
        n, K = x0.shape[0], self.heads.num_heads
        if self.stacked is not None:  # every head in one product: [n, K, hidden]
            w, b = self.stacked
            x = x0.unsqueeze(1) + F.silu(paddle.matmul(x0, w) + b).reshape([n, K, -1])
        else:
            x = paddle.stack([_blocks(x0, layers) for layers in self.heads.blocks], axis=1)
        if self.shared:
            top = self.top(0, x.reshape([n * K, -1])).numpy().reshape(n, K, self.topk)
        else:
            top = np.stack([self.top(h, x[:, h]).numpy() for h in range(K)], axis=1)  # [n, K, topk]
        return self.ids(top[:, self.head, self.rank])


def _blocks(x: paddle.Tensor, layers) -> paddle.Tensor:
    for w, b in layers:
        x = x + F.silu(paddle.matmul(x, w) + b)
    return x


def build_medusa_proposer(d: Drafting) -> MedusaProposer:
    """--method medusa: the heads at --draft-model, trees of the medusa section's shape, k deep at most."""
    model, c = d.model, d.section
    cfg = model.config
    path = d.draft_model or shipped_heads("medusa", str(model.source))
    if path is None:
        raise CheckpointError("--method medusa needs --draft-model PATH (Medusa heads: a directory with "
                              f"{WEIGHTS}; `specgen train-head --kind medusa` trains them); heads ship for "
                              "the default model only")
    paths = tree_to_depth(c.tree_paths(), d.k)

    def make() -> MedusaProposer:
        heads = load_medusa(path, cfg.hidden_size, cfg.vocab_size, model.dtype)
        return MedusaProposer(heads, c.topk, paths, shared_lm_head(model, heads.lm_heads))

    return prepared_once(model, checkpoint_key(path, "medusa", c.topk, paths), make).fresh()


def shared_lm_head(model, lm_heads) -> paddle.Tensor | None:
    """The main model's LM head [hidden, vocab] in its dtype, for heads that share it (lm_heads None). A tied
    one is the embedding, already dense: dequantizing a GGUF LM head took 0.2-0.3 s per engine."""
    if lm_heads is not None:
        return None
    if model.config.tie_word_embeddings:
        return model.weights.embed.astype(model.dtype).T
    return model.weights.lm_head.dense().astype(model.dtype)


