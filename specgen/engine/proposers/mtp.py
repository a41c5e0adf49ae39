"""MTP drafting (DeepSeek-V3 section 2.2): a one-block head that predicts the token after next.

At position i the head combines RMSNorm(embedding of token i+1) and RMSNorm(main model's final hidden state at
i) through a projection, runs one decoder block with its own KV cache, and the (shared) LM head predicts token
i+2. For k > 1 it is applied again to its own output hidden state and its own draft.

Cache invariant: after each step the head's cache holds exact entries for every position whose main-model
hidden state was verified from the slot's window on (positions [shift, seq_len - 1), stored at head positions
[0, seq_len - 1 - shift); shift = prompt length - prompt_window, or 0); entries past that were written by the
draft chain and are overwritten by the next catch-up, like the main cache's rejected drafts.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import paddle
import paddle.nn.functional as F

from specgen import kernels
from specgen.config import SpecConfig
from specgen.engine.kv_cache import KVCache
from specgen.engine.model import LINEAR_KEYS, KeptIndex, Model, TensorReader
from specgen.engine.proposers.base import SlotView
from specgen.engine.proposers.ngram import NATIVE_MAX, ngram_match, ngram_match_native
from specgen.engine.types import DraftTokens, StepUpdate, build_forward_batch
from specgen.errors import CheckpointError
from specgen.kernels import host
from specgen.models.checkpoint import QuantRows
from specgen.models.config import ModelConfig


class MtpHead:
    """The head's weights, from the DeepSeek-V3 layout (`model.layers.{N}.eh_proj`, `enorm`, `hnorm`,
    `shared_head.*`) or the ERNIE-4.5 layout (`model.mtp_linear_proj.0`, `mtp_emb_norm.0`, `mtp_hidden_norm.0`,
    `mtp_block.0.*`); embedding, final norm and LM head are the main model's unless the head has its own.

    `draft_vocab` (token ids; `draft_vocab.npy` beside a head trained by `specgen train-mtp`): drafts are the
    argmax over these tokens only, so the head's LM head is that much cheaper (5.2 -> 1.0 ms per draft at
    batch 1 for 49,152 -> 8,192 tokens); verification is untouched, so outputs stay exact."""

    def __init__(self, weights: dict[str, np.ndarray], source: str, main: Model,
                 draft_vocab: np.ndarray | None = None):
        cfg = main.config
        h = cfg.hidden_size
        ds = sorted({int(m.group(1)) for n in weights if (m := re.match(r"model\.layers\.(\d+)\.eh_proj\.weight$", n))})
        r = TensorReader(weights, source, _block_config(cfg, weights), main.dtype)
        if ds:
            p = f"model.layers.{ds[0]}."
            names = (p + "enorm.weight", p + "hnorm.weight", p + "eh_proj.weight")
            block, norm, head, embed = p, p + "shared_head.norm.weight", p + "shared_head.head.weight", p + "embed_tokens.weight"
        elif "model.mtp_linear_proj.0.weight" in weights:
            names = ("model.mtp_emb_norm.0.weight", "model.mtp_hidden_norm.0.weight", "model.mtp_linear_proj.0.weight")
            block, norm, head, embed = "model.mtp_block.0.", "", "", ""
        else:
            raise CheckpointError(f"{source}: no MTP weights (expected model.layers.N.eh_proj.weight or "
                                  f"model.mtp_linear_proj.0.weight)")
        self.enorm = r.param(names[0], (h,))
        self.hnorm = r.param(names[1], (h,))
        # With the main model in GGUF blocks, the head's float32 projections are packed as Q8_0 blocks too: its
        # pass reads ~4.5 instead of ~17 MB for the default model. Only the drafts can change, never the outputs;
        # SPECGEN_QUANTIZED_HEAD=0 keeps them float32.
        q8 = main.keeps_quantized and kernels.switch("SPECGEN_QUANTIZED_HEAD")
        # On a CPU with AVX-512 VNNI those blocks (and the draft vocabulary's LM-head rows) get integer products,
        # the inputs quantized to int8 per block (linear.cc, "Integer products"), whatever the main model's
        # `matmul`: drafts need not be float32's, only cheap. SPECGEN_INT8_HEAD=0 keeps float32 products.
        self.int8_product = q8 and kernels.has_vnni() and kernels.switch("SPECGEN_INT8_HEAD")
        eh = r.to_paddle(r.get(names[2], (h, 2 * h)).T)  # [2 hidden, hidden]: [emb; hidden] -> hidden
        self.eh_proj = main.pack(eh, _q8_0(eh) if q8 else None, self.int8_product)
        L = r.layer(block)
        self.block = main.pack_layer(L, {key: _q8_0(L[key]) for key in LINEAR_KEYS} if q8 else None,
                                     self.int8_product)
        self.final_norm = r.param(norm, (h,)) if norm in weights else main.w.final_norm
        self.lm_head = r.to_paddle(r.get(head, (cfg.vocab_size, h)).T) if head in weights else main.w.lm_head
        self.embed = r.param(embed, (cfg.vocab_size, h)) if embed in weights else main.w.embed
        self.draft_vocab = None  # [draft_vocab] int64 token id of each LM-head column, when restricted
        if draft_vocab is not None:
            ids = np.asarray(draft_vocab)
            if ids.ndim != 1 or not len(ids) or ids.dtype.kind not in "iu" or ids.min() < 0 \
                    or ids.max() >= cfg.vocab_size:
                raise CheckpointError(f"{source}: draft vocabulary must be token ids in [0, {cfg.vocab_size})")
            self.draft_vocab = ids.astype(np.int64)
            shared = main.w.lm_head_quant if head not in weights and main.keeps_quantized else None
            if shared is not None:  # the main model's LM head kept in its GGUF blocks: their draft-vocabulary rows
                self.lm_head = kernels.pack_quantized(shared.kind, shared.blocks[self.draft_vocab],  # [hidden, V']
                                                      main.int8_product or self.int8_product)
            else:
                self.lm_head = paddle.gather(kernels.dense(self.lm_head), paddle.to_tensor(self.draft_vocab), axis=1)
        self.lm_head = main.pack(self.lm_head)
        # specgen_mtp_draft's arguments when the main model runs fused blocks (packed float32): the whole pass of a
        # step, catch-up and chained drafts, is then one op (MtpProposer._fused_pass)
        self.columns = main.block_columns([self.block]) if main.fused_layer else None
        self.vocab_ids = paddle.to_tensor(self.draft_vocab if self.draft_vocab is not None else np.zeros(0, np.int64))


def _q8_0(w: paddle.Tensor) -> QuantRows | None:
    """A float32 weight [in, out] as GGUF Q8_0 blocks of its rows (gguf.quants), when `in` is a multiple of 32."""
    from gguf import GGMLQuantizationType, quants

    rows = np.ascontiguousarray(w.numpy().T)  # [out, in]
    if rows.dtype != np.float32 or rows.shape[1] % 32:
        return None
    blocks = quants.quantize(rows, GGMLQuantizationType.Q8_0)  # [out, in / 32 * 34] uint8
    return QuantRows("Q8_0", blocks.reshape(rows.shape[0], rows.shape[1] // 32, -1))


def _block_config(cfg: ModelConfig, weights: dict[str, np.ndarray]) -> ModelConfig:
    """The main config, with the head block's own intermediate size when it differs."""
    import dataclasses

    for name, w in weights.items():
        if name.endswith("mlp.gate_proj.weight"):
            return dataclasses.replace(cfg, intermediate_size=int(w.shape[0]))
    return cfg


def random_mtp_weights(cfg: ModelConfig, seed: int = 0, std: float = 0.02) -> dict[str, np.ndarray]:
    """A randomly initialised head in the DeepSeek-V3 layout (for tests until a trained head exists)."""
    rng = np.random.default_rng(seed)
    h, hd, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    p = f"model.layers.{cfg.num_layers}."
    shapes = {
        "self_attn.q_proj.weight": (cfg.num_heads * hd, h), "self_attn.k_proj.weight": (cfg.num_kv_heads * hd, h),
        "self_attn.v_proj.weight": (cfg.num_kv_heads * hd, h), "self_attn.o_proj.weight": (h, cfg.num_heads * hd),
        "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h), "mlp.down_proj.weight": (h, inter),
        "eh_proj.weight": (h, 2 * h),
    }
    if cfg.qkv_bias:
        shapes.update({"self_attn.q_proj.bias": (cfg.num_heads * hd,), "self_attn.k_proj.bias": (cfg.num_kv_heads * hd,),
                       "self_attn.v_proj.bias": (cfg.num_kv_heads * hd,)})
    if cfg.o_bias:
        shapes["self_attn.o_proj.bias"] = (h,)
    if cfg.mlp_bias:
        shapes.update({"mlp.gate_proj.bias": (inter,), "mlp.up_proj.bias": (inter,), "mlp.down_proj.bias": (h,)})
    w = {p + n: (rng.standard_normal(s) * std).astype(np.float32) for n, s in shapes.items()}
    for n in ("enorm.weight", "hnorm.weight", "input_layernorm.weight", "post_attention_layernorm.weight",
              "shared_head.norm.weight"):
        w[p + n] = np.ones(h, np.float32)
    if cfg.qk_norm:
        w[p + "self_attn.q_norm.weight"] = np.ones(hd, np.float32)
        w[p + "self_attn.k_norm.weight"] = np.ones(hd, np.float32)
    return w


def save_mtp(directory: str | Path, weights: dict[str, np.ndarray], extra: dict[str, Any] | None = None) -> None:
    """Write a head as `model.safetensors` + `config.json` (loadable with --mtp-model DIR)."""
    from safetensors.numpy import save_file

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in weights.items()}, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({"architectures": ["DeepseekV3MTP"], "num_nextn_predict_layers": 1,
                                               **(extra or {})}, indent=2))


def load_mtp_weights(directory: str | Path) -> dict[str, np.ndarray]:
    from specgen.models.hf_loader import _weight_files, read_safetensors

    d = Path(directory)
    if not d.is_dir():
        raise CheckpointError(f"{d}: MTP model directory not found")
    return read_safetensors(_weight_files(d))


def load_draft_vocab(directory: str | Path) -> np.ndarray | None:
    """The head's draft vocabulary (`draft_vocab.npy`), or None: the full vocabulary."""
    path = Path(directory) / "draft_vocab.npy"
    if not path.is_file():
        return None
    try:
        return np.load(path)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: cannot read the draft vocabulary ({exc})") from None


class MtpProposer:
    """Drafts k tokens per slot with an MTP head; its cache is brought up to date after every step.

    With copy_min > 0 a slot whose last copy_min (up to COPY_MAX) tokens occurred earlier in its prompt or output
    gets what followed there instead (n-gram lookup, ngram.py), the head's drafts elsewhere: the head, trained on
    short windows, hardly copies from far back, where summarization and RAG answers come from."""

    # Longest tail looked up (a longer match wins over a shorter one). 8 rather than n-gram's 3: where the head is
    # the alternative, the better source pays more (batch 8, k = 2, every draft verified: tokens per step
    # 1.69 -> 1.71 on summarization, 2.02 -> 2.06 on code rewriting, RAG unchanged; BENCHMARKS.md).
    COPY_MAX = 8

    def __init__(self, model: Model, head: MtpHead, k: int, acceptance_hint: float | None = None,
                 copy_min: int = 0, prompt_window: int = 0):
        self.model, self.head, self.k = model, head, k
        # Prompt positions the head's cache holds (0: all): only a prompt's last prompt_window positions are caught
        # up, stored from the head's position 0 on (its positions are the main model's minus the slot's shift;
        # rotary attention depends only on distances). For a head trained by `specgen train-mtp` on windows of
        # seq_len positions this is 2 x seq_len (prompt_window()): it is not asked to attend further back than it
        # learned, and a long prompt's catch-up is no longer every position.
        self.prompt_window = prompt_window
        self.acceptance_hint = acceptance_hint  # the head's held-out position-1 accuracy, when training recorded it
        self.copy_min = copy_min
        self._lib = host() if copy_min and max(k, self.COPY_MAX, copy_min) <= NATIVE_MAX else None
        self.cache: KVCache | None = None
        # one specgen_mtp_draft call per step (bit-identical to `_run`'s ops); SPECGEN_FUSED_MTP=0 runs `_run`
        self.fused = head.columns is not None and kernels.switch("SPECGEN_FUSED_MTP")
        self._indices = KeptIndex(256)  # the fused pass's index tensors, kept per (tokens, sequences) shape
        self.drafts = np.zeros((0, k), np.int64)  # [num_slots, k] drafts ready for each slot's next step
        self.num_drafts = np.zeros(0, np.int64)  # [num_slots]

    def propose(self, view: SlotView) -> DraftTokens:
        if self.cache is None:
            return DraftTokens(np.zeros((len(view.slots), self.k), np.int64), np.zeros(len(view.slots), np.int64))
        slots = view.slots
        drafts, num = self.drafts[slots], self.num_drafts[slots]  # [num_seqs, k], [num_seqs]
        if not self.copy_min or not len(slots):
            return DraftTokens(drafts, np.minimum(num, view.max_draft))
        stale = self.copy_at[slots] != view.seq_lens  # copies observe found for another length (or none)
        if stale.any():
            self._find_copies(view.tokens, slots[stale], view.seq_lens[stale])
        copy_num = self.copy_num[slots]
        use = copy_num > 0  # [num_seqs] a tail of >= copy_min tokens occurred before
        drafts = np.where(use[:, None], self.copy_ids[slots], drafts)
        num = np.where(use, copy_num, num)
        return DraftTokens(drafts, np.minimum(num, view.max_draft), use.astype(np.int64))

    def _find_copies(self, tokens: np.ndarray, slots: np.ndarray, seq_lens: np.ndarray) -> np.ndarray:
        """n-gram drafts of tails of copy_min..COPY_MAX tokens of these slots (none where no such tail occurred
        before), kept per slot with the length they were found for; returns [len(slots)] bool: found."""
        n_max = max(self.COPY_MAX, self.copy_min)
        if self._lib is not None:
            copy = ngram_match_native(tokens, slots, seq_lens, self.k, self.copy_min, n_max, self._lib)[0]
        else:
            copy = ngram_match(tokens[slots], seq_lens, self.k, self.copy_min, n_max)[0]
        self.copy_ids[slots], self.copy_num[slots], self.copy_at[slots] = copy.draft_ids, copy.num_draft, seq_lens
        return copy.num_draft > 0

    def _ensure(self, num_slots: int) -> None:
        if self.cache is None:
            cfg = self.model.config
            self.cache = KVCache(1, num_slots, cfg.num_kv_heads, cfg.head_dim, self.model.dtype, self.model.max_len,
                                 zeroed=self.model.ops is None)
            self.drafts = np.zeros((num_slots, self.k), np.int64)
            self.num_drafts = np.zeros(num_slots, np.int64)
            # copy_min > 0: each slot's copied drafts [num_slots, k], their count, and the length they are for
            self.copy_ids = np.zeros((num_slots, self.k), np.int64)
            self.copy_num = np.zeros(num_slots, np.int64)
            self.copy_at = np.full(num_slots, -1, np.int64)
            self.shift = np.zeros(num_slots, np.int64)  # [num_slots] main position - head position

    def _run(self, slots, starts, lens, token_ids, prev_hidden):
        """One packed pass of the head; returns (block output [num_tokens, hidden], argmax at each block's end)."""
        batch = build_forward_batch(slots, starts, lens, token_ids, np.zeros(len(slots), bool))
        hd = self.head
        emb = F.embedding(paddle.to_tensor(batch.token_ids), hd.embed)  # [num_tokens, hidden]
        m = self.model
        x = m.matmul(paddle.concat([m.norm(emb, hd.enorm), m.norm(prev_hidden, hd.hnorm)], axis=-1),
                     hd.eh_proj)  # [num_tokens, hidden]
        x = m.layer(x, hd.block, m.context(batch, self.cache), self.cache.k[0], self.cache.v[0])
        last = paddle.to_tensor(batch.logit_rows)
        logits = m.matmul(m.norm(paddle.gather(x, last), hd.final_norm), hd.lm_head)  # [num_seqs, vocab]
        drafts = kernels.argmax(logits).numpy()
        return paddle.gather(x, last), drafts if hd.draft_vocab is None else hd.draft_vocab[drafts]

    def observe(self, update: StepUpdate) -> None:
        self._ensure(update.tokens.shape[0])
        live = ~update.finished & (update.num_valid > 0)
        # Slots whose next drafts are copies (found now, from the committed text, for propose) need the head's pass
        # only to catch its cache up: no LM head, no chained drafts (the fused pass leaves them out of last_rows).
        copying = np.zeros(len(live), bool)
        if self.copy_min and update.seq_lens is not None and live.any():
            copying[live] = self._find_copies(update.tokens, update.slots[live], update.seq_lens[live])
        if update.detached is not None:  # drafts stopped paying for these slots: no more head passes for them
            self.num_drafts[update.slots[update.detached]] = 0
            live &= ~update.detached
        if not live.any():
            return
        slots, first, nv = update.slots[live], update.first_pos[live], update.num_valid[live]
        copying = copying[live]
        # A slot's first block after a shared prefix also catches up the prefix positions (the head's own cache
        # is per slot), from the prefix's hidden states, kept once, appended after the forward's rows.
        pre = update.prefix_len[live] if update.prefix_len is not None else np.zeros(len(slots), np.int64)
        start, total = first - pre, nv + pre  # [num_seqs]
        new = start == 0  # a slot's first block: a new request, and its window of the prompt
        if self.prompt_window and update.prompt_lens is not None:
            self.shift[slots[new]] = np.maximum(update.prompt_lens[live][new] - self.prompt_window, 0)
        else:
            self.shift[slots[new]] = 0
        shift = self.shift[slots]  # [num_seqs]
        skip = np.clip(shift - start, 0, total)  # leading positions before the slot's window
        start, total = start + skip, total - skip
        block_start = update.block_start[live]
        if not total.all():  # blocks wholly before their window (chunks of a long prompt): no pass
            self.num_drafts[slots[total == 0]] = 0
            keep = total > 0
            if not keep.any():
                return
            slots, first, nv, copying, shift, start, total, block_start = (
                x[keep] for x in (slots, first, nv, copying, shift, start, total, block_start))
        seq = np.repeat(np.arange(len(slots)), total)  # [num_tokens] block of each catch-up token
        # [num_tokens] main-model position of each catch-up token
        pos = start[seq] + np.arange(len(seq)) - np.concatenate([[0], np.cumsum(total)[:-1]])[seq]
        num_rows = int(update.hidden.shape[0])
        rows = np.where(pos < first[seq], num_rows + pos,  # a shared-prefix position -> its prefix row
                        block_start[seq] + pos - first[seq])  # rows of the main forward
        next_ids = update.tokens[slots[seq], pos + 1]  # token i+1 for position i
        hidden = update.hidden if not pre.any() else paddle.concat([update.hidden, update.prefix_hidden])
        last_pos = first + nv - 1 - shift  # head positions
        depth = max(1, min(self.k, update.max_draft_next))  # chained drafts worth computing for the next step
        self.num_drafts[slots] = depth
        if self.fused:
            want = ~copying
            self.num_drafts[slots[copying]] = 0
            self.drafts[slots[want], :depth] = self._fused_pass(
                slots[seq], pos - shift[seq], next_ids, hidden, rows, (np.cumsum(total) - 1)[want],
                int(last_pos.max()) + depth, depth)
            return
        h_main = paddle.gather(hidden, paddle.to_tensor(rows))  # [num_tokens, hidden]
        x, d = self._run(slots, start - shift, total, next_ids, h_main)
        self.drafts[slots, 0] = d
        ones = np.ones(len(slots), np.int64)
        for i in range(1, depth):
            x, d = self._run(slots, last_pos + i, ones, d, x)
            self.drafts[slots, i] = d

    def _fused_pass(self, token_slots, positions, token_ids, hidden, rows, last_rows, needed: int,
                    depth: int) -> np.ndarray:
        """`_run` for the catch-up tokens, then depth - 1 chained passes, as one specgen_mtp_draft call;
        returns the drafts [num_seqs, depth]. Per token [num_tokens]: cache slot, position, token i+1, row of
        `hidden` (the main forward's final hidden states); last_rows [num_seqs]: the last token of each sequence
        that wants drafts (none: the catch-up alone)."""
        m, hd, cfg = self.model, self.head, self.model.config
        self.cache.reserve(needed)
        # token ids, rows, positions, slots, prefix lengths (none: zeros), each sequence's last row
        tok, row, pos, slot, pre, last = self._indices.tensors(
            (token_ids, rows, positions, token_slots, np.zeros(len(token_ids), np.int64), last_rows))
        *weights, q_norm, k_norm = hd.columns
        out = m.ops.specgen_mtp_draft(
            tok, hidden, row, hd.embed, hd.enorm, hd.hnorm, hd.eh_proj.panels, *weights, m.cos, m.sin,
            pos, slot, [self.cache.k[0]], [self.cache.v[0]], q_norm, k_norm, pre, [m._ones], [m._ones],
            last, hd.final_norm, hd.lm_head.panels, hd.vocab_ids, cfg.num_heads,
            cfg.num_kv_heads, self.cache.capacity, cfg.qk_norm, cfg.rms_norm_eps, 0, depth, hd.lm_head.n)
        return (out[0] if isinstance(out, (list, tuple)) else out).numpy()  # [num_seqs, depth]


# The head shipped with the package for the default model, trained by `specgen train-mtp`
# (scripts/make_mtp_train_prompts.py writes its training prompts).
SHIPPED_HEAD = Path(__file__).resolve().parents[2] / "assets" / "mtp" / "smollm2-135m-instruct"


def shipped_head(source: str) -> Path | None:
    """The package's head when the main model is the default one (read from its GGUF file) and a head is there."""
    from specgen.models.default_model import DEFAULT_GGUF

    if Path(source).name != DEFAULT_GGUF or not (SHIPPED_HEAD / "model.safetensors").is_file():
        return None
    return SHIPPED_HEAD


def build_mtp_proposer(spec: SpecConfig, loaded: Any) -> MtpProposer:
    """The head comes from --mtp-model DIR, else from the package when it ships one for this main model."""
    path = spec.mtp_model if spec.mtp_model is not None else shipped_head(str(loaded.source))
    if path is None:
        raise CheckpointError("--method mtp needs an MTP head: give --mtp-model DIR (DeepSeek-V3 or ERNIE-4.5 "
                              "layout; `specgen train-mtp` trains one); the main checkpoint has none")
    d = Path(path).resolve()
    # built once per model and directory version: later generate() calls in this process reuse it
    key = (str(d), tuple(sorted((f.name, f.stat().st_mtime_ns) for f in d.iterdir())) if d.is_dir() else ())
    head = loaded.model.heads.get(key)
    if head is None:
        head = loaded.model.heads[key] = MtpHead(load_mtp_weights(path), str(path), loaded.model,
                                                 load_draft_vocab(path))
    return MtpProposer(loaded.model, head, spec.num_speculative_tokens, acceptance_hint(d), spec.mtp_copy,
                       prompt_window(d))


def _training_setting(directory: Path, name: str) -> float | None:
    """A number `specgen train-mtp` recorded in the head's config.json (specgen_training), if any."""
    try:
        value = json.loads((directory / "config.json").read_text())["specgen_training"][name]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def acceptance_hint(directory: Path) -> float | None:
    """The held-out position-1 accuracy `specgen train-mtp` recorded in the head's config.json, if any."""
    return _training_setting(directory, "eval_acc")


WINDOW_PER_SEQ_LEN = 2  # a trained head's prompt window, in its training windows' length: 256 for the shipped head


def prompt_window(directory: Path) -> int:
    """The prompt positions the head's cache holds: WINDOW_PER_SEQ_LEN x the window length `specgen train-mtp`
    trained it on (the shipped head: 128 -> 256; its acceptance was the same with the whole prompt or the last
    128 positions, BENCHMARKS.md), or 0 (the whole prompt) for a head trained elsewhere (DeepSeek-V3, ERNIE-4.5),
    which may have learned to attend as far back as the main model."""
    seq_len = _training_setting(directory, "seq_len")
    return int(WINDOW_PER_SEQ_LEN * seq_len) if seq_len else 0
