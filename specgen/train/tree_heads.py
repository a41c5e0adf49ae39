"""Training Medusa and Hydra heads (`specgen train-head --kind medusa | hydra`) on train-mtp's data and loop.

At window position i (the main model's final normed hidden state h_i, which its LM head turned into token
i + 1), head m learns the main model's greedy choice at i + 2 + m:
  - Medusa (Cai et al., 2024): x = h_i, then `head_layers` residual blocks x + SiLU(x W + b);
  - Hydra (Ankner et al., 2024), its "mlp" head with grounded heads: the first block reads
    [h_i; emb(token i + 1); ...; emb(token i + 1 + m)] (the path so far, teacher-forced: a draft only matters
    where the drafts before it were right) as res(x) + SiLU(x W + b), the later blocks as Medusa's.
Both share the main model's LM head (frozen, no per-head copy: the saved heads are small). Losses are weighted
head_decay ** m; with TrainConfig.distill each also targets the main model's own distribution at that
position. Blocks start as the identity (W = 0, Hydra's res = [I 0 ..]), so every head starts as the main
model's next-token guess (Medusa's initialisation).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import paddle
import paddle.nn.functional as F

from specgen.models.model import Model
from specgen.train.trainer import Trainer, batch_picks
from specgen.train.windows import Batch, make_batch


class TrainableHeads(paddle.nn.Layer):
    """K heads of `layers` residual blocks each; Hydra's first blocks also read the path's embeddings."""

    def __init__(self, model: Model, num_heads: int, layers: int, hydra: bool):
        super().__init__()
        h = model.config.hidden_size
        self.num_heads, self.layers, self.hydra = num_heads, layers, hydra
        self.embed = model.weights.embed  # [vocab, hidden] frozen

        def param(name: str, value: np.ndarray) -> None:
            self.add_parameter(name, self.create_parameter(
                list(value.shape), dtype="float32", default_initializer=paddle.nn.initializer.Assign(value)))

        for m in range(num_heads):
            for j in range(layers):
                width = (m + 2) * h if hydra and j == 0 else h
                param(f"h{m}_{j}_w", np.zeros((width, h), np.float32))  # [in, hidden]
                param(f"h{m}_{j}_b", np.zeros(h, np.float32))
                if width != h:  # Hydra's res_connection: starts passing h_i through
                    param(f"h{m}_{j}_rw", np.eye(width, h, dtype=np.float32))
                    param(f"h{m}_{j}_rb", np.zeros(h, np.float32))

    def _p(self, name: str) -> paddle.Tensor | None:
        return self._parameters.get(name)

    def head(self, m: int, x: paddle.Tensor) -> paddle.Tensor:
        """Head m's blocks over its input x [..., in] -> [..., hidden]."""
        for j in range(self.layers):
            res = x if self._p(f"h{m}_{j}_rw") is None else paddle.matmul(x, self._p(f"h{m}_{j}_rw")) \
                + self._p(f"h{m}_{j}_rb")
            x = res + F.silu(paddle.matmul(x, self._p(f"h{m}_{j}_w")) + self._p(f"h{m}_{j}_b"))
        return x

    def forward(self, hidden: paddle.Tensor, path_ids: list[paddle.Tensor]) -> list[paddle.Tensor]:
        """hidden [batch, seq_len, hidden]; path_ids[m] [batch, seq_len] token i + 1 + m (Hydra) -> each
        head's output [batch, seq_len, hidden]."""
        out, x = [], hidden
        for m in range(self.num_heads):
            if self.hydra:
                # [B, L, (m + 2) hidden]
                x = paddle.concat([x, F.embedding(path_ids[m], self.embed)], axis=-1)
            out.append(self.head(m, x))
        return out

    def torch_arrays(self) -> list[list[dict[str, np.ndarray]]]:
        """[head][block] {"w" [out, in], "b", and Hydra's "rw", "rb"} in torch's orientation (float32)."""
        out = []
        for m in range(self.num_heads):
            blocks = []
            for j in range(self.layers):
                d = {"w": self._p(f"h{m}_{j}_w").numpy().T, "b": self._p(f"h{m}_{j}_b").numpy()}
                if self._p(f"h{m}_{j}_rw") is not None:
                    d.update(rw=self._p(f"h{m}_{j}_rw").numpy().T, rb=self._p(f"h{m}_{j}_rb").numpy())
                blocks.append(d)
            out.append(blocks)
        return out


def head_targets(b: Batch, num_heads: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """Per head m: (input token i + 1 + m [batch, seq_len], loss rows [num], labels [num] (training-vocabulary
    indices of the greedy choice at i + 2 + m), teacher rows [num] (CachedData.hidden at i + 1 + m))."""
    out = [(b.next_ids, b.loss_rows, b.label_ids, b.teacher_rows),
           (b.after_ids, b.chain_rows, b.chain_ids, b.chain_teacher_rows)]
    out += [(a.ids, a.rows, a.labels, a.teacher_rows) for a in b.ahead]
    return out[:num_heads]


class TreeHeadTrainer(Trainer):
    """Trainer's data, loop, checkpoints and loss curve for Medusa (HYDRA False) or Hydra heads."""

    HYDRA = False
    KIND = "medusa"
    KIND_FIELDS = ("heads", "head_layers", "head_decay")

    def make_student(self, model: Model) -> dict[str, paddle.Tensor]:
        self.heads = TrainableHeads(model, self.cfg.heads, self.cfg.head_layers, self.HYDRA)
        return dict(self.heads.named_parameters())

    def _batch(self, picks: np.ndarray, windows, vocab_index: np.ndarray) -> Batch:
        return make_batch(self.set.data, windows, picks, self.cfg.seq_len, vocab_index,
                          max(2, self.cfg.heads))

    def _outputs(self, b: Batch, targets) -> list[paddle.Tensor]:
        return self.heads(paddle.to_tensor(b.hidden), [paddle.to_tensor(t[0]) for t in targets])

    @staticmethod
    def _logits(x: paddle.Tensor, rows: np.ndarray, lm_head: paddle.Tensor) -> paddle.Tensor:
        flat = paddle.gather(x.reshape([-1, x.shape[-1]]), paddle.to_tensor(rows))  # [num, hidden]
        return paddle.matmul(flat, lm_head)

    def train_step(self, step: int) -> tuple[float, float, float | None]:
        cfg, s = self.cfg, self.set
        b = self._batch(batch_picks(step, len(s.train), cfg.batch_size, cfg.seed), s.train, s.vocab_index)
        if cfg.hidden_noise > 0:
            from specgen.train.trainer import noisy_hidden

            b = dataclasses.replace(b, hidden=noisy_hidden(b.hidden, cfg.hidden_noise, cfg.seed, step))
        targets = head_targets(b, cfg.heads)
        loss, accs = None, []
        for m, (x, (_, rows, labels, teacher)) in enumerate(zip(self._outputs(b, targets), targets)):
            if not len(rows):
                continue
            logits = self._logits(x, rows, self.lm_train)
            lab = paddle.to_tensor(labels)
            term = cfg.head_decay ** m * self._loss(logits, lab, teacher)
            loss = term if loss is None else loss + term
            accs.append(float((paddle.argmax(logits, axis=-1) == lab).astype("float32").mean()))
        self.update(loss, step)
        return float(loss), accs[0], accs[1] if len(accs) > 1 else None

    @paddle.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Held-out loss of head 0 and acceptance per draft position over the full vocabulary: position m + 1
        is right where heads 0..m all guessed the main model's greedy tokens (the tree's first branch)."""
        held = self.set.held_out
        if len(held) == 0:
            return {}
        K = self.cfg.heads
        tot_loss = num0 = 0.0
        num, ok_n = np.zeros(K), np.zeros(K)
        for lo in range(0, len(held), self.cfg.batch_size):
            b = self._batch(np.arange(lo, min(lo + self.cfg.batch_size, len(held))), held, self.identity)
            targets = head_targets(b, K)
            ok = None
            for m, (x, (_, rows, labels, _)) in enumerate(zip(self._outputs(b, targets), targets)):
                logits = self._logits(x, rows, self.lm_full)
                right = np.zeros(b.next_ids.size, bool)
                right[rows] = paddle.argmax(logits, axis=-1).numpy() == labels
                if m == 0:
                    tot_loss += float(F.cross_entropy(logits, paddle.to_tensor(labels).unsqueeze(-1),
                                                      reduction="sum"))
                    num0 += len(rows)
                ok = right if ok is None else ok & right  # every head up to m right
                num[m] += len(rows)
                ok_n[m] += ok[rows].sum()
        out = {"eval_loss": float(tot_loss / max(num0, 1))}
        for m in range(K):
            out["eval_acc" if m == 0 else f"eval_acc{m + 1}"] = float(ok_n[m] / max(num[m], 1))
        return out

    def save(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        from specgen.train.plot import plot_loss
        from specgen.train.trainer import held_out_acceptance

        cfg, s = self.cfg, self.set
        meta = {"main_model": Path(str(self.loaded.source)).name, "torch_dtype": cfg.save_dtype,
                "specgen_training": {
                    **dataclasses.asdict(cfg), "kind": self.KIND, "num_sequences": len(s.data.ids),
                    "num_generated_tokens": s.data.num_generated, "num_train_windows": len(s.train),
                    "num_eval_windows": len(s.held_out), "train_vocab": len(s.vocab_ids),
                    "draft_vocab_size": len(s.draft_ids), "draft_coverage": s.draft_coverage,
                    "eval_acc_per_position": held_out_acceptance(rows),
                    "train_seconds": rows[-1]["seconds"] if rows else 0.0}}
        self.save_heads(self.heads.torch_arrays(), meta)
        np.save(self.out_dir / "draft_vocab.npy", s.draft_ids)
        plot_loss(self.out_dir / "loss.csv", self.out_dir / "loss.png")
        return meta

    def save_heads(self, arrays: list[list[dict[str, np.ndarray]]], meta: dict[str, Any]) -> None:
        from specgen.drafters.medusa import save_medusa

        dtype = self.cfg.save_dtype
        save_medusa(self.out_dir, [[(d["w"].astype(dtype), d["b"].astype(dtype)) for d in blocks]
                                   for blocks in arrays], None, extra=meta)


class HydraTrainer(TreeHeadTrainer):
    HYDRA = True
    KIND = "hydra"

    def save_heads(self, arrays: list[list[dict[str, np.ndarray]]], meta: dict[str, Any]) -> None:
        from specgen.drafters.hydra import save_hydra

        save_hydra(self.out_dir, [[{k: v.astype(self.cfg.save_dtype) for k, v in d.items()} for d in blocks]
                                  for blocks in arrays], None, extra=meta)
