"""AdamW with global-norm clipping and the warmup + cosine schedule; its whole state is named arrays.

Written out (a dozen tensor ops per parameter) rather than Paddle's optimizer so that a checkpoint is plain
arrays keyed by the head's own parameter names: a resumed run continues bit for bit, in any process.
"""
from __future__ import annotations

import math

import numpy as np
import paddle

from specgen.train.config import TrainConfig


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of step `step` (0-based): linear warmup, then cosine down to lr * min_lr_ratio."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


class AdamW:
    """Decoupled weight decay (Loshchilov & Hutter) on matrices only; norms' weights are not decayed."""

    def __init__(self, params: dict[str, paddle.Tensor], cfg: TrainConfig, beta1: float = 0.9,
                 beta2: float = 0.95, eps: float = 1e-8):
        self.params, self.cfg = params, cfg
        self.beta1, self.beta2, self.eps = beta1, beta2, eps
        self.m = {n: paddle.zeros_like(p) for n, p in params.items()}
        self.v = {n: paddle.zeros_like(p) for n, p in params.items()}
        self.t = 0

    def step(self, lr: float) -> float:
        """One update from the parameters' .grad; returns the gradient norm before clipping."""
        grads = {n: p.grad for n, p in self.params.items() if p.grad is not None}
        norm = float(paddle.sqrt(paddle.add_n([paddle.sum(g * g) for g in grads.values()])))
        clip = min(1.0, self.cfg.grad_clip / (norm + 1e-6))
        self.t += 1
        c1, c2 = 1 - self.beta1 ** self.t, 1 - self.beta2 ** self.t
        with paddle.no_grad():
            for n, g in grads.items():
                p = self.params[n]
                g = g * clip
                self.m[n] = self.beta1 * self.m[n] + (1 - self.beta1) * g
                self.v[n] = self.beta2 * self.v[n] + (1 - self.beta2) * g * g
                update = (self.m[n] / c1) / (paddle.sqrt(self.v[n] / c2) + self.eps)
                if p.ndim >= 2:
                    update = update + self.cfg.weight_decay * p
                paddle.assign(p - lr * update, p)
        return norm

    def state(self) -> dict[str, np.ndarray]:
        out = {f"m.{n}": t.numpy() for n, t in self.m.items()}
        out.update({f"v.{n}": t.numpy() for n, t in self.v.items()})
        out["t"] = np.array(self.t, np.int64)
        return out

    def load(self, state: dict[str, np.ndarray]) -> None:
        self.m = {n: paddle.to_tensor(state[f"m.{n}"]) for n in self.params}
        self.v = {n: paddle.to_tensor(state[f"v.{n}"]) for n in self.params}
        self.t = int(state["t"])
