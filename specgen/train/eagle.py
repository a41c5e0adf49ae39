"""An EAGLE head's training (`specgen train-head --kind eagle`): the feature-level draft layer of EAGLE
(Li et al., 2024) on the self-distillation data every head trains on (train/data.py: the model's own
continuations and the final normed hidden states the engine hands a drafter).

The layer reads fc([embedding of token i + 1; feature at i]) and runs one decoder block; its output feature is
the block's output through a final norm (EAGLE-3's `norm.weight`; EAGLE-1 has none), and that feature both
feeds the main model's LM head (the draft's distribution over token i + 2) and is the next draft's feature
input, as the engine drafts (engine/proposers/eagle.py). Losses: the MTP head's token losses on the first
draft and on the head applied to its own feature (TrainConfig.chain_weight), plus EAGLE's feature regression:
smooth L1 of each output feature against the main model's hidden state at i + 1 (i + 2 for the chained draft).
The block and the final norm start as the main model's last layer and final norm (the MTP head's "last-layer"
initialisation), fc as a pass-through of the feature scaled to the residual stream's size; the trained layer
keeps its input norm (`layers.0.input_layernorm.weight`, which EAGLE-1 leaves out and the loader takes as
optional).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import paddle
import paddle.nn.functional as F

from specgen.layers.norm import rms_norm
from specgen.models.model import Model
from specgen.train.head import TrainableHead, block_arrays, block_to_hf, residual_rms
from specgen.train.trainer import Trainer, _tensors
from specgen.train.windows import make_batch

FEATURE_WEIGHT = 0.2  # weight of the feature regression beside the token loss (EAGLE: 1 against 0.1 on
# tokens; here the token loss is what acceptance measures, the regression keeps the fed-back feature in the
# main model's hidden space)
EVAL_POSITIONS = 3  # held-out acceptance reported for draft positions 1..3 (eval_acc, eval_acc2, eval_acc3)


class TrainableEagle(TrainableHead):
    """The EAGLE layer over padded windows; parameters fc [2 hidden, hidden], fc_bias [hidden], in_gain
    [2 hidden], the block's and final_norm. fc reads its inputs divided by their typical RMS (in_rms: the
    embedding's, the feature's) times in_gain, the constant form of the MTP head's input norms (enorm, hnorm):
    the default model's embeddings are ~14x smaller than its features, and the block reads its input at the
    residual stream's RMS (~29), so that fc itself stays of order 1. Adam's steps are of one size per weight:
    with that scale inside fc (a pass-through of 29 x the identity) fc moved ~29x slower than the MTP head's
    eh_proj, and the layer reached 0.39 at position 1 where the head, on the same data and steps, reached
    0.47. The layout's fc.weight is fc x in_gain / in_rms (export_eagle)."""

    def __init__(self, model: Model, weights: dict[str, np.ndarray], in_rms: np.ndarray):
        super().__init__(model, weights)
        self.in_rms = in_rms  # [2 hidden] float32

    def block_input(self, hidden: paddle.Tensor, token_ids: paddle.Tensor) -> paddle.Tensor:
        """[batch, seq_len, hidden]: fc([emb(token i + 1); feature at i] / in_rms x in_gain) + bias."""
        emb = F.embedding(token_ids, self.embed)  # [batch, seq_len, hidden]
        both = paddle.concat([emb, hidden], axis=-1) / paddle.to_tensor(self.in_rms) * self.in_gain
        return paddle.matmul(both, self.fc) + self.fc_bias

    def feature(self, x: paddle.Tensor) -> paddle.Tensor:
        """The output feature of block outputs x [..., hidden]: what the LM head reads and the next draft
        takes."""
        return rms_norm(x, self.final_norm, self.eps)

    def logits(self, x: paddle.Tensor, rows: paddle.Tensor, lm_head: paddle.Tensor) -> paddle.Tensor:
        """[num_rows, vocab'] logits at flat rows of x [batch, seq_len, hidden]; their output features stay in
        last_features [num_rows, hidden] (the feature regression's input)."""
        self.last_features = self.feature(paddle.gather(x.reshape([-1, x.shape[-1]]), rows))
        return paddle.matmul(self.last_features, lm_head)

    def chain(self, x1: paddle.Tensor, kv1, after_ids: paddle.Tensor,
              positions: paddle.Tensor) -> paddle.Tensor:
        """The second draft: the layer on its own first output feature (TrainableHead.chain's attention)."""
        return super().chain(self.feature(x1), kv1, after_ids, positions)

    def unroll(self, x1: paddle.Tensor, kv1, ids: list[paddle.Tensor], positions: paddle.Tensor) -> list:
        """Drafts 2, 3, ... as the engine chains them: draft j + 1 at window position i reads token ids[j - 1]
        (token i + 1 + j) and draft j's feature, at position i + j, and attends to the first pass's keys of
        positions <= i and to drafts 2..j + 1's own keys at i. Returns their block outputs."""
        k1, v1 = kv1
        L = x1.shape[1]
        mask = paddle.to_tensor(np.triu(np.full((L, L), -np.inf, np.float32), 1))
        outs, keys, values, x = [], [], [], x1
        for j, tok in enumerate(ids, start=1):
            inp = self.block_input(self.feature(x), tok)  # [B, L, hidden]
            q, k, v = self._qkv(inp, positions + j)
            keys.append(k)
            values.append(v)
            scores = paddle.concat([paddle.matmul(q, k1, transpose_y=True) + mask]
                                   + [paddle.sum(q * kk, axis=-1, keepdim=True) for kk in keys], axis=-1)
            probs = F.softmax(scores, axis=-1)  # [B, H, L, L + j]
            attn = paddle.matmul(probs[..., :L], v1)
            for s, vv in enumerate(values):
                attn = attn + probs[..., L + s:L + s + 1] * vv
            x = self._finish(inp, attn)
            outs.append(x)
        return outs


def initial_eagle_weights(model: Model, scale: float) -> dict[str, np.ndarray]:
    """The main model's last layer and final norm; the inputs' gains at the residual stream's RMS `scale` and
    fc passing the feature through, its embedding half at zero (the MTP head's "last-layer" start)."""
    h = model.config.hidden_size
    fc = np.concatenate([np.zeros((h, h), np.float32), np.eye(h, dtype=np.float32)])
    return {"fc": fc, "fc_bias": np.zeros(h, np.float32), "in_gain": np.full(2 * h, scale, np.float32),
            **block_arrays(model.weights.blocks[-1]),
            "final_norm": model.weights.final_norm.numpy().astype(np.float32)}


def export_eagle(head: TrainableEagle, dtype: str) -> dict[str, np.ndarray]:
    """The layer in EAGLE's layout (HF [out, in] weights): fc.weight, fc.bias, layers.0.*, norm.weight."""
    w = {name: p.numpy() for name, p in head.named_parameters()}
    fc = w["fc"] * (w["in_gain"] / head.in_rms)[:, None]  # [2 hidden, hidden] on the raw inputs
    out = {"fc.weight": fc.T, "fc.bias": w["fc_bias"], "norm.weight": w["final_norm"],
           **{"layers.0." + n: a for n, a in block_to_hf(w, head.cfg).items()}}
    return {n: np.ascontiguousarray(a.astype(dtype)) for n, a in out.items()}


class EagleTrainer(Trainer):
    """Trainer's data, windows, loop, checkpoints and loss curve, for an EAGLE layer."""

    KIND = "eagle"

    def __init__(self, loaded: Any, out_dir: Path, cfg: Any, data_dir: Path | None = None):
        super().__init__(loaded, out_dir, dataclasses.replace(cfg, num_layers=1), data_dir)

    def fingerprint(self) -> dict[str, Any]:
        # checkpoints from before fc trained at order 1 (in_gain) hold another parametrisation: not resumed
        return {**super().fingerprint(), "fc": "order 1, input gains"}

    def make_student(self, model: Model) -> dict[str, paddle.Tensor]:
        data = self.set.data
        sample = data.tokens[data.tok_start[0]: data.tok_start[0] + min(256, data.num_rows[0] + 1)]
        h = model.config.hidden_size
        rms = [float(np.median(np.sqrt((np.asarray(x, np.float32) ** 2).mean(-1))))
               for x in (model.weights.embed.numpy(), data.hidden[:4096])]  # the embedding's, the feature's
        in_rms = np.repeat(np.array(rms, np.float32), h)
        self.head = TrainableEagle(model, initial_eagle_weights(model, residual_rms(model, sample)), in_rms)
        self.modules = [self.head]
        return dict(self.head.named_parameters())

    def _loss(self, logits: paddle.Tensor, labels: paddle.Tensor, teacher_rows: np.ndarray) -> paddle.Tensor:
        """Trainer's token loss, plus FEATURE_WEIGHT x the smooth L1 of the output features those logits were
        computed from (TrainableEagle.logits keeps them) against the main model's hidden states at
        teacher_rows (position i + 1 for the first draft, i + 2 for the chained one)."""
        # [num, hidden]
        target = paddle.to_tensor(np.asarray(self.set.data.hidden[teacher_rows], np.float32))
        return super()._loss(logits, labels, teacher_rows) \
            + FEATURE_WEIGHT * F.smooth_l1_loss(self.head.last_features, target)

    @paddle.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Held-out loss, and acceptance at draft positions 1..EVAL_POSITIONS over the full vocabulary (every
        draft up to it right, each chained on the layer's own features as the engine drafts a chain)."""
        held = self.set.held_out
        if len(held) == 0:
            return {}
        tot_loss = num = 0.0
        tried, right = np.zeros(EVAL_POSITIONS), np.zeros(EVAL_POSITIONS)
        for lo in range(0, len(held), self.cfg.batch_size):
            picks = np.arange(lo, min(lo + self.cfg.batch_size, len(held)))
            b = make_batch(self.set.data, held, picks, self.cfg.seq_len, self.identity,
                           modules=EVAL_POSITIONS)
            hidden, next_ids, positions = _tensors(b)
            x1, kv = self.head(hidden, next_ids, positions)
            logits = self.head.logits(x1, paddle.to_tensor(b.loss_rows), self.lm_full)
            tot_loss += float(F.cross_entropy(logits, paddle.to_tensor(b.label_ids).unsqueeze(-1),
                                              reduction="sum"))
            num += len(b.loss_rows)
            ok = np.zeros(b.next_ids.size, bool)
            ok[b.loss_rows] = paddle.argmax(logits, axis=-1).numpy() == b.label_ids
            tried[0], right[0] = tried[0] + len(b.loss_rows), right[0] + ok.sum()
            later = self._later(b)[:EVAL_POSITIONS - 1]
            outs = self.head.unroll(x1, kv, [paddle.to_tensor(ids) for ids, _, _, _ in later], positions)
            for j, (x, (_, rows, label_ids, _)) in enumerate(zip(outs, later), start=1):
                both = np.zeros_like(ok)
                if len(rows):
                    pred = paddle.argmax(self.head.logits(x, paddle.to_tensor(rows), self.lm_full),
                                         axis=-1).numpy()
                    both[rows] = ok[rows] & (pred == label_ids)  # every draft up to this one right
                tried[j], right[j] = tried[j] + len(rows), right[j] + both.sum()
                ok = both
        acc = right / np.maximum(tried, 1)
        return {"eval_loss": float(tot_loss / max(num, 1)), "eval_acc": float(acc[0]),
                **{f"eval_acc{j + 1}": float(acc[j]) for j in range(1, EVAL_POSITIONS)}}

    def save(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        from safetensors.numpy import save_file

        from specgen.drafters.eagle import eagle_config
        from specgen.train.plot import plot_loss

        cfg, s = self.cfg, self.set
        last = next((r for r in reversed(rows) if r.get("eval_acc") is not None), {})
        training = {**dataclasses.asdict(cfg), "kind": "eagle", "feature_weight": FEATURE_WEIGHT,
                    "num_sequences": len(s.data.ids), "num_generated_tokens": s.data.num_generated,
                    "num_train_windows": len(s.train), "num_eval_windows": len(s.held_out),
                    "train_vocab": len(s.vocab_ids), "draft_vocab_size": len(s.draft_ids),
                    "draft_coverage": s.draft_coverage, "train_seconds": rows[-1]["seconds"] if rows else 0.0,
                    **{k: last.get(k) for k in ("eval_loss", "eval_acc", "eval_acc2", "eval_acc3")}}
        meta = {**eagle_config(self.loaded.config), "main_model": Path(str(self.loaded.source)).name,
                "torch_dtype": cfg.save_dtype, "specgen_training": training}
        self.out_dir.mkdir(parents=True, exist_ok=True)
        save_file(export_eagle(self.head, cfg.save_dtype), str(self.out_dir / "model.safetensors"))
        (self.out_dir / "config.json").write_text(json.dumps(meta, indent=2))
        np.save(self.out_dir / "draft_vocab.npy", s.draft_ids)
        plot_loss(self.out_dir / "loss.csv", self.out_dir / "loss.png")
        return meta
