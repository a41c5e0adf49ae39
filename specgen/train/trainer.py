"""The training loop: batches, loss, held-out evaluation, checkpoints, loss.csv, and the final save.

Batches are a pure function of (seed, step): window order is a seeded permutation per epoch. So a checkpoint
(weights, optimizer state, step, the loss rows) is all a resumed run needs to end where an uninterrupted one
would have.
"""
from __future__ import annotations

import csv
import dataclasses
import json
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import paddle
import paddle.nn.functional as F

from specgen.errors import ConfigError, InputError
from specgen.train.config import TrainConfig
from specgen.train.data import CachedData, load_data, prompt_groups
from specgen.train.head import TrainableHead, export_weights, initial_weights, residual_rms
from specgen.train.optim import AdamW, lr_at
from specgen.train.windows import (
    Batch,
    Windows,
    label_counts,
    make_batch,
    make_windows,
    shortlist,
    split_sequences,
)

MAX_EVAL_POSITIONS = 5  # held-out acceptance is logged for draft positions 1..5 (eval_acc, eval_acc2, ...)
EVAL_COLUMNS = ("eval_acc",) + tuple(f"eval_acc{i}" for i in range(2, MAX_EVAL_POSITIONS + 1))
COLUMNS = ("step", "lr", "loss", "acc", "acc2", "eval_loss", *EVAL_COLUMNS, "seconds")
# Settings that only change what is logged or written: a checkpoint made with others can be resumed.
NOT_FINGERPRINTED = ("log_every", "eval_every", "checkpoint_every", "save_dtype", "max_eval_windows",
                     "gen_batch_size", "draft_vocab")
# Settings of some kinds only: a kind's trainer fingerprints those it uses (KIND_FIELDS), so that checkpoints
# of the others stay resumable whatever they are.
KIND_ONLY = ("heads", "head_layers", "head_decay")
OnStep = Callable[[int, int, "dict[str, Any] | None"], None]


@dataclass(frozen=True)
class TrainingSet:
    """The windows, split into train and held-out, and the training vocabulary."""

    data: CachedData
    train: Windows
    held_out: Windows
    vocab_ids: np.ndarray  # [train_vocab] int64 token id of each training-vocabulary index
    vocab_index: np.ndarray  # [vocab_size] int64 training-vocabulary index of each token, -1 outside it
    coverage: float  # share of training labels inside the training vocabulary
    draft_ids: np.ndarray  # [draft_vocab] int64 the saved draft vocabulary: the most frequent labels, sorted
    # by id
    draft_coverage: float  # share of training labels inside the draft vocabulary


def training_set(data_dir: Path, vocab_size: int, cfg: TrainConfig) -> TrainingSet:
    data = load_data(data_dir)
    groups, greedy = prompt_groups(data.ids)  # [num_seqs] each
    train_seqs, eval_seqs = split_sequences(groups, cfg.eval_fraction, cfg.seed)
    # held out: the greedy continuations of the held-out prompts (what greedy speculation meets); their
    # sampled siblings are used by neither side
    eval_seqs = eval_seqs[greedy[eval_seqs]]
    from_end = cfg.window_anchor == "end"
    windows = make_windows(data, cfg.seq_len, cfg.overlap, cfg.prompt_examples, from_end)
    train = windows.subset(np.isin(windows.seq, train_seqs))
    continuation = make_windows(data, cfg.seq_len, cfg.overlap, prompt_examples=False, from_end=from_end)
    held = continuation.subset(np.isin(continuation.seq, eval_seqs))
    if len(held) > cfg.max_eval_windows:  # evenly spaced, so that every held-out sequence tends to show up
        held = held.subset(np.linspace(0, len(held) - 1, cfg.max_eval_windows).round().astype(np.int64))
    if len(train) == 0:
        raise InputError(f"{data_dir}: no training positions (every continuation is shorter than 2 tokens)")
    counts = label_counts(data, train, vocab_size)
    ids = shortlist(counts, cfg.shortlist)
    index = np.full(vocab_size, -1, np.int64)
    index[ids] = np.arange(len(ids))
    draft = shortlist(counts, cfg.draft_vocab) if 0 < cfg.draft_vocab < len(ids) else ids
    total = max(1, counts.sum())
    return TrainingSet(data, train, held, ids, index, float(counts[ids].sum() / total), draft,
                       float(counts[draft].sum() / total))


def held_out_acceptance(rows: list[dict[str, Any]]) -> list[float]:
    """The last evaluation's held-out acceptance at draft positions 1, 2, ... (every draft up to it right), as
    far as the head was evaluated."""
    last = next((r for r in reversed(rows) if r.get("eval_acc") is not None), {})
    out = []
    for k in EVAL_COLUMNS:
        if last.get(k) is None:
            break
        out.append(float(last[k]))
    return out


def batch_picks(step: int, num_windows: int, batch_size: int, seed: int) -> np.ndarray:
    """Windows of step `step`: items [step * B, (step + 1) * B) of the epochs' seeded permutations, end to
    end."""
    flat = np.arange(step * batch_size, (step + 1) * batch_size)
    epochs, offsets = np.divmod(flat, num_windows)
    perms = {e: np.random.default_rng([seed, int(e)]).permutation(num_windows) for e in np.unique(epochs)}
    return np.array([perms[e][o] for e, o in zip(epochs, offsets)], np.int64)


def _tensors(b: Batch):
    return (paddle.to_tensor(b.hidden), paddle.to_tensor(b.next_ids), paddle.to_tensor(b.positions))


def noisy_hidden(hidden: np.ndarray, scale: float, seed: int, step: int) -> np.ndarray:
    """hidden [N, H] plus Gaussian noise of std `scale` x each row's RMS (EAGLE's input noise: the head
    sees the main model's states as slightly off, as its own drafts will be). Seeded by (seed, step), so a
    resumed run draws the same noise."""
    rms = np.sqrt((hidden ** 2).mean(-1, keepdims=True))  # [N, 1]
    noise = np.random.default_rng([seed, step, 1]).standard_normal(hidden.shape, np.float32)
    return (hidden + scale * rms * noise).astype(hidden.dtype)


class Trainer:
    """Trains a head for `loaded.model` on the generated data (data_dir, by default OUT_DIR/data) and writes
    OUT_DIR/{model.safetensors, config.json, ...}. Other kinds of head subclass it (train/kinds.py)."""

    KIND = "mtp"  # train-head --kind, fingerprinted with KIND_FIELDS
    KIND_FIELDS: tuple[str, ...] = ()  # the KIND_ONLY settings this kind uses

    def __init__(self, loaded: Any, out_dir: Path, cfg: TrainConfig, data_dir: Path | None = None):
        self.loaded, self.out_dir, self.cfg = loaded, out_dir, cfg
        model = loaded.model
        self.set = training_set(data_dir or out_dir / "data", loaded.config.vocab_size, cfg)
        paddle.seed(cfg.seed)
        self.params = self.make_student(model)
        self.opt = AdamW(self.params, cfg)
        self.lm_full = model.weights.lm_head.dense()  # [hidden, vocab]
        self.lm_train = paddle.gather(self.lm_full, paddle.to_tensor(self.set.vocab_ids),
                                      axis=1)  # [hidden, V']
        self.identity = np.arange(loaded.config.vocab_size, dtype=np.int64)

    def make_student(self, model: Any) -> dict[str, paddle.Tensor]:
        """The model trained (here the head's modules), initialised; returns its parameters by name."""
        cfg, data = self.cfg, self.set.data
        sample = data.tokens[data.tok_start[0]: data.tok_start[0] + min(256, data.num_rows[0] + 1)]
        scale = residual_rms(model, sample) if cfg.init == "last-layer" else 1.0
        # module i of a multi-layer head (the first is `head`); its parameters are named m{i}.*
        self.modules = [TrainableHead(model, initial_weights(model, cfg.init, cfg.seed + i, scale))
                        for i in range(cfg.num_layers)]
        self.head = self.modules[0]
        return {(f"m{i}." if i else "") + n: p for i, m in enumerate(self.modules)
                for n, p in m.named_parameters()}

    # ---- one step and one evaluation ----

    def train_step(self, step: int) -> tuple[float, float, float | None]:
        """Returns (loss, top-1 accuracy over the training vocabulary, second-draft accuracy or None)."""
        cfg, s = self.cfg, self.set
        picks = batch_picks(step, len(s.train), cfg.batch_size, cfg.seed)
        b = make_batch(s.data, s.train, picks, cfg.seq_len, s.vocab_index, cfg.num_layers)
        if cfg.hidden_noise > 0:
            b = dataclasses.replace(b, hidden=noisy_hidden(b.hidden, cfg.hidden_noise, cfg.seed, step))
        hidden, next_ids, positions = _tensors(b)
        x1, kv = self.head(hidden, next_ids, positions)
        logits = self.head.logits(x1, paddle.to_tensor(b.loss_rows), self.lm_train)  # [num_loss, V']
        labels = paddle.to_tensor(b.label_ids)
        loss = self._loss(logits, labels, b.teacher_rows)
        acc = float((paddle.argmax(logits, axis=-1) == labels).astype("float32").mean())
        acc2 = None
        if cfg.num_layers > 1:  # modules 1..: each on the one before's outputs, teacher-forced tokens
            x = x1
            for i, (ids, rows, label_ids, teacher) in enumerate(self._later(b), start=1):
                x, _ = self.modules[i](x, paddle.to_tensor(ids), positions)
                if not len(rows):
                    continue
                logits_i = self.modules[i].logits(x, paddle.to_tensor(rows), self.lm_train)
                labels_i = paddle.to_tensor(label_ids)
                loss = loss + cfg.module_weight * self._loss(logits_i, labels_i, teacher)
                if i == 1:
                    acc2 = float((paddle.argmax(logits_i, axis=-1) == labels_i).astype("float32").mean())
        elif cfg.chain_weight > 0 and len(b.chain_rows):
            x2 = self.head.chain(x1, kv, paddle.to_tensor(b.after_ids), positions)
            logits2 = self.head.logits(x2, paddle.to_tensor(b.chain_rows), self.lm_train)
            labels2 = paddle.to_tensor(b.chain_ids)
            loss = loss + cfg.chain_weight * self._loss(logits2, labels2, b.chain_teacher_rows)
            acc2 = float((paddle.argmax(logits2, axis=-1) == labels2).astype("float32").mean())
        self.update(loss, step)
        return float(loss), acc, acc2

    def update(self, loss: paddle.Tensor, step: int) -> None:
        """Backward, the optimizer's step, gradients cleared."""
        loss.backward()
        self.opt.step(lr_at(step, self.cfg))
        for p in self.params.values():
            p.clear_gradient()

    @staticmethod
    def _later(b: Batch) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
        """Modules 1.. of a multi-layer head: (input token ids [batch, seq_len], loss rows, labels, teacher
        rows)."""
        return [(b.after_ids, b.chain_rows, b.chain_ids, b.chain_teacher_rows)] + \
            [(a.ids, a.rows, a.labels, a.teacher_rows) for a in b.ahead]

    def _loss(self, logits: paddle.Tensor, labels: paddle.Tensor, teacher_rows: np.ndarray) -> paddle.Tensor:
        """Mean cross-entropy of logits [num, V'] against the greedy labels [num] and, with cfg.distill,
        against the main model's own distribution over the training vocabulary: softmax of its cached (final
        normed) hidden state one position on, times the LM head, the logits it chose the label from. The two
        targets are mixed into one soft label (Paddle's log_softmax and its backward are ~100x slower on
        CPU)."""
        d = self.cfg.distill
        if d == 0:
            return F.cross_entropy(logits, labels.unsqueeze(-1)).mean()
        with paddle.no_grad():
            # [num, hidden]
            h = self.loaded.config.hidden_size  # (a row may hold features after the hidden state: EAGLE-3's)
            teacher = paddle.to_tensor(np.asarray(self.set.data.hidden[teacher_rows, :h], np.float32))
            target = d * F.softmax(paddle.matmul(teacher, self.lm_train), axis=-1) \
                + (1 - d) * F.one_hot(labels, logits.shape[-1])  # [num, V']
        return F.cross_entropy(logits, target, soft_label=True).mean()

    @paddle.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Held-out loss and top-1 accuracy over the full vocabulary (what the engine's argmax sees);
        eval_acc2: both drafts right (first one, and the head applied to its own output), i.e. position-2
        acceptance."""
        held = self.set.held_out
        if len(held) == 0:
            return {}
        depth = max(2, min(3, self.cfg.num_layers))  # positions evaluated past the first
        tot_loss = num = num_ok = 0.0
        num_later, ok_later = np.zeros(depth - 1), np.zeros(depth - 1)
        for lo in range(0, len(held), self.cfg.batch_size):
            picks = np.arange(lo, min(lo + self.cfg.batch_size, len(held)))
            b = make_batch(self.set.data, held, picks, self.cfg.seq_len, self.identity, self.cfg.num_layers)
            hidden, next_ids, positions = _tensors(b)
            x1, kv = self.head(hidden, next_ids, positions)
            logits = self.head.logits(x1, paddle.to_tensor(b.loss_rows), self.lm_full)
            labels = paddle.to_tensor(b.label_ids)
            tot_loss += float(F.cross_entropy(logits, labels.unsqueeze(-1), reduction="sum"))
            ok = np.zeros(b.hidden.shape[0] * b.hidden.shape[1], bool)
            ok[b.loss_rows] = paddle.argmax(logits, axis=-1).numpy() == b.label_ids
            num, num_ok = num + len(b.loss_rows), num_ok + ok.sum()
            x = x1
            for i, (ids, rows, label_ids, _) in enumerate(self._later(b)[:depth - 1], start=1):
                if self.cfg.num_layers > 1:
                    x, _ = self.modules[i](x, paddle.to_tensor(ids), positions)
                elif i == 1:  # one module: chained on its own output
                    x = self.head.chain(x1, kv, paddle.to_tensor(ids), positions)
                if not len(rows):
                    continue
                pred = paddle.argmax(self.modules[min(i, len(self.modules) - 1)].logits(
                    x, paddle.to_tensor(rows), self.lm_full), axis=-1).numpy()
                both = np.zeros_like(ok)
                both[rows] = ok[rows] & (pred == label_ids)  # every draft up to this one right
                num_later[i - 1] += len(rows)
                ok_later[i - 1] += both.sum()
                ok = both
        out = {"eval_loss": float(tot_loss / max(num, 1)), "eval_acc": float(num_ok / max(num, 1)),
               "eval_acc2": float(ok_later[0] / max(num_later[0], 1))}
        if depth > 2:
            out["eval_acc3"] = float(ok_later[1] / max(num_later[1], 1))
        return out

    # ---- checkpoints ----

    def fingerprint(self) -> dict[str, Any]:
        skip = set(NOT_FINGERPRINTED) | set(KIND_ONLY) - set(self.KIND_FIELDS)
        d = {k: v for k, v in dataclasses.asdict(self.cfg).items() if k not in skip}
        if self.KIND != "mtp":  # an MTP checkpoint's fingerprint is what it was before there were kinds
            d["kind"] = self.KIND
        return {**d, "num_sequences": len(self.set.data.ids)}

    def save_checkpoint(self, state: dict[str, Any]) -> None:
        """Write checkpoint.tmp, then swap it in; a kill at any point leaves a complete checkpoint or the old
        one."""
        final, tmp, old = (self.out_dir / n for n in ("checkpoint", "checkpoint.tmp", "checkpoint.old"))
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        np.savez(tmp / "weights.npz", **{n: p.numpy() for n, p in self.params.items()})
        np.savez(tmp / "optimizer.npz", **self.opt.state())
        (tmp / "state.json").write_text(json.dumps({**state, "fingerprint": self.fingerprint()}))
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)

    def load_checkpoint(self) -> dict[str, Any] | None:
        for name in ("checkpoint", "checkpoint.old"):
            d = self.out_dir / name
            if (d / "state.json").exists():
                state = json.loads((d / "state.json").read_text())
                if state["fingerprint"] != self.fingerprint():
                    diff = sorted(k for k, v in self.fingerprint().items()
                                  if state["fingerprint"].get(k) != v)
                    raise ConfigError(f"{d} was made with other settings ({', '.join(diff)}); rerun with the "
                                      "same settings to resume, or remove it to start over")
                with np.load(d / "weights.npz") as w:
                    for n, p in self.params.items():
                        paddle.assign(paddle.to_tensor(w[n]), p)
                with np.load(d / "optimizer.npz") as o:
                    self.opt.load(dict(o))
                return state
        return None

    # ---- the loop ----

    def run(self, on_step: OnStep | None = None) -> dict[str, Any]:
        """Train to cfg.steps (resuming from the last checkpoint), then save the head; returns its metadata.
        self.rows: loss.csv's rows."""
        cfg = self.cfg
        state = self.load_checkpoint() or {"step": 0, "rows": [], "acc": [0.0, 0.0, 0.0, 0], "seconds": 0.0}
        step, rows = state["step"], state["rows"]
        if step == 0 and not rows:
            rows.append(self._row(0, None, self.evaluate(), 0.0))
        sums = state["acc"]  # running [loss, acc, acc2] sums and their count since the last logged row
        start = time.perf_counter() - state["seconds"]
        self._write_csv(rows)
        if on_step is not None:
            on_step(step, cfg.steps, rows[-1])
        self.rows = rows
        while step < cfg.steps:
            loss, acc, acc2 = self.train_step(step)
            sums = [sums[0] + loss, sums[1] + acc, sums[2] + (acc2 or 0.0), sums[3] + 1]
            step += 1
            row = None
            if step % cfg.log_every == 0 or step % cfg.eval_every == 0 or step == cfg.steps:
                ev = self.evaluate() if step % cfg.eval_every == 0 or step == cfg.steps else {}
                row = self._row(step, sums, ev, time.perf_counter() - start)
                rows.append(row)
                sums = [0.0, 0.0, 0.0, 0]
                self._write_csv(rows)
            if step % cfg.checkpoint_every == 0 or step == cfg.steps:
                self.save_checkpoint({"step": step, "rows": rows, "acc": sums,
                                      "seconds": time.perf_counter() - start})
            if on_step is not None:
                on_step(step, cfg.steps, row)
        return self.save(rows)

    def _row(self, step: int, sums: list | None, ev: dict[str, float], seconds: float) -> dict[str, Any]:
        n = sums[3] if sums else 0
        row: dict[str, Any] = {"step": step, "lr": lr_at(max(step - 1, 0), self.cfg) if step else 0.0,
                               "loss": sums[0] / n if n else None, "acc": sums[1] / n if n else None,
                               "acc2": sums[2] / n if n and self.cfg.chain_weight > 0 else None}
        row.update({k: ev.get(k) for k in ("eval_loss", *EVAL_COLUMNS)})
        row["seconds"] = round(seconds, 2)
        return row

    def _write_csv(self, rows: list[dict[str, Any]]) -> None:
        with open(self.out_dir / "loss.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=COLUMNS)
            w.writeheader()
            w.writerows({k: ("" if r.get(k) is None else r[k]) for k in COLUMNS} for r in rows)

    def save(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        from specgen.drafters.mtp import save_mtp
        from specgen.train.plot import plot_loss

        cfg, s = self.cfg, self.set
        last_eval = next((r for r in reversed(rows) if r.get("eval_acc") is not None), {})
        meta = {
            "main_model": Path(str(self.loaded.source)).name, "hidden_size": self.loaded.config.hidden_size,
            "vocab_size": self.loaded.config.vocab_size, "num_main_layers": self.loaded.config.num_layers,
            "torch_dtype": cfg.save_dtype,
            "specgen_training": {
                **dataclasses.asdict(cfg), "num_sequences": len(s.data.ids),
                "num_generated_tokens": s.data.num_generated, "num_train_windows": len(s.train),
                "num_eval_windows": len(s.held_out), "train_vocab": len(s.vocab_ids),
                "label_coverage": s.coverage, "draft_vocab_size": len(s.draft_ids),
                "draft_coverage": s.draft_coverage, "eval_loss": last_eval.get("eval_loss"),
                "eval_acc": last_eval.get("eval_acc"), "eval_acc2": last_eval.get("eval_acc2"),
                "eval_acc3": last_eval.get("eval_acc3"),
                "train_seconds": rows[-1]["seconds"] if rows else 0.0,
            },
        }
        weights = {}
        for i, m in enumerate(self.modules):
            weights.update(export_weights(m, cfg.save_dtype, i))
        save_mtp(self.out_dir, weights, extra=meta)
        # The draft vocabulary (the training vocabulary, or its draft_vocab most frequent labels), for a
        # drafter that takes its argmax over these tokens only (a cheaper LM head).
        np.save(self.out_dir / "draft_vocab.npy", s.draft_ids)
        plot_loss(self.out_dir / "loss.csv", self.out_dir / "loss.png")
        return meta
