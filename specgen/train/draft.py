"""Self-distillation of a draft model cut from the main model (`specgen make-draft --data`).

The draft is the main model's first L decoder layers with its final norm and (frozen, shared) embedding and LM
head. It is trained on the data `specgen train-mtp` generates (the main model's own continuations and the
hidden states it verified them from, train/data.py), in the same windows: at window position i the draft reads
token i + 1 and learns the main model's greedy choice at i + 2 and, with TrainConfig.distill, its distribution
there (the main model's cached hidden state at i + 1 times the LM head), exactly the MTP head's targets one
position on. The trained layers and final norm are written back into an ordinary HF checkpoint beside the
training state.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import paddle
import paddle.nn.functional as F

from specgen.models.model import Model
from specgen.train.head import TrainableBlock, block_arrays, block_to_hf, row_logits
from specgen.train.trainer import Trainer, batch_picks
from specgen.train.windows import Batch, make_batch


class TrainableDraft(paddle.nn.Layer):
    """The first `num_layers` decoder layers of `model` (trainable copies, dense float32), its final norm
    (trainable), its embedding (frozen) over padded windows [batch, seq_len]."""

    def __init__(self, model: Model, num_layers: int):
        super().__init__()
        self.eps = model.config.rms_norm_eps
        self.embed = model.weights.embed  # [vocab, hidden] frozen
        self.blocks = paddle.nn.LayerList([TrainableBlock(model, block_arrays(b))
                                           for b in model.weights.blocks[:num_layers]])
        norm = model.weights.final_norm.numpy().astype(np.float32)
        self.final_norm = self.create_parameter(list(norm.shape), dtype="float32",
                                                default_initializer=paddle.nn.initializer.Assign(norm))

    def forward(self, token_ids: paddle.Tensor, positions: paddle.Tensor) -> paddle.Tensor:
        """[batch, seq_len] token ids at their positions -> the last layer's output
        [batch, seq_len, hidden]."""
        x = F.embedding(token_ids, self.embed)
        for block in self.blocks:
            x, _ = block.block(x, positions)
        return x

    def logits(self, x: paddle.Tensor, rows: paddle.Tensor, lm_head: paddle.Tensor) -> paddle.Tensor:
        return row_logits(x, rows, self.final_norm, self.eps, lm_head)

    def hf_weights(self) -> dict[str, np.ndarray]:
        """The trained layers and final norm under their HF names (float32)."""
        out = {"model.norm.weight": self.final_norm.numpy()}
        for i, block in enumerate(self.blocks):
            w = {name: p.numpy() for name, p in block.named_parameters()}
            out.update({f"model.layers.{i}.{n}": a for n, a in block_to_hf(w, block.cfg).items()})
        return {n: np.ascontiguousarray(a, np.float32) for n, a in out.items()}


class DraftTrainer(Trainer):
    """Trainer's loop, data, checkpoints and loss curve, for a draft model of `num_layers` layers. out_dir
    holds the training state (data/, checkpoint/, loss.csv); the draft is written by `save_draft`."""

    def __init__(self, loaded: Any, out_dir: Path, cfg: Any, num_layers: int):
        self.num_layers = num_layers
        super().__init__(loaded, out_dir, dataclasses.replace(cfg, num_layers=1, chain_weight=0.0))

    def make_student(self, model: Model) -> dict[str, paddle.Tensor]:
        self.draft = TrainableDraft(model, self.num_layers)
        return dict(self.draft.named_parameters())

    def fingerprint(self) -> dict[str, Any]:
        return {**super().fingerprint(), "draft_layers": self.num_layers}

    def _forward(self, b: Batch) -> paddle.Tensor:
        """The draft over token i + 1 at position i + 1 of each window position i."""
        return self.draft(paddle.to_tensor(b.next_ids), paddle.to_tensor(b.positions + 1))

    def train_step(self, step: int) -> tuple[float, float, float | None]:
        cfg, s = self.cfg, self.set
        b = make_batch(s.data, s.train, batch_picks(step, len(s.train), cfg.batch_size, cfg.seed),
                       cfg.seq_len, s.vocab_index, modules=1)
        logits = self.draft.logits(self._forward(b), paddle.to_tensor(b.loss_rows), self.lm_train)
        labels = paddle.to_tensor(b.label_ids)
        loss = self._loss(logits, labels, b.teacher_rows)
        acc = float((paddle.argmax(logits, axis=-1) == labels).astype("float32").mean())
        self.update(loss, step)
        return float(loss), acc, None

    @paddle.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Held-out loss and top-1 agreement with the main model's greedy choice over the full vocabulary (the
        first draft's acceptance, teacher-forced); eval_acc2: two consecutive positions both right (the second
        draft's acceptance: when the first is right, its input is the true token)."""
        held = self.set.held_out
        if len(held) == 0:
            return {}
        tot_loss = num = num_ok = num2 = num_ok2 = 0.0
        for lo in range(0, len(held), self.cfg.batch_size):
            picks = np.arange(lo, min(lo + self.cfg.batch_size, len(held)))
            b = make_batch(self.set.data, held, picks, self.cfg.seq_len, self.identity, modules=1)
            logits = self.draft.logits(self._forward(b), paddle.to_tensor(b.loss_rows), self.lm_full)
            labels = paddle.to_tensor(b.label_ids)
            tot_loss += float(F.cross_entropy(logits, labels.unsqueeze(-1), reduction="sum"))
            ok = np.zeros(b.next_ids.size + 1, bool)
            ok[b.loss_rows] = paddle.argmax(logits, axis=-1).numpy() == b.label_ids
            num, num_ok = num + len(b.loss_rows), num_ok + ok[b.loss_rows].sum()
            # pairs (r, r + 1) inside one window, both with a label
            pairs = b.loss_rows[np.isin(b.loss_rows + 1, b.loss_rows)
                                & ((b.loss_rows + 1) % self.cfg.seq_len > 0)]
            num2, num_ok2 = num2 + len(pairs), num_ok2 + (ok[pairs] & ok[pairs + 1]).sum()
        return {"eval_loss": float(tot_loss / max(num, 1)), "eval_acc": float(num_ok / max(num, 1)),
                "eval_acc2": float(num_ok2 / max(num2, 1))}

    def save(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        from specgen.train.plot import plot_loss

        plot_loss(self.out_dir / "loss.csv", self.out_dir / "loss.png")
        last = next((r for r in reversed(rows) if r.get("eval_acc") is not None), {})
        s = self.set
        return {"steps": self.cfg.steps, "distill": self.cfg.distill, "seq_len": self.cfg.seq_len,
                "num_sequences": len(s.data.ids), "num_generated_tokens": s.data.num_generated,
                "num_train_windows": len(s.train), "eval_loss": last.get("eval_loss"),
                "eval_acc": last.get("eval_acc"), "eval_acc2": last.get("eval_acc2"),
                "train_seconds": rows[-1]["seconds"] if rows else 0.0}
