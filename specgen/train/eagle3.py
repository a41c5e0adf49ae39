"""An EAGLE-3 layer's training (`specgen train-head --kind eagle3`): the layer of specgen/drafters/eagle3.py
on the self-distillation data every head trains on, its rows holding the main model's features (the inputs
of blocks 2, L // 2 and L - 3) after the hidden state (train/data.py, `features`).

The reference's training-time test: the layer runs on the main model's features at every position, then
TTT_STEPS - 1 times more on its own output features (each draft j + 1 at position i reading token i + 1 + j
and draft j's feature, attending to the first pass's keys and its own earlier drafts' at i, as the engine
chains them), and every draft's token loss counts, draft j weighted TTT_DECAY ** (j - 1). No feature
regression: EAGLE-3 trains on tokens only. The LM head is the main model's over the draft vocabulary (saved as
the layer's `lm_head.weight` with its d2t), frozen. The block starts as the main model's last layer: q/k/v
read the feature half of [input_layernorm(embedding); hidden_norm(feature)] as that layer reads its input
(hidden_norm its input norm), the embedding half at zero; fc passes the deepest feature through at the
residual stream's size (TrainableEagle's input gains).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import paddle

from specgen.layers.norm import rms_norm
from specgen.models.model import Model
from specgen.train.eagle import EVAL_POSITIONS, EagleTrainer, TrainableEagle
from specgen.train.head import block_arrays, residual_rms
from specgen.train.trainer import Trainer, _tensors, batch_picks
from specgen.train.windows import make_batch

TTT_STEPS = 3  # drafts trained per position (the first, and the layer twice more on its own outputs)
TTT_DECAY = 0.8  # weight of draft j: TTT_DECAY ** (j - 1)


class TrainableEagle3(TrainableEagle):
    """The EAGLE-3 layer over padded windows. Its block input is packed [feature h; input_layernorm(emb);
    hidden_norm(h)] (3 hidden): the attention reads the last two, the residual stream starts at h. fc
    [C hidden, hidden] reads the C features divided by their typical RMS (in_rms) times in_gain."""

    def block_input(self, hidden: paddle.Tensor, token_ids: paddle.Tensor) -> paddle.Tensor:
        H = self.cfg.hidden_size
        h = hidden
        if hidden.shape[-1] != H:  # a data row [hidden state; C features]: fold the features
            feats = hidden[..., hidden.shape[-1] - len(self.in_rms):]
            h = paddle.matmul(feats / paddle.to_tensor(self.in_rms) * self.in_gain, self.fc)
        emb = paddle.nn.functional.embedding(token_ids, self.embed)
        return paddle.concat([h, rms_norm(emb, self.enorm, self.eps), rms_norm(h, self.hnorm, self.eps)],
                             axis=-1)

    def attn_input(self, x: paddle.Tensor) -> paddle.Tensor:
        return x[..., self.cfg.hidden_size:]

    def residual(self, x: paddle.Tensor) -> paddle.Tensor:
        return x[..., :self.cfg.hidden_size]

    def feature(self, x: paddle.Tensor) -> paddle.Tensor:
        """The layer's output before its norm is the next draft's feature."""
        return x

    def logits(self, x: paddle.Tensor, rows: paddle.Tensor, lm_head: paddle.Tensor) -> paddle.Tensor:
        flat = paddle.gather(x.reshape([-1, x.shape[-1]]), rows)
        return paddle.matmul(rms_norm(flat, self.final_norm, self.eps), lm_head)


def initial_eagle3_weights(model: Model, scale: float, num_features: int) -> dict[str, np.ndarray]:
    h = model.config.hidden_size
    last = block_arrays(model.weights.blocks[-1])
    out = {k: v for k, v in last.items() if k != "attn_norm"}
    out["w_qkv"] = np.concatenate([np.zeros_like(last["w_qkv"]), last["w_qkv"]])  # [2 hidden, (H + 2 KV) D]
    fc = np.concatenate([np.zeros(((num_features - 1) * h, h), np.float32), np.eye(h, dtype=np.float32)])
    return {"fc": fc, "in_gain": np.full(num_features * h, scale, np.float32),
            "enorm": np.ones(h, np.float32), "hnorm": last["attn_norm"], **out,
            "final_norm": model.weights.final_norm.numpy().astype(np.float32)}


def export_eagle3(head: TrainableEagle3, dtype: str, draft_ids: np.ndarray,
                  lm_full: np.ndarray) -> dict[str, np.ndarray]:
    """The layer in EAGLE-3's layout (HF [out, in]): fc.weight, midlayer.*, norm.weight, lm_head.weight (the
    main model's LM head over draft_ids) and d2t."""
    cfg = head.cfg
    w = {name: p.numpy() for name, p in head.named_parameters()}
    H, KV, D, inter = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    q, k, v = np.split(w["w_qkv"].T, [H * D, (H + KV) * D])
    gate, up = np.split(w["w_gate_up"].T, [inter])
    m = "midlayer."
    out = {"fc.weight": (w["fc"] * (w["in_gain"] / head.in_rms)[:, None]).T,
           m + "input_layernorm.weight": w["enorm"], m + "hidden_norm.weight": w["hnorm"],
           m + "self_attn.q_proj.weight": q, m + "self_attn.k_proj.weight": k,
           m + "self_attn.v_proj.weight": v,
           m + "self_attn.o_proj.weight": w["w_o"].T, m + "post_attention_layernorm.weight": w["mlp_norm"],
           m + "mlp.gate_proj.weight": gate, m + "mlp.up_proj.weight": up,
           m + "mlp.down_proj.weight": w["w_down"].T, "norm.weight": w["final_norm"],
           "lm_head.weight": lm_full.T[draft_ids]}
    out = {n: np.ascontiguousarray(a.astype(dtype)) for n, a in out.items()}
    out["d2t"] = (np.asarray(draft_ids, np.int64) - np.arange(len(draft_ids))).astype(np.int64)
    return out


class Eagle3Trainer(EagleTrainer):
    """EagleTrainer's data, evaluation and loop for an EAGLE-3 layer, with the training-time test."""

    KIND = "eagle3"

    def __init__(self, loaded: Any, out_dir: Path, cfg: Any, data_dir: Path | None = None):
        from specgen.drafters.eagle3 import default_features

        self.features = default_features(loaded.config.num_layers)
        super().__init__(loaded, out_dir, cfg, data_dir)

    def fingerprint(self) -> dict[str, Any]:
        return {**super().fingerprint(), "kind": "eagle3", "ttt": [TTT_STEPS, TTT_DECAY],
                "features": list(self.features)}

    def make_student(self, model: Model) -> dict[str, paddle.Tensor]:
        data = self.set.data
        h, C = model.config.hidden_size, len(self.features)
        if data.hidden.shape[1] != (1 + C) * h:
            from specgen.errors import ConfigError

            raise ConfigError("the training data holds no EAGLE-3 features (rows of the hidden state only): "
                              "generate it for --kind eagle3 (another --data-dir)")
        sample = data.tokens[data.tok_start[0]: data.tok_start[0] + min(256, data.num_rows[0] + 1)]
        rows = np.asarray(data.hidden[:4096, h:], np.float32).reshape(-1, C, h)
        rms = np.median(np.sqrt((rows ** 2).mean(-1)), axis=0)  # [C] each feature's typical RMS
        in_rms = np.repeat(rms.astype(np.float32), h)
        weights = initial_eagle3_weights(model, residual_rms(model, sample), C)
        self.head = TrainableEagle3(model, weights, in_rms)
        self.modules = [self.head]
        return dict(self.head.named_parameters())

    def _loss(self, logits: paddle.Tensor, labels: paddle.Tensor, teacher_rows: np.ndarray) -> paddle.Tensor:
        return Trainer._loss(self, logits, labels, teacher_rows)  # tokens only

    def train_step(self, step: int) -> tuple[float, float, float | None]:
        cfg, s = self.cfg, self.set
        picks = batch_picks(step, len(s.train), cfg.batch_size, cfg.seed)
        b = make_batch(s.data, s.train, picks, cfg.seq_len, s.vocab_index, modules=TTT_STEPS)
        hidden, next_ids, positions = _tensors(b)
        x1, kv = self.head(hidden, next_ids, positions)
        logits = self.head.logits(x1, paddle.to_tensor(b.loss_rows), self.lm_train)
        labels = paddle.to_tensor(b.label_ids)
        loss = self._loss(logits, labels, b.teacher_rows)
        acc = float((paddle.argmax(logits, axis=-1) == labels).astype("float32").mean())
        acc2 = None
        later = self._later(b)[:TTT_STEPS - 1]
        outs = self.head.unroll(x1, kv, [paddle.to_tensor(ids) for ids, _, _, _ in later], positions)
        for j, (x, (_, rows, label_ids, teacher)) in enumerate(zip(outs, later), start=1):
            if not len(rows):
                continue
            logits_j = self.head.logits(x, paddle.to_tensor(rows), self.lm_train)
            labels_j = paddle.to_tensor(label_ids)
            loss = loss + TTT_DECAY ** j * self._loss(logits_j, labels_j, teacher)
            if j == 1:
                acc2 = float((paddle.argmax(logits_j, axis=-1) == labels_j).astype("float32").mean())
        self.update(loss, step)
        return float(loss), acc, acc2

    def save(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        from safetensors.numpy import save_file

        from specgen.drafters.eagle3 import eagle3_config
        from specgen.train.plot import plot_loss

        cfg, s = self.cfg, self.set
        last = next((r for r in reversed(rows) if r.get("eval_acc") is not None), {})
        training = {**dataclasses.asdict(cfg), "kind": "eagle3", "ttt_steps": TTT_STEPS,
                    "ttt_decay": TTT_DECAY,
                    "num_sequences": len(s.data.ids), "num_generated_tokens": s.data.num_generated,
                    "num_train_windows": len(s.train), "num_eval_windows": len(s.held_out),
                    "train_vocab": len(s.vocab_ids), "draft_vocab_size": len(s.draft_ids),
                    "draft_coverage": s.draft_coverage, "train_seconds": rows[-1]["seconds"] if rows else 0.0,
                    **{k: last.get(k) for k in ("eval_loss", *(f"eval_acc{j}" if j > 1 else "eval_acc"
                                                               for j in range(1, EVAL_POSITIONS + 1)))}}
        meta = {**eagle3_config(self.loaded.config, self.features, len(s.draft_ids)),
                "main_model": Path(str(self.loaded.source)).name, "torch_dtype": cfg.save_dtype,
                "specgen_training": training}
        self.out_dir.mkdir(parents=True, exist_ok=True)
        weights = export_eagle3(self.head, cfg.save_dtype, np.asarray(s.draft_ids, np.int64),
                                self.lm_full.numpy())
        save_file(weights, str(self.out_dir / "model.safetensors"))
        (self.out_dir / "config.json").write_text(json.dumps(meta, indent=2))
        plot_loss(self.out_dir / "loss.csv", self.out_dir / "loss.png")
        return meta
