"""EAGLE drafting (Li et al., 2024): a feature-level draft layer grows a token tree for each slot; EAGLE-2's
dynamic tree keeps the nodes of highest cumulative draft probability, or a static shape keeps given paths.

The layer (public EAGLE layout, `--draft-model DIR`): at position i, x = fc([embedding of token i + 1; feature
at i]) (+ fc.bias), one Llama decoder layer (`layers.0.*`; EAGLE-1's layer 0 has no input norm, a layer that
has `input_layernorm` uses it), then an optional final norm (`norm.weight`); that output feature feeds the
main model's LM head (the distribution of token i + 2) and is the next draft's feature input. Embedding and LM
head are the main model's. The feature at a committed position is the main model's final normed hidden state
there (what EAGLE's reference code feeds, `StepUpdate.hidden`).

Cache: the layer's own KV cache in the slot layout, caught up after every step on the positions whose main
hidden state became known (MtpProposer's catch-up, reused: prompt window, shared prefix, prompt chunks). The
tree is then grown past the last caught-up position: nodes of depth d run at the position of their parent's
feature (root position + d - 1 ... the root is the last committed token), written to scratch rows after the
caught-up ones with an ancestor mask (engine/tree.py's 64-bit masks), overwritten by the next catch-up as
rejected drafts are.

Growing (all slots at once, one pass per depth): depth 1 takes the top-k tokens of the last caught-up
position; each later pass runs the frontier (dynamic: the k candidates of highest cumulative log-probability
at the depth before, EAGLE-2; static: the shape's nodes that have children) and takes the top-k children of
each. The tree offered is the `nodes` candidates of highest cumulative log-probability, in that order (a
parent never scores below its child, so parents come first and every prefix is a tree): the node budget the
controller chooses keeps a prefix, i.e. the budget's most probable nodes. Drafts only: the engine's tree walk
keeps outputs exact.

Copies (EagleConfig.copy, MtpProposer's): a slot whose last copy tokens occurred earlier in its text drafts
what followed there, as a chain in place of its tree (DraftTokens.source 1); its tree is not grown that step.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import paddle

from specgen.engine.proposers.base import Drafting, SlotView, checkpoint_key, prepared_once
from specgen.engine.proposers.medusa import tree_template
from specgen.engine.proposers.mtp import CatchUp, MtpProposer
from specgen.engine.proposers.mtp_head import _block_config, load_draft_vocab, prompt_window, training_setting
from specgen.engine.tree import CAUSAL, MAX_TREE_NODES
from specgen.engine.types import DraftTokens
from specgen.errors import CheckpointError
from specgen.layers.block import DecoderBlock
from specgen.layers.linear import Linear
from specgen.models.config import ModelConfig
from specgen.models.model import Model
from specgen.models.weights import TensorReader

MASK_ROWS = 64  # scratch rows a slot's tree may take: a node must see every other tree row through its mask


@dataclass
class EagleWeights:
    """The draft layer; embedding and LM head are the main model's (the LM head's draft-vocabulary
    columns)."""

    embed: paddle.Tensor  # [vocab, hidden]
    fc: Linear  # [2 hidden] -> [hidden]: [embedding; feature], with EAGLE's bias when the checkpoint has one
    block: DecoderBlock  # attn_norm None: no input norm (EAGLE-1's layer 0)
    norm: paddle.Tensor | None  # [hidden] final norm of the output feature (EAGLE-3, specgen's training);
    # None: none
    lm_head: Linear  # [hidden] -> [vocab] the main model's (a runner keeps the draft vocabulary's columns)
    draft_vocab: np.ndarray | None  # [draft vocab] int64 token id of each LM-head column; None: all

    def token_ids(self, columns: np.ndarray) -> np.ndarray:
        return columns if self.draft_vocab is None else self.draft_vocab[columns]


def eagle_config(cfg: ModelConfig) -> dict:
    """config.json of an EAGLE layer for a main model of config `cfg` (a one-layer Llama, EAGLE's)."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 1,
            "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
            "max_position_embeddings": cfg.max_position_embeddings, "vocab_size": cfg.vocab_size,
            "bias": True}


def read_eagle(weights: dict[str, np.ndarray], source: str, main: Model,
               draft_vocab: np.ndarray | None = None) -> EagleWeights:
    """The layer from EAGLE's layout: fc.weight [hidden, 2 hidden] (+ fc.bias), layers.0.* one decoder layer
    (input_layernorm optional), norm.weight optional; an embed_tokens.weight or lm_head.weight of its own is
    refused (EAGLE shares the main model's)."""
    if "fc.weight" not in weights or not any(n.startswith("layers.0.") for n in weights):
        raise CheckpointError(f"{source}: not an EAGLE layer (expected fc.weight and layers.0.*)")
    extra = sorted(n for n in weights if n.startswith("layers.") and not n.startswith("layers.0."))
    if extra:
        raise CheckpointError(f"{source}: EAGLE layers past the first are not supported ({extra[0]})")
    if "lm_head.weight" in weights:
        raise CheckpointError(f"{source}: an EAGLE layer with its own LM head is not supported (it shares "
                              "the main model's)")
    cfg = main.config
    h = cfg.hidden_size
    norm_name = "layers.0.input_layernorm.weight"
    has_norm = norm_name in weights
    block_weights = weights if has_norm else {**weights, norm_name: np.ones(h, np.float32)}
    r = TensorReader(block_weights, source, _block_config(cfg, weights), main.dtype)
    block = r.block("layers.0.")
    if not has_norm:
        block = dataclasses.replace(block, attn_norm=None)
    if draft_vocab is not None:
        ids = np.asarray(draft_vocab)
        if (ids.ndim != 1 or not len(ids) or ids.dtype.kind not in "iu" or ids.min() < 0
                or ids.max() >= cfg.vocab_size):
            raise CheckpointError(f"{source}: draft vocabulary must be token ids in [0, {cfg.vocab_size})")
        draft_vocab = ids.astype(np.int64)
    return EagleWeights(
        embed=main.weights.embed,
        fc=r.linear(["fc.weight"], [(h, 2 * h)], ["fc.bias"] if "fc.bias" in weights else None),
        block=block, norm=r.param("norm.weight", (h,)) if "norm.weight" in weights else None,
        lm_head=main.weights.lm_head, draft_vocab=draft_vocab)


def load_eagle(path: str | Path, main: Model):
    """An EAGLE checkpoint: a directory with model.safetensors or pytorch_model.bin (SafeAILab's layout; or
    their shards), or one such file, and an optional draft_vocab.npy beside it; an EAGLE-3 one (midlayer.*)
    gives Eagle3Weights."""
    from specgen.engine.proposers.eagle3 import configured_features, is_eagle3, read_eagle3
    from specgen.models.hf_loader import _weight_files, read_weights
    from specgen.models.torch_file import TORCH_SUFFIXES

    p = Path(path)
    if p.is_file() and p.suffix in (".safetensors", *TORCH_SUFFIXES):
        files, d = [p], p.parent
    elif p.is_dir():
        files, d = _weight_files(p), p
    else:
        raise CheckpointError(f"{p}: no EAGLE checkpoint (a directory with model.safetensors or "
                              "pytorch_model.bin, or such a file)")
    weights = read_weights(files)
    if is_eagle3(weights):
        return read_eagle3(weights, str(p), main, configured_features(d, main.config.num_layers))
    return read_eagle(weights, str(p), main, load_draft_vocab(d))


@dataclass(frozen=True)
class TreeShape:
    """How trees grow: top-k children per expanded node, and either a dynamic frontier of `topk` nodes per
    depth (EAGLE-2) or a static shape's nodes."""

    topk: int
    nodes: int  # candidates offered per tree (the controller's budget keeps a prefix)
    paths: tuple[tuple[int, ...], ...] = ()  # a static shape (Medusa's choices); empty: dynamic

    def static_nodes(self, depth: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Static shapes: (depth [n], rank [n], parents [n]) of the shape's nodes (tree_template's order)."""
        head, rank, parents = tree_template(self.paths, depth, self.topk)
        return head + 1, rank, parents


class EagleProposer(MtpProposer):
    """Token trees from an EAGLE layer; the catch-up of its cache is MtpProposer's."""

    # a hand-off carries the tree grown at the prompt's last position too (else the first decode
    # step's is empty)
    SLOT_ARRAYS = MtpProposer.SLOT_ARRAYS + ("tree_ids", "tree_parents", "tree_probs")

    def __init__(self, model: Model, runner, k: int, shape: TreeShape,
                 acceptance_hint: float | None = None, prompt_window: int = 0, copy_min: int = 0, lib=None):
        """runner: the layer prepared for the model's backend (prepare_eagle; EaglePass.run's interface);
        copy_min > 0: MtpProposer's copies, offered as a chain in place of the slot's tree
        (DraftTokens.source 1)."""
        self.runner = runner
        # EAGLE-3: the main model's blocks whose inputs are the layer's features (the engine hands them over
        # in place of the final hidden states)
        self.features = tuple(getattr(runner, "features", ()))
        super().__init__(model, [self.runner], k, acceptance_hint, copy_min=copy_min,
                         prompt_window=prompt_window, lib=lib)
        self.shape = shape
        self.width = min(shape.nodes, MAX_TREE_NODES)
        if shape.paths:
            self.width = min(self.width, len(shape.static_nodes(k)[0]))
        front = shape.topk if not shape.paths else int(np.bincount(shape.static_nodes(k)[2]).max(initial=1))
        if shape.topk * (k - 1) > MASK_ROWS or front * (k - 1) > MASK_ROWS:
            raise CheckpointError(f"an EAGLE tree of top-{shape.topk} over {k} depths needs more than "
                                  f"{MASK_ROWS} rows of tree mask")
        self.tree_ids = np.zeros((0, self.width), np.int64)  # [num_slots, width] each slot's tree for its
        # next step
        self.tree_parents = np.zeros((0, self.width), np.int64)  # [num_slots, width] block index of each
        # parent
        self.tree_probs = np.zeros((0, self.width))  # [num_slots, width] the layer's probability of each
        # node's path

    def _ensure(self, num_slots: int) -> None:
        if self.cache is None:
            super()._ensure(num_slots)
            self.caches = [self.runner.new_cache(num_slots)]
            self.cache = self.caches[0]
            self.tree_ids = np.zeros((num_slots, self.width), np.int64)
            self.tree_parents = np.zeros((num_slots, self.width), np.int64)
            self.tree_probs = np.zeros((num_slots, self.width))

    def propose(self, view: SlotView) -> DraftTokens:
        """Each slot's tree; with copies, a copied chain (source 1) where the slot's text repeats. A step
        where no slot has a tree of the layer's offers the copies alone as plain chains: the engine's chain
        path costs less per step than a tree's planning and walk (writing at batch 1, the layer detached:
        0.93x of plain decoding with every step on the tree path)."""
        n, s = len(view.slots), view.slots
        if self.cache is None:
            return DraftTokens.none(n, self.k)
        use = self._copying(view) if self.copy_min and n else np.zeros(n, bool)  # [num_seqs] a copy,
        # not a tree
        source = use.astype(np.int64) if self.copy_min else None  # [num_seqs] 1: a copied chain
        num = self.num_drafts[s]  # [num_seqs] tree nodes
        if not (num[~use] > 0).any():  # [num_seqs, k] chains: the copies, none elsewhere
            return DraftTokens(np.where(use[:, None], self.copy_ids[s], 0),
                               np.where(use, self.copy_num[s], 0), source)
        # [num_seqs, width] each (fancy indexing: copies, not the proposer's rows)
        ids, parents, probs = self.tree_ids[s], self.tree_parents[s], self.tree_probs[s]
        if use.any():
            w = min(self.k, self.width)  # a copied chain within the tree's width
            ids[use] = 0
            ids[use, :w] = self.copy_ids[s[use], :w]
            num = np.where(use, np.minimum(self.copy_num[s], w), num)
            parents[use] = np.arange(self.width)  # a chain: node i's parent is the node before it
            probs[use] = 0.0  # priced from the slot's acceptance of copies, not the layer's probabilities
        return DraftTokens(ids, num, source, parents, probs)

    def _draft(self, c: CatchUp) -> None:
        """The catch-up pass, then each wanting slot's tree (a slot whose last caught-up position is not the
        one before its last token, a prompt chunk with more to come, gets none)."""
        first = np.concatenate([[0], np.cumsum(c.total)[:-1]])  # [num_seqs] first catch-up token of each
        last = c.start + c.total - 1  # [num_seqs] last caught-up main position
        want = c.want & (last == c.seq_lens - 2)
        k1 = self.shape.topk
        feat, vals, ids = self.runner.run(self.cache, c.slots, c.pos[first] - c.shift, c.total, c.next_ids,
                                          c.hidden, c.rows, (first + c.total - 1)[want], k1)
        self.num_drafts[c.slots] = 0
        if not want.any():
            return
        slots = c.slots[want]
        root = last[want] - c.shift[want]  # [num_seqs] head position of the last caught-up token
        tree_ids, parents, num, score = self._grow(slots, root, feat, (first + c.total - 1)[want], vals, ids,
                                                   c.depth)
        self.tree_ids[slots], self.tree_parents[slots], self.num_drafts[slots] = tree_ids, parents, num
        self.tree_probs[slots] = np.exp(score)  # (-inf past the nodes kept: 0)

    def _grow(self, slots: np.ndarray, root: np.ndarray, feats: paddle.Tensor, root_rows: np.ndarray,
              vals: np.ndarray, ids: np.ndarray, depth: int) -> tuple[np.ndarray, ...]:
        """Trees of `depth` levels for slots [num_seqs] whose last caught-up token sits at head position root
        [num_seqs] with its output feature at root_rows [num_seqs] of feats [rows, hidden] and top-k children
        (vals, ids) [num_seqs, k]. Parents come before their children.
        Returns (token ids [num_seqs, width], parents [num_seqs, width], nodes [num_seqs], cumulative
        log-probabilities [num_seqs, width])."""
        n, k = len(slots), self.shape.topk
        static = self.shape.static_nodes(depth) if self.shape.paths else None
        # candidates, appended depth by depth: token, cumulative log-probability, parent candidate
        # (-1: the root)
        cand_ids, cand_score, cand_parent = [], [], []
        front_score = np.zeros((n, 1))  # [num_seqs, F] the expanded nodes' cumulative log-probabilities
        front_cand = np.full((n, 1), -1, np.int64)  # [num_seqs, F] their candidate index
        front_row = np.full((n, 1), -1, np.int64)  # [num_seqs, F] their tree row (-1: the root, caught up)
        front_back = np.full((n, 1), CAUSAL, np.int64).view(np.uint64)  # [num_seqs, F] their masks
        front_static = np.zeros(1, np.int64)  # static shapes: the shape node of each frontier node (0: root)
        front_rows = root_rows.reshape(n, 1)  # [num_seqs, F] rows of feats holding the frontier's
        # output features
        vals, ids = vals.reshape(n, 1, k), ids.reshape(n, 1, k)  # [num_seqs, F, k]
        rows_used = 0
        for d in range(1, depth + 1):
            f = front_cand.shape[1]
            base = sum(x.shape[1] for x in cand_ids)
            score = (front_score[:, :, None] + vals).reshape(n, f * k)  # [num_seqs, F k]
            if static is not None:  # only the shape's nodes of this depth are candidates
                at = np.nonzero(static[0] == d)[0]  # the shape's nodes of depth d (block index at + 1)
                # their candidate index
                flat = np.searchsorted(front_static, static[2][at]) * k + static[1][at]
                keep = np.full(f * k, -np.inf)
                keep[flat] = 0.0
                score = score + keep[None, :]
            cand_ids.append(ids.reshape(n, f * k))
            cand_score.append(score)
            cand_parent.append(np.repeat(front_cand, k, axis=1))
            if d == depth:
                break
            if static is None:  # EAGLE-2: expand the k best candidates of this depth
                sel = np.argsort(-score, axis=1, kind="stable")[:, :k]  # [num_seqs, k]
            else:  # the shape's nodes of this depth that have children
                has_children = np.isin(at + 1, static[2])
                sel = np.broadcast_to(flat[has_children], (n, int(has_children.sum())))
                front_static = at[has_children] + 1
            f_new = sel.shape[1]
            if f_new == 0:  # a static shape shallower than depth
                break
            parent_f = sel // k  # [num_seqs, F'] frontier index of each new frontier node's parent
            rows = np.arange(rows_used, rows_used + f_new)[None, :]  # [1, F'] their tree rows
            p_row = np.take_along_axis(front_row, parent_f, axis=1)
            back = (np.take_along_axis(front_back, parent_f, axis=1) << (rows - p_row).astype(np.uint64)) \
                | np.uint64(1)
            tok = np.take_along_axis(ids.reshape(n, f * k), sel, axis=1)  # [num_seqs, F']
            parent_rows = np.take_along_axis(front_rows, parent_f, axis=1).reshape(-1)
            feats, v, t = self.runner.run(
                self.cache, slots, root + 1 + rows_used, np.full(n, f_new, np.int64), tok.reshape(-1), feats,
                parent_rows, np.arange(n * f_new), k, np.repeat(root + d, f_new),
                back.view(np.int64).reshape(-1))
            front_rows = np.arange(n * f_new).reshape(n, f_new)
            vals, ids = v.reshape(n, f_new, k), t.reshape(n, f_new, k)
            front_score = np.take_along_axis(score, sel, axis=1)
            front_cand = base + sel
            front_row, front_back = np.broadcast_to(rows, (n, f_new)), back
            rows_used += f_new
        return self._offer(np.concatenate(cand_ids, 1), np.concatenate(cand_score, 1),
                           np.concatenate(cand_parent, 1))

    def _offer(self, cand_ids: np.ndarray, score: np.ndarray, parent: np.ndarray):
        """The `width` candidates of highest cumulative log-probability, best first (a stable order: a parent,
        never below its child and made before it, comes first), as a tree: (ids, parents, nodes, scores)."""
        n, total = cand_ids.shape
        width = min(self.width, total)
        order = np.argsort(-score, axis=1, kind="stable")[:, :width]  # [num_seqs, width]
        # block index of each candidate (+1: the root at -1), 0 unkept
        block = np.zeros((n, total + 1), np.int64)
        np.put_along_axis(block, order + 1, np.arange(1, width + 1)[None, :], axis=1)
        parents = np.take_along_axis(block, np.take_along_axis(parent, order, axis=1) + 1, axis=1)
        ids = np.take_along_axis(cand_ids, order, axis=1)
        kept = np.take_along_axis(score, order, axis=1)
        out_ids = np.zeros((n, self.width), np.int64)
        out_parents = np.zeros((n, self.width), np.int64)
        out_score = np.full((n, self.width), -np.inf)
        out_ids[:, :width], out_parents[:, :width], out_score[:, :width] = ids, parents, kept
        return out_ids, out_parents, np.isfinite(kept).sum(axis=1).astype(np.int64), out_score


def build_eagle_proposer(d: Drafting, eagle3: bool = False) -> EagleProposer:
    """--method eagle: the layer at --draft-model (default: the one shipped for the default model), EAGLE-3's
    when the checkpoint is one."""
    model, e = d.model, d.section
    path = d.draft_model or (None if eagle3 else shipped_eagle(str(model.source)))
    if path is None:
        raise CheckpointError(f"--method {d.method.value} needs --draft-model PATH (an EAGLE layer: "
                              "fc.weight, layers.0.* or EAGLE-3's midlayer.*; `specgen train-head --kind "
                              f"{d.method.value}` trains one); none ships for this model")
    where = Path(path) if Path(path).is_dir() else Path(path).parent
    runner = prepare_eagle(model, path, e.quantize)
    if eagle3 and not getattr(runner, "features", None):
        raise CheckpointError(f"{path}: --method eagle3 needs an EAGLE-3 layer (midlayer.*, fc over several "
                              "depths); this is an EAGLE-1/2 layer: use --method eagle")
    return EagleProposer(model, runner, d.k, TreeShape(e.topk, e.nodes, e.tree_paths()),
                         training_setting(where, "eval_acc"), prompt_window(where), e.copy, d.lib)


def build_eagle3_proposer(d: Drafting) -> EagleProposer:
    """--method eagle3: an EAGLE-3 layer at --draft-model (EAGLE-2's trees, the eagle section's shape)."""
    return build_eagle_proposer(d, eagle3=True)


def prepare_eagle(model: Model, path: str | Path, quantize: bool = True):
    """The EAGLE layer at `path` loaded and prepared for the model's backend, once per model in this
    process."""
    return prepared_once(model, checkpoint_key(path, "eagle", quantize),
                         lambda: model.backend.prepare_eagle(model, load_eagle(path, model), quantize))


SHIPPED = Path(__file__).resolve().parents[2] / "assets" / "eagle" / "smollm2-135m-instruct"


def shipped_eagle(source: str) -> Path | None:
    """The package's EAGLE layer when the main model is the default one and one ships."""
    from specgen.models.default_model import DEFAULT_GGUF

    if Path(source).name != DEFAULT_GGUF or not (SHIPPED / "model.safetensors").is_file():
        return None
    return SHIPPED


def save_eagle(directory: str | Path, weights: dict[str, np.ndarray], cfg: ModelConfig,
               extra: dict | None = None):
    """An EAGLE layer's weights (EAGLE's names, HF [out, in]) as model.safetensors + config.json."""
    from safetensors.numpy import save_file

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in weights.items()}, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({**eagle_config(cfg), **(extra or {})}, indent=2))
