"""Random drafter heads in the public layouts (torch's orientation, as their checkpoints store them),
for tests."""
from __future__ import annotations

import numpy as np


def random_medusa(cfg, num_heads: int, seed: int, lm=None):
    """num_heads one-layer Medusa heads: (blocks, LM heads); lm: every head's LM head [vocab, hidden] (default
    random)."""
    rng = np.random.default_rng(seed)
    h, v = cfg.hidden_size, cfg.vocab_size
    blocks = [[(rng.normal(0, 0.02, (h, h)), rng.normal(0, 0.02, h))] for _ in range(num_heads)]
    lms = [lm if lm is not None else rng.normal(0, 0.5, (v, h)) for _ in range(num_heads)]
    return blocks, lms


def random_hydra(cfg, num_heads: int, seed: int, layers: int = 1, lm=None):
    """Hydra mlp heads: (blocks, LM heads); lm: every head's LM head [vocab, hidden]
    (None: the model's, shared)."""
    rng = np.random.default_rng(seed)
    h = cfg.hidden_size
    blocks = []
    for d in range(num_heads):
        w = (d + 2) * h
        first = {"w": rng.normal(0, 0.05, (h, w)), "b": rng.normal(0, 0.05, h),
                 "rw": np.eye(h, w) + rng.normal(0, 0.05, (h, w)), "rb": rng.normal(0, 0.05, h)}
        blocks.append([first] + [{"w": rng.normal(0, 0.05, (h, h)), "b": rng.normal(0, 0.05, h)}
                                 for _ in range(layers - 1)])
    return blocks, None if lm is None else [lm] * num_heads


def random_eagle(cfg, seed: int, input_norm: bool = False, norm: bool = False, std: float = 0.05) -> dict:
    """An EAGLE layer (HF [out, in]) whose fc passes the feature through, plus noise."""
    rng = np.random.default_rng(seed)
    h, hd, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    shapes = {"self_attn.q_proj.weight": (cfg.num_heads * hd, h),
              "self_attn.k_proj.weight": (cfg.num_kv_heads * hd, h),
              "self_attn.v_proj.weight": (cfg.num_kv_heads * hd, h),
              "self_attn.o_proj.weight": (h, cfg.num_heads * hd),
              "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h),
              "mlp.down_proj.weight": (h, inter)}
    w = {"layers.0." + n: rng.normal(0, std, s) for n, s in shapes.items()}
    w["layers.0.post_attention_layernorm.weight"] = np.ones(h)
    if input_norm:
        w["layers.0.input_layernorm.weight"] = 1 + rng.normal(0, 0.1, h)
    if norm:
        w["norm.weight"] = 1 + rng.normal(0, 0.1, h)
    w["fc.weight"] = np.concatenate([rng.normal(0, std, (h, h)), np.eye(h) + rng.normal(0, std, (h, h))],
                                    axis=1)
    w["fc.bias"] = rng.normal(0, std, h)
    return {k: v.astype(np.float32) for k, v in w.items()}
