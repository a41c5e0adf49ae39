"""An MTP head's weights (DeepSeek-V3 section 2.2): reading them in either public layout, writing and
making them, and its reference pass (Paddle's operators, any backend; the fused backend runs
specgen_mtp_draft). The drafting (catch-up, copies) is engine/proposers/mtp.py's.

At position i the head combines RMSNorm(embedding of token i+1) and RMSNorm(main model's final hidden state at
i) through a projection, runs one decoder block with its own KV cache, and the (shared) LM head predicts token
i+2. For k > 1 it is applied again to its own output hidden state and its own draft.
"""
from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import paddle
import paddle.nn.functional as F

from specgen.backends.base import ModelView, MtpPass
from specgen.backends.reference import reserve
from specgen.errors import CheckpointError
from specgen.layers.attention import AttentionIndex
from specgen.layers.block import DecoderBlock, block_forward
from specgen.layers.linear import Linear
from specgen.layers.norm import rms_norm
from specgen.layers.sampling import coupled_drafts
from specgen.models.checkpoint import Lazy, tensor_shape
from specgen.models.config import ModelConfig
from specgen.models.model import Model
from specgen.models.weights import TensorReader
from specgen.runtime.batch import build_forward_batch
from specgen.runtime.kv_cache import KVCache


@dataclass
class MtpHeadWeights:
    """The head's weights; embedding and final norm are the main model's unless the head has its own, and so
    is the LM head (lm_head None).

    `draft_vocab` (token ids; `draft_vocab.npy` beside a head trained by `specgen train-mtp`): drafts are the
    argmax over these tokens only, so the head's LM head is that much cheaper (5.2 -> 1.0 ms per draft at
    batch 1 for 49,152 -> 8,192 tokens); verification is untouched, so outputs stay exact."""

    embed: paddle.Tensor  # [vocab, hidden]
    enorm: paddle.Tensor  # [hidden]
    hnorm: paddle.Tensor  # [hidden]
    eh_proj: Linear  # [2 hidden] -> [hidden]: [embedding; hidden state]
    block: DecoderBlock
    final_norm: paddle.Tensor  # [hidden]
    lm_head: Linear | None  # [hidden] -> [vocab], its own; None: the main model's
    draft_vocab: np.ndarray | None  # [draft_vocab] int64 token id of each LM-head column, when restricted

    fused = "mtp"  # the fused backend's own pass for it (specgen_mtp_draft)

    def linears(self) -> list[Linear]:
        return [self.eh_proj, *self.block.linears()] + ([self.lm_head] if self.lm_head is not None else [])

    def reference_pass(self, model: ModelView) -> "ReferenceHead":
        return ReferenceHead(model, self)

    def token_ids(self, columns: np.ndarray) -> np.ndarray:
        """LM-head columns -> token ids."""
        return columns if self.draft_vocab is None else self.draft_vocab[columns]

    @classmethod
    def read_modules(cls, weights: dict[str, np.ndarray], source: str, main: Model,
                     draft_vocab: np.ndarray | None = None) -> list["MtpHeadWeights"]:
        """Every MTP module of a checkpoint, in order: the DeepSeek-V3 layout (`model.layers.{L + i}.eh_proj`,
        `enorm`, `hnorm`, `shared_head.*`, the block under the same prefix) or the ERNIE-4.5 layout
        (`model.mtp_linear_proj.{i}`, `mtp_emb_norm.{i}`, `mtp_hidden_norm.{i}`, `mtp_block.{i}.*`; or in
        Paddle's naming, `ernie.mtp_*`: from_paddle_layout). Module i
        takes module i - 1's output hidden state and drafts position i + 1."""
        if any(n.startswith("ernie.mtp_") for n in weights):
            weights = from_paddle_layout(weights, main.config)
        ds = sorted({int(m.group(1)) for n in weights
                     if (m := re.match(r"model\.layers\.(\d+)\.eh_proj\.weight$", n))})
        if ds:
            if ds != list(range(ds[0], ds[0] + len(ds))):
                raise CheckpointError(f"{source}: MTP modules at layers {ds} are not consecutive")
            return [cls.read(weights, source, main, draft_vocab, prefix=f"model.layers.{i}.") for i in ds]
        ernie = 0
        while f"model.mtp_linear_proj.{ernie}.weight" in weights:
            ernie += 1
        if not ernie:
            raise CheckpointError(f"{source}: no MTP weights (expected model.layers.N.eh_proj.weight or "
                                  f"model.mtp_linear_proj.0.weight)")
        return [cls.read(weights, source, main, draft_vocab, ernie=i) for i in range(ernie)]

    @classmethod
    def read(cls, weights: dict[str, np.ndarray], source: str, main: Model,
             draft_vocab: np.ndarray | None = None, prefix: str | None = None,
             ernie: int | None = None) -> "MtpHeadWeights":
        """One module: the DeepSeek-V3 one under `prefix` (`model.layers.{N}.`) or ERNIE-4.5's number `ernie`
        (neither: the first module of whichever layout the weights hold)."""
        if prefix is None and ernie is None:
            return cls.read_modules(weights, source, main, draft_vocab)[0]
        cfg = main.config
        h = cfg.hidden_size
        r = TensorReader(weights, source, _block_config(cfg, weights), main.dtype)
        if prefix is not None:
            p = prefix
            names = (p + "enorm.weight", p + "hnorm.weight", p + "eh_proj.weight")
            block, norm, head, embed = p, p + "shared_head.norm.weight", p + "shared_head.head.weight", \
                p + "embed_tokens.weight"
        else:
            names = (f"model.mtp_emb_norm.{ernie}.weight", f"model.mtp_hidden_norm.{ernie}.weight",
                     f"model.mtp_linear_proj.{ernie}.weight")
            block, norm, head, embed = f"model.mtp_block.{ernie}.", "", "", ""
        ids = None
        if draft_vocab is not None:
            ids = np.asarray(draft_vocab)
            if ids.ndim != 1 or not len(ids) or ids.dtype.kind not in "iu" or ids.min() < 0 \
                    or ids.max() >= cfg.vocab_size:
                raise CheckpointError(f"{source}: draft vocabulary must be token ids in "
                                      f"[0, {cfg.vocab_size})")
            ids = ids.astype(np.int64)
        w = main.weights
        return cls(
            embed=r.param(embed, (cfg.vocab_size, h)) if embed in weights else w.embed,
            enorm=r.param(names[0], (h,)),
            hnorm=r.param(names[1], (h,)),
            eh_proj=r.linear([names[2]], [(h, 2 * h)]),
            block=r.block(block),
            final_norm=r.param(norm, (h,)) if norm in weights else w.final_norm,
            lm_head=r.linear([head], [(cfg.vocab_size, h)]) if head in weights else None,
            draft_vocab=ids,
        )


def from_paddle_layout(weights: Mapping[str, np.ndarray], cfg: ModelConfig) -> Lazy[np.ndarray]:
    """ERNIE-4.5's MTP weights as its Paddle checkpoints name and store them (FastDeploy's: `ernie.mtp_*`,
    linear weights [in, out], q/k/v fused as `qkv_proj` [hidden, q | k | v] and gate/up as `up_gate_proj`
    [hidden, gate | up]) under the HF names of the ERNIE-4.5 layout (`model.mtp_*`, [out, in], q/k/v and
    gate/up apart), each converted when read. Other tensors (the main model's) are left out."""
    weights = Lazy.held(weights, tensor_shape)
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    info: dict[str, tuple[int, ...]] = {}
    how: dict[str, tuple[str, int, int | None]] = {}  # HF name -> (Paddle name, first column, end column)
    for name in weights:
        if not name.startswith("ernie.mtp_"):
            continue
        shape = tuple(weights.info[name])
        hf = "model." + name[len("ernie."):]
        parts: list[tuple[str, int, int | None]] = [(hf, 0, None)]
        if ".qkv_proj." in name:
            parts = [(hf.replace(".qkv_proj.", f".{p}_proj."), a, b)
                     for p, a, b in (("q", 0, q), ("k", q, q + kv), ("v", q + kv, q + 2 * kv))]
        elif ".up_gate_proj." in name:
            half = shape[-1] // 2
            parts = [(hf.replace(".up_gate_proj.", ".gate_proj."), 0, half),
                     (hf.replace(".up_gate_proj.", ".up_proj."), half, shape[-1])]
        for n, a, b in parts:
            how[n] = (name, a, b)
            cols = (shape[-1] if b is None else b) - a
            info[n] = (cols, shape[0]) if len(shape) == 2 else (cols,)

    def read(n: str) -> np.ndarray:
        name, a, b = how[n]
        w = weights[name]
        w = w[..., a:b]
        return np.ascontiguousarray(w.T) if w.ndim == 2 else np.ascontiguousarray(w)

    return Lazy(info, read)


def _block_config(cfg: ModelConfig, weights: dict[str, np.ndarray]) -> ModelConfig:
    """The main config, with the head block's own intermediate size when it differs."""
    for name, w in weights.items():
        if name.endswith("mlp.gate_proj.weight"):
            return dataclasses.replace(cfg, intermediate_size=int(w.shape[0]))
    return cfg


def random_mtp_weights(cfg: ModelConfig, seed: int = 0, std: float = 0.02,
                       num_modules: int = 1) -> dict[str, np.ndarray]:
    """A randomly initialised head of `num_modules` modules in the DeepSeek-V3 layout (tests, and train-mtp's
    random initialisation); module 0 is the same whatever num_modules."""
    w: dict[str, np.ndarray] = {}
    for i in range(num_modules):
        rng = np.random.default_rng([seed, i] if i else seed)
        w.update(_random_module(cfg, f"model.layers.{cfg.num_layers + i}.", rng, std))
    return w


def _random_module(cfg: ModelConfig, p: str, rng: np.random.Generator, std: float) -> dict[str, np.ndarray]:
    h, hd, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    shapes = {
        "self_attn.q_proj.weight": (cfg.num_heads * hd, h),
        "self_attn.k_proj.weight": (cfg.num_kv_heads * hd, h),
        "self_attn.v_proj.weight": (cfg.num_kv_heads * hd, h),
        "self_attn.o_proj.weight": (h, cfg.num_heads * hd),
        "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h),
        "mlp.down_proj.weight": (h, inter),
        "eh_proj.weight": (h, 2 * h),
    }
    if cfg.qkv_bias:
        shapes.update({"self_attn.q_proj.bias": (cfg.num_heads * hd,),
                       "self_attn.k_proj.bias": (cfg.num_kv_heads * hd,),
                       "self_attn.v_proj.bias": (cfg.num_kv_heads * hd,)})
    if cfg.o_bias:
        shapes["self_attn.o_proj.bias"] = (h,)
    if cfg.mlp_bias:
        shapes.update({"mlp.gate_proj.bias": (inter,), "mlp.up_proj.bias": (inter,),
                       "mlp.down_proj.bias": (h,)})
    w = {p + n: (rng.standard_normal(s) * std).astype(np.float32) for n, s in shapes.items()}
    for n in ("enorm.weight", "hnorm.weight", "input_layernorm.weight", "post_attention_layernorm.weight",
              "shared_head.norm.weight"):
        w[p + n] = np.ones(h, np.float32)
    if cfg.qk_norm:
        w[p + "self_attn.q_norm.weight"] = np.ones(hd, np.float32)
        w[p + "self_attn.k_norm.weight"] = np.ones(hd, np.float32)
    return w


def save_mtp(directory: str | Path, weights: dict[str, np.ndarray],
             extra: dict[str, Any] | None = None) -> None:
    """Write a head as `model.safetensors` + `config.json` (loadable with --draft-model DIR)."""
    from safetensors.numpy import save_file

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in weights.items()}, str(d / "model.safetensors"))
    modules = len({n for n in weights if n.endswith(".eh_proj.weight")}) or 1
    (d / "config.json").write_text(json.dumps({"architectures": ["DeepseekV3MTP"],
                                               "num_nextn_predict_layers": modules,
                                               **(extra or {})}, indent=2))


def load_mtp_weights(directory: str | Path) -> dict[str, np.ndarray]:
    from specgen.models.hf_loader import _weight_files, read_weights

    d = Path(directory)
    if not d.is_dir():
        raise CheckpointError(f"{d}: MTP model directory not found")
    return read_weights(_weight_files(d))


def load_draft_vocab(directory: str | Path) -> np.ndarray | None:
    """The head's draft vocabulary (`draft_vocab.npy`), or None: the full vocabulary."""
    path = Path(directory) / "draft_vocab.npy"
    if not path.is_file():
        return None
    try:
        return np.load(path)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: cannot read the draft vocabulary ({exc})") from None


# The head shipped with the package for the default model, trained by `specgen train-mtp`
# (scripts/make_mtp_train_prompts.py writes its training prompts).
SHIPPED_HEAD = Path(__file__).resolve().parents[1] / "assets" / "mtp" / "smollm2-135m-instruct"


def shipped_head(source: str) -> Path | None:
    """The package's head when the main model is the default one (read from its GGUF file) and a head is
    there."""
    from specgen.models.default_model import DEFAULT_GGUF

    if Path(source).name != DEFAULT_GGUF or not (SHIPPED_HEAD / "model.safetensors").is_file():
        return None
    return SHIPPED_HEAD


def training_setting(directory: Path, name: str) -> float | None:
    """A number `specgen train-mtp` recorded in the head's config.json (specgen_training), if any."""
    try:
        value = json.loads((directory / "config.json").read_text())["specgen_training"][name]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


# a trained head's prompt window, in its training windows' length: 256 for the shipped head
WINDOW_PER_SEQ_LEN = 2


def prompt_window(directory: Path) -> int:
    """The prompt positions the head's cache holds: WINDOW_PER_SEQ_LEN x the window length `specgen train-mtp`
    trained it on (the shipped head: 128 -> 256; its acceptance was the same with the whole prompt or the last
    128 positions), or 0 (the whole prompt) for a head trained elsewhere (DeepSeek-V3, ERNIE-4.5), which may
    have learned to attend as far back as the main model."""
    seq_len = training_setting(directory, "seq_len")
    return int(WINDOW_PER_SEQ_LEN * seq_len) if seq_len else 0


class ReferenceHead:
    """An MTP head's pass in Paddle's operators: the catch-up tokens through the head, then chained drafts."""

    def __init__(self, model: ModelView, head: Any):
        # what the pass reads of the model (not the model itself: the head is cached per model, weakly)
        self.rope, self.shape, self.dtype, self.head = model.rope, model.shape, model.dtype, head
        lm = head.lm_head or model.weights.lm_head  # its own LM head, or the main model's
        if head.draft_vocab is not None:  # drafts from these tokens only: their columns
            lm = Linear(paddle.gather(lm.dense(), paddle.to_tensor(head.draft_vocab), axis=1))
        self.lm_head = lm  # [hidden] -> [draft vocabulary]

    def _pass(self, cache: KVCache, slots, starts, lens, token_ids, prev_hidden, draw=None, depth: int = 0):
        """One packed pass of the head over blocks (slots, starts, lens): (block output at each block's end
        [num_seqs, hidden], the draft there [num_seqs]: the argmax, or with `draw` (MtpPass.draw's, one column
        a block) coupled_drafts' at that depth, the block output of every token [num_tokens, hidden])."""
        hd = self.head
        batch = build_forward_batch(slots, starts, lens, token_ids, np.zeros(len(slots), bool))
        reserve(batch, cache)
        eps = self.shape.eps
        emb = F.embedding(paddle.to_tensor(batch.token_ids), hd.embed)  # [num_tokens, hidden]
        x = hd.eh_proj(paddle.concat([rms_norm(emb, hd.enorm, eps), rms_norm(prev_hidden, hd.hnorm, eps)],
                                     axis=-1))
        att = AttentionIndex(batch, cache, self.rope, self.shape.num_heads, self.dtype)
        x = block_forward(x, hd.block, self.shape, att, 0, cache.k[0], cache.v[0])
        last = paddle.gather(x, paddle.to_tensor(batch.logit_rows))  # [num_seqs, hidden]
        logits = self.lm_head(rms_norm(last, hd.final_norm, eps))
        if draw is None or not (draw[0] > 0).any():
            drafts = paddle.argmax(logits, axis=-1).numpy()
        else:
            drafts = coupled_drafts(logits.numpy(), hd.draft_vocab, draw, depth)
        return last, hd.token_ids(drafts), x

    def run(self, cache: KVCache, p: MtpPass) -> tuple[np.ndarray, paddle.Tensor]:
        first = np.concatenate([[0], np.cumsum(p.seq_lens)[:-1]]).astype(np.int64)  # [num_seqs]
        h_main = paddle.gather(p.hidden, paddle.to_tensor(p.rows))  # [num_tokens, hidden]
        x, d, rows = self._pass(cache, p.token_slots[first], p.positions[first], p.seq_lens, p.token_ids,
                                h_main)
        out = np.zeros((len(p.last_rows), p.depth), np.int64)
        if not len(p.last_rows):
            return out, rows
        # the sequences that want drafts: their blocks' ends are catch-up tokens p.last_rows
        wanted = np.searchsorted(first, p.last_rows, side="right") - 1  # [num_wanted] their sequence
        x = paddle.gather(x, paddle.to_tensor(wanted))
        out[:, 0] = d = d[wanted]
        if p.draw is not None and (p.draw[0] > 0).any():  # the first drafts coupled to verification's draw
            last = rms_norm(x, self.head.final_norm, self.shape.eps)
            out[:, 0] = d = self.head.token_ids(coupled_drafts(self.lm_head(last).numpy(),
                                                               self.head.draft_vocab, p.draw))
        slots, last_pos = p.token_slots[p.last_rows], p.positions[p.last_rows]
        ones = np.ones(len(slots), np.int64)
        for i in range(1, p.depth):
            x, d, _ = self._pass(cache, slots, last_pos + i, ones, d, x, p.draw, i)
            out[:, i] = d
        return out, rows
