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


def learned_spec(method: str, model, path):
    """A random learned drafter written to `path` for `model` (a loaded float64 tiny model), and the
    SpecConfig that drafts with it, every draft verified: an MTP head's chain (k 2), EAGLE's dynamic trees
    (top-2, 6 nodes, no copies) or Medusa's static trees."""
    from specgen.config import EagleConfig, MedusaConfig, MtpConfig, SpecConfig
    from specgen.drafters.eagle import save_eagle
    from specgen.drafters.medusa import save_medusa
    from specgen.drafters.mtp import random_mtp_weights, save_mtp

    cfg, rng = model.config, np.random.default_rng(1)
    if method == "mtp":
        save_mtp(path, random_mtp_weights(cfg, seed=0, std=0.02))
        return SpecConfig(method="mtp", num_speculative_tokens=2, adaptive=False,
                          mtp=MtpConfig(model=str(path)))
    if method == "eagle":
        save_eagle(path, random_eagle(cfg, 3, norm=True), cfg)
        return SpecConfig(method="eagle", draft_model=str(path), adaptive=False, num_speculative_tokens=3,
                          eagle=EagleConfig(topk=2, nodes=6, copy=0))
    lm = model.model.weights.lm_head.dense().numpy().T
    layers = [[(rng.normal(0, 0.02, (cfg.hidden_size,) * 2), rng.normal(0, 0.02, cfg.hidden_size))]
              for _ in range(3)]
    save_medusa(path, layers, [lm] * 3)
    return SpecConfig(method="medusa", draft_model=str(path), adaptive=False,
                      medusa=MedusaConfig(topk=2, tree_choices=("0,0,0", "1", "0,1", "1,0")))


def random_eagle3(cfg, seed: int, lm: np.ndarray, draft_vocab: np.ndarray, std: float = 0.05) -> dict:
    """An EAGLE-3 layer (its public names, HF [out, in]) reading three depths, whose fc passes the last
    feature through plus noise, with an LM head of `lm`'s rows [vocab, hidden] for the tokens `draft_vocab`
    (sorted token ids; d2t maps them back)."""
    rng = np.random.default_rng(seed)
    h, hd, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    shapes = {"self_attn.q_proj.weight": (cfg.num_heads * hd, 2 * h),
              "self_attn.k_proj.weight": (cfg.num_kv_heads * hd, 2 * h),
              "self_attn.v_proj.weight": (cfg.num_kv_heads * hd, 2 * h),
              "self_attn.o_proj.weight": (h, cfg.num_heads * hd),
              "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h),
              "mlp.down_proj.weight": (h, inter)}
    w = {"midlayer." + n: rng.normal(0, std, s) for n, s in shapes.items()}
    for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        w[f"midlayer.{n}.weight"] = 1 + rng.normal(0, 0.1, h)
    w["norm.weight"] = 1 + rng.normal(0, 0.1, h)
    w["fc.weight"] = np.concatenate([rng.normal(0, std, (h, 2 * h)), np.eye(h) + rng.normal(0, std, (h, h))],
                                    axis=1)
    w["lm_head.weight"] = lm[draft_vocab]
    w = {k: v.astype(np.float32) for k, v in w.items()}
    w["d2t"] = (np.asarray(draft_vocab) - np.arange(len(draft_vocab))).astype(np.int64)
    return w
