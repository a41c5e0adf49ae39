"""The main model's packed variable-length forward in Paddle: Llama / Mistral / Qwen2 / Qwen3 / ERNIE-4.5."""
from __future__ import annotations

import dataclasses
import json
import math
import weakref
from dataclasses import dataclass

import numpy as np
import paddle
import paddle.nn.functional as F

from specgen import kernels
from specgen.engine.kv_cache import KVCache
from specgen.engine.types import ForwardBatch
from specgen.errors import CheckpointError, ConfigError, EngineError
from specgen.models.checkpoint import Checkpoint, QuantRows
from specgen.models.config import ModelConfig


class KeptIndex:
    """int64 index tensors for a kernel call, kept per shape (the lengths of its parts) and overwritten by the
    next call of that shape. Making a tensor right after a forward costs ~90 us here, and a view of one ~10 us more
    (paddle's allocation path runs cold once the weights have streamed through the caches), so each shape's
    tensors are made once over views of one kept numpy buffer (zero copy) and a call only copies its integers
    in. The kernels read the indices during the call and keep no reference. Past max_shapes shapes the kept ones
    are dropped and collected again."""

    def __init__(self, max_shapes: int):
        self.max_shapes = max_shapes
        self._kept: dict[tuple[int, ...], tuple[np.ndarray, list[paddle.Tensor]]] = {}

    def tensors(self, parts: tuple[np.ndarray, ...]) -> list[paddle.Tensor]:
        """One CPU tensor per part, holding its integers."""
        lengths = tuple(len(p) for p in parts)
        kept = self._kept.get(lengths)
        if kept is None:
            if len(self._kept) >= self.max_shapes:
                self._kept.clear()
            buf = np.empty(sum(lengths), np.int64)
            ends = np.cumsum(lengths)
            kept = (buf, [paddle.base.core.eager.Tensor(buf[e - n:e], paddle.CPUPlace(), False, True, "specgen_index",
                                                        True) for n, e in zip(lengths, ends.tolist())])
            self._kept[lengths] = kept
        np.concatenate(parts, out=kept[0])
        return kept[1]


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies [head_dim / 2], with Llama-3 scaling when configured (as transformers does)."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    rs = cfg.rope_scaling
    if rs is None:
        return inv
    low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / rs.factor, inv)
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled)


def _interleaved_to_half(w: np.ndarray, num_heads: int, head_dim: int) -> np.ndarray:
    """Reorder each head's rows from pairs (2i, 2i+1) to halves (i, i + d/2).

    q and k permuted alike leave q.k unchanged, and rotate-half RoPE on the reordered rows equals
    pairwise RoPE on the original ones; so one RoPE implementation serves both layouts.
    """
    order = np.concatenate([np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)])
    shaped = w.reshape(num_heads, head_dim, *w.shape[1:])
    return shaped[:, order].reshape(w.shape)


class TensorReader:
    """Checked access to a checkpoint's numpy tensors, converted to Paddle in the model's dtype."""

    def __init__(self, weights: dict[str, np.ndarray], source: str, cfg: ModelConfig, dtype: str,
                 quantized: dict[str, QuantRows] | None = None):
        self.weights, self.source, self.cfg, self.dtype = weights, source, cfg, dtype
        self.quantized = quantized or {}

    def quant(self, names: list[str], permute=None) -> QuantRows | None:
        """The raw blocks of HF [out, in] weights `names`, each reordered by `permute` (None: kept) and
        concatenated along out (rows of different formats converted to QX first); None unless every one is
        stored block-quantized."""
        rows = [self.quantized.get(n) for n in names]
        if any(q is None for q in rows):
            return None
        kind = rows[0].kind if len({q.kind for q in rows}) == 1 else "QX"
        permute = permute or [None] * len(rows)
        blocks = [q.blocks if kind == q.kind else kernels.qx_rows(q.kind, q.blocks) for q in rows]
        blocks = [b if f is None else f(b) for b, f in zip(blocks, permute)]
        return QuantRows(kind, np.concatenate(blocks))

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        w = self.weights.get(name)
        if w is None:
            raise CheckpointError(f"{self.source}: missing tensor {name!r}")
        if tuple(w.shape) != shape:
            raise CheckpointError(f"{self.source}: tensor {name!r} has shape {list(w.shape)}, expected {list(shape)}")
        return w

    def to_paddle(self, arr: np.ndarray) -> paddle.Tensor:
        return paddle.to_tensor(np.ascontiguousarray(arr, dtype=self.dtype))

    def param(self, name: str, shape: tuple[int, ...]) -> paddle.Tensor:
        return self.to_paddle(self.get(name, shape))

    def layer(self, p: str, skip: frozenset = frozenset()) -> dict:
        """One decoder block under prefix `p` (e.g. "model.layers.3."): fused QKV and gate/up. Projections named
        in `skip` (keys of LINEAR_KEYS) are checked but left None: the model packs them from their GGUF blocks."""
        cfg = self.cfg
        h, hd, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
        q_out, kv_out = cfg.num_heads * hd, cfg.num_kv_heads * hd
        q = self.get(p + "self_attn.q_proj.weight", (q_out, h))
        k = self.get(p + "self_attn.k_proj.weight", (kv_out, h))
        v = self.get(p + "self_attn.v_proj.weight", (kv_out, h))
        qkv_b = None
        if cfg.qkv_bias:
            qkv_b = [self.get(p + f"self_attn.{n}_proj.bias", (o,)) for n, o in (("q", q_out), ("k", kv_out), ("v", kv_out))]
        if cfg.rope_interleaved:
            if "w_qkv" not in skip:
                q, k = _interleaved_to_half(q, cfg.num_heads, hd), _interleaved_to_half(k, cfg.num_kv_heads, hd)
            if qkv_b is not None:
                qkv_b[0] = _interleaved_to_half(qkv_b[0], cfg.num_heads, hd)
                qkv_b[1] = _interleaved_to_half(qkv_b[1], cfg.num_kv_heads, hd)
        mlp = [p + "mlp.gate_proj.", p + "mlp.up_proj."]
        w_o = self.get(p + "self_attn.o_proj.weight", (h, q_out))
        w_down = self.get(p + "mlp.down_proj.weight", (h, inter))
        gate_up = [self.get(m + "weight", (inter, h)) for m in mlp]
        return {
            "attn_norm": self.param(p + "input_layernorm.weight", (h,)),
            "mlp_norm": self.param(p + "post_attention_layernorm.weight", (h,)),
            # [hidden, q_out + 2 kv_out]
            "w_qkv": None if "w_qkv" in skip else self.to_paddle(np.concatenate([q, k, v], axis=0).T),
            "b_qkv": self.to_paddle(np.concatenate(qkv_b)) if qkv_b is not None else None,
            "w_o": None if "w_o" in skip else self.to_paddle(w_o.T),  # [q_out, hidden]
            "b_o": self.param(p + "self_attn.o_proj.bias", (h,)) if cfg.o_bias else None,
            # [hidden, 2 inter]
            "w_gate_up": None if "w_gate_up" in skip else self.to_paddle(np.concatenate(gate_up).T),
            "b_gate_up": self.to_paddle(np.concatenate([self.get(m + "bias", (inter,)) for m in mlp]))
            if cfg.mlp_bias else None,
            "w_down": None if "w_down" in skip else self.to_paddle(w_down.T),  # [inter, hidden]
            "b_down": self.param(p + "mlp.down_proj.bias", (h,)) if cfg.mlp_bias else None,
            "q_norm": self.param(p + "self_attn.q_norm.weight", (hd,)) if cfg.qk_norm else None,
            "k_norm": self.param(p + "self_attn.k_norm.weight", (hd,)) if cfg.qk_norm else None,
        }

    def layer_quant(self, p: str) -> dict[str, QuantRows]:
        """The raw GGUF blocks of the projections of block `p` that have them (keys of LINEAR_KEYS), fused and
        reordered as `layer` fuses and reorders the float32 weights."""
        cfg = self.cfg
        hd = cfg.head_dim
        permute = None
        if cfg.rope_interleaved:
            permute = [lambda w: _interleaved_to_half(w, cfg.num_heads, hd),
                       lambda w: _interleaved_to_half(w, cfg.num_kv_heads, hd), None]
        mlp = [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
        quant = {
            "w_qkv": self.quant([p + f"self_attn.{n}_proj.weight" for n in "qkv"], permute),
            "w_o": self.quant([p + "self_attn.o_proj.weight"]),
            "w_gate_up": self.quant(mlp),
            "w_down": self.quant([p + "mlp.down_proj.weight"]),
        }
        return {key: q for key, q in quant.items() if q is not None}


LINEAR_KEYS = ("w_qkv", "w_o", "w_gate_up", "w_down")  # a block's projections, [in, out] (or kernels.Packed)
# specgen_stack's per-block arguments, in its order
_BLOCK_ARGS = ("attn_norm", "w_qkv", "b_qkv", "w_o", "b_o", "mlp_norm", "w_gate_up", "b_gate_up", "w_down", "b_down",
               "q_norm", "k_norm")


class Weights:
    """The main model's tensors checked, fused (QKV, gate/up) and transposed to Paddle's [in, out]."""

    def __init__(self, ckpt: Checkpoint, dtype: str, blocks_only: bool = False):
        """blocks_only: the model packs every projection that has GGUF blocks from them, so their float32 copies
        are checked but not converted (None), nor read from the mapped file (default_model): of the default
        model's load, 2.45 s before, that and the mapping leave 0.97 s (benchmarks/startup.py)."""
        cfg = ckpt.config
        r = TensorReader(ckpt.weights, ckpt.source, cfg, dtype, ckpt.quantized)
        h = cfg.hidden_size
        self.embed = r.param("model.embed_tokens.weight", (cfg.vocab_size, h))  # [vocab, hidden]
        self.final_norm = r.param("model.norm.weight", (h,))
        head = "model.embed_tokens.weight" if cfg.tie_word_embeddings and "lm_head.weight" not in ckpt.weights \
            else "lm_head.weight"
        self.lm_head_quant = r.quant([head])  # its raw GGUF blocks, or None
        lm_head = r.get(head, (cfg.vocab_size, h))
        skip_head = blocks_only and self.lm_head_quant is not None
        self.lm_head = None if skip_head else r.to_paddle(lm_head.T)  # [hidden, vocab]
        self.layer_quants = [r.layer_quant(f"model.layers.{i}.") for i in range(cfg.num_layers)]
        self.layers = [r.layer(f"model.layers.{i}.", frozenset(q) if blocks_only else frozenset())
                       for i, q in enumerate(self.layer_quants)]


def rms_norm(x: paddle.Tensor, w: paddle.Tensor, eps: float) -> paddle.Tensor:
    """x / sqrt(mean(x^2) + eps) * w over the last axis (HF's LlamaRMSNorm)."""
    var = paddle.mean(x * x, axis=-1, keepdim=True)
    return x * paddle.rsqrt(var + eps) * w


class Model:
    """Holds weights and RoPE tables; `forward` runs one packed step and updates the KV cache."""

    def __init__(self, ckpt: Checkpoint, dtype: str = "float32", matmul: str = "float32"):
        if dtype not in ("float32", "float64"):
            raise CheckpointError(f"dtype {dtype!r} is not supported (supported: float32, float64)")
        self.config = ckpt.config
        self.dtype = dtype
        # Fused CPU operators (specgen/kernels) when they build; None runs the Paddle reference path below.
        self.ops = kernels.ops()
        # Float32 weights packed into panels for specgen_linear (specgen/kernels/linear.cc) where that pays.
        self.packs = kernels.packed_linear_enabled(self.ops, dtype)
        # Projections a GGUF file stores as Q4_0 / Q4_1 / Q8_0 stay in their blocks: specgen_linear rebuilds each
        # float32 weight in registers, with the same bits as the dequantized weight, reading 5-8.5 bits per weight
        # instead of 32. SPECGEN_QUANTIZED_WEIGHTS=0 packs the dequantized float32 weights instead.
        self.keeps_quantized = self.packs and kernels.switch("SPECGEN_QUANTIZED_WEIGHTS")
        self.w = Weights(ckpt, dtype, blocks_only=self.keeps_quantized)
        cfg = self.config
        self.max_len = cfg.max_position_embeddings
        inv = rope_inv_freq(cfg)  # [head_dim / 2]
        # HF computes the angles in float32; matching that keeps fp32 logits within 1e-6 of theirs.
        ang_dtype = np.float32 if dtype == "float32" else np.float64
        ang = np.arange(self.max_len, dtype=ang_dtype)[:, None] * inv.astype(ang_dtype)[None, :]
        self.cos = paddle.to_tensor(np.cos(ang).astype(dtype))  # [max_len, head_dim / 2]
        self.sin = paddle.to_tensor(np.sin(ang).astype(dtype))
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        self.heads: dict = {}  # (MTP head directory, its files' mtimes) -> MtpHead (weights; proposers hold state)
        self.calibrations: dict = {}  # (num_slots, max_draft) -> measured step-cost table, see runner.calibrate
        # matmul "int8": the same blocks regrouped for integer products, the inputs of every product quantized to
        # int8 per block of 32 (kernels/linear.cc, "Integer products"); rows stay independent of each other.
        self.int8_product = matmul == "int8"
        if self.int8_product:
            has_blocks = any(q.kind in kernels.INT8_KINDS for q in [self.w.lm_head_quant] + [
                q for L in self.w.layer_quants for q in L.values()] if q is not None)
            if not (self.keeps_quantized and has_blocks and kernels.has_vnni()):
                raise ConfigError("matmul int8 needs a checkpoint with GGUF Q4_0 / Q4_1 / Q8_0 weights, a float32 "
                                  "model and specgen's CPU kernels on a CPU with AVX-512 VNNI (here: blocks "
                                  f"{'yes' if has_blocks else 'no'}, kernels {'on' if self.keeps_quantized else 'off'}"
                                  f", VNNI {'yes' if kernels.has_vnni() else 'no'})")
        if self.packs:
            for L, quant in zip(self.w.layers, self.w.layer_quants):
                self.pack_layer(L, quant)
            self.w.lm_head = self.pack(self.w.lm_head, self.w.lm_head_quant)
        # Greedy steps of a Q8_0 / Q4_0 LM head skip its logits: specgen_forward screens every column with integer
        # products and a bound on their error, and takes the float32 product of the few columns the bound cannot
        # rule out, so the greedy tokens are the float32 logits' argmax (kernels/linear.cc, "Greedy tokens without
        # the logits"). Needs AVX-512 VNNI; SPECGEN_SCREENED_ARGMAX=0 computes the logits anyway.
        q = self.w.lm_head_quant
        self.screen = None
        if (self.keeps_quantized and not self.int8_product and q is not None and q.kind in kernels.SCREENED_KINDS
                and kernels.has_vnni() and kernels.switch("SPECGEN_SCREENED_ARGMAX")):
            self.screen = kernels.pack_screen(q.kind, q.blocks)
        # With packed weights a decoder block is one fused op (specgen_stack: the same kernels in the same order,
        # bit-identical to the op-by-op path), and all the blocks of a forward one call of it;
        # SPECGEN_FUSED_STACK=0 calls it per block, SPECGEN_FUSED_LAYER=0 keeps the op-by-op path.
        self.fused_layer = self.packs and kernels.switch("SPECGEN_FUSED_LAYER")
        self.fused_stack = kernels.switch("SPECGEN_FUSED_STACK")
        # ... and the whole forward one op (specgen_forward: embedding, blocks, final norm, LM head; the same bits):
        # the Python between separate ops costs ~0.1-0.2 ms a call right after the blocks have streamed the
        # weights through the caches. SPECGEN_FUSED_FORWARD=0 keeps them separate.
        self.fused_forward = kernels.switch("SPECGEN_FUSED_FORWARD")
        # ... with the weights and caches handed over once, by handle (specgen_forward_bound: the same function,
        # without ~0.8 ms per call of passing ~480 tensors); SPECGEN_BOUND_FORWARD=0 passes them every call.
        self.bound_forward = kernels.switch("SPECGEN_BOUND_FORWARD")
        self._bound_weights: int | None = None  # the weights' handle in the kernels, once bound
        self._columns = None  # the main blocks' specgen_stack arguments, gathered on first use
        self._indices = KeptIndex(self.INDEX_REUSE_SIZES)  # the bound forward's index tensors (_index_tensor)
        self._ones = paddle.ones([cfg.head_dim], dtype=dtype)  # stands in for absent q/k norm weights
        self._none = paddle.zeros([0], dtype=dtype)  # stands in for absent biases
        self._no_screen = paddle.zeros([0], dtype="float32")  # specgen_forward without a screen: the logits

    def cost_key(self) -> str:
        """What a step's cost depends on in this model (engine/cost_cache): its shape, dtype, weights' format
        (packed float32, GGUF block kinds, int8 products) and which fused operators run."""
        kinds = sorted({getattr(w, "kind", "dense") for L in self.w.layers for w in (L[k] for k in LINEAR_KEYS)}
                       | {getattr(self.w.lm_head, "kind", "dense")})
        flags = [self.dtype, self.ops is not None, self.packs, self.keeps_quantized, self.int8_product,
                 self.fused_layer, self.fused_stack, self.fused_forward, self.screen is not None, kinds,
                 self.bound_forward]
        return json.dumps([dataclasses.asdict(self.config), flags], sort_keys=True, default=str)

    def pack(self, w, quant: QuantRows | None = None, int8_product: bool | None = None):
        """w [k, n] packed for `matmul` when this model packs its weights (from `quant`, its raw GGUF blocks,
        when given and this model keeps them), else w as it is. Blocks get integer products when int8_product
        (default: this model's `matmul`)."""
        if not self.packs or isinstance(w, kernels.Packed):
            return w
        if quant is not None and self.keeps_quantized:
            int8 = self.int8_product if int8_product is None else int8_product
            return kernels.pack_quantized(quant.kind, quant.blocks, int8)
        return kernels.pack_linear(w)

    def pack_layer(self, L: dict, quant: dict[str, QuantRows] | None = None,
                   int8_product: bool | None = None) -> dict:
        """Packs a decoder block's projection weights in place when this model packs (see `matmul`), from their
        raw GGUF blocks where `quant` (TensorReader.layer_quant) has them."""
        for key in LINEAR_KEYS:
            L[key] = self.pack(L[key], (quant or {}).get(key), int8_product)
        return L

    def matmul(self, x: paddle.Tensor, w) -> paddle.Tensor:
        """x [rows, k] @ w [k, n]; a packed weight runs specgen_linear, whose rows do not depend on each other."""
        if isinstance(w, kernels.Packed):
            return self.ops.specgen_linear(x, w.panels, w.n)
        return paddle.matmul(x, w)

    def new_cache(self, num_slots: int, max_capacity: int, kv_dtype: str = "auto") -> KVCache:
        """A KV cache in the model's dtype (auto) or float16 (float32 models on the fused kernels only)."""
        cfg = self.config
        dtype = self.dtype if kv_dtype == "auto" else kv_dtype
        if dtype != self.dtype and (self.ops is None or self.dtype != "float32" or dtype != "float16"):
            raise ConfigError(f"a {dtype} KV cache needs a float32 model and specgen's CPU kernels "
                              f"(model: {self.dtype}, kernels: {'on' if self.ops is not None else 'off'})")
        return KVCache(cfg.num_layers, num_slots, cfg.num_kv_heads, cfg.head_dim, dtype, max_capacity,
                       zeroed=self.ops is None)

    def _rope(self, x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor) -> paddle.Tensor:
        # x [num_tokens, heads, head_dim]; cos/sin [num_tokens, 1, head_dim / 2]
        x1, x2 = paddle.split(x, 2, axis=-1)
        return paddle.concat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    @staticmethod
    def _reserve(batch: ForwardBatch, cache: KVCache) -> None:
        """Room in `cache` for the positions `batch` writes (own rows past a shared prefix)."""
        plen = batch.token_prefix_len
        own_max = batch.max_position if plen is None else int((batch.positions - plen).max()) + 1
        cache.reserve(batch.max_position, own_max)

    def context(self, batch: ForwardBatch, cache: KVCache) -> "StepContext":
        """Device-side indices of one packed forward, shared by every layer (and by the MTP block)."""
        plen = batch.token_prefix_len
        self._reserve(batch, cache)
        pos = paddle.to_tensor(batch.positions)  # [num_tokens]
        cfg = self.config
        if self.ops is not None:
            pre = cache.prefix
            return StepContext(num_tokens=len(batch.token_ids), cos=None, sin=None, cache_rows=None, groups=[],
                               single=True, positions=pos, token_slots=paddle.to_tensor(batch.token_slots),
                               capacity=cache.capacity,
                               prefix_len=paddle.to_tensor(plen if plen is not None
                                                           else np.zeros(len(batch.token_ids), np.int64)),
                               prefix_k=pre.k if pre is not None else None, prefix_v=pre.v if pre is not None else None,
                               prefix_capacity=pre.capacity if pre is not None else 0)
        if plen is not None:
            raise EngineError("a shared prefix needs the fused CPU kernels (specgen/kernels)")
        groups = [_GroupIndex(g, cache.capacity, cache.num_slots, cfg.num_heads, cfg.num_kv_heads, self.dtype)
                  for g in batch.groups]
        kv = np.arange(cfg.num_kv_heads)
        rows = ((batch.token_slots[:, None] * cfg.num_kv_heads + kv[None, :]) * cache.capacity
                + batch.positions[:, None])  # [num_tokens, num_kv_heads]
        return StepContext(
            num_tokens=len(batch.token_ids),
            cos=paddle.gather(self.cos, pos).unsqueeze(1),  # [num_tokens, 1, head_dim / 2]
            sin=paddle.gather(self.sin, pos).unsqueeze(1),
            cache_rows=paddle.to_tensor(rows.reshape(-1)),  # [num_tokens * num_kv_heads]
            groups=groups,
            single=len(groups) == 1 and np.array_equal(batch.groups[0].token_rows, np.arange(len(batch.token_ids))),
            positions=pos, token_slots=None, capacity=cache.capacity,
        )

    def layer(self, x: paddle.Tensor, L: dict, ctx: "StepContext", k_cache: paddle.Tensor,
              v_cache: paddle.Tensor, index: int = 0) -> paddle.Tensor:
        """One pre-norm decoder block (layer `index` of its cache) on packed tokens x [num_tokens, hidden];
        writes this layer's K/V."""
        if self.ops is not None:
            return self._fused_layer(x, L, ctx, k_cache, v_cache, index)
        cfg = self.config
        n, H, KV, D = ctx.num_tokens, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h = rms_norm(x, L["attn_norm"], cfg.rms_norm_eps)
        qkv = self.matmul(h, L["w_qkv"])  # [num_tokens, (H + 2 KV) * D]
        if L["b_qkv"] is not None:
            qkv = qkv + L["b_qkv"]
        q, k, v = paddle.split(qkv, [H * D, KV * D, KV * D], axis=-1)
        q = q.reshape([n, H, D])
        k = k.reshape([n, KV, D])
        if L["q_norm"] is not None:
            q = rms_norm(q, L["q_norm"], cfg.rms_norm_eps)
            k = rms_norm(k, L["k_norm"], cfg.rms_norm_eps)
        q = self._rope(q, ctx.cos, ctx.sin)
        k = self._rope(k, ctx.cos, ctx.sin)
        paddle.scatter_(k_cache, ctx.cache_rows, k.reshape([n * KV, D]), overwrite=True)
        paddle.scatter_(v_cache, ctx.cache_rows, v.reshape([n * KV, D]), overwrite=True)
        q = q.reshape([n * H, D]) * self.scale
        parts = [g.attend(q, k_cache, v_cache, KV, D) for g in ctx.groups]
        if ctx.single:
            attn = parts[0]
        else:
            attn = paddle.zeros([n, H * D], dtype=self.dtype)
            for g, part in zip(ctx.groups, parts):
                attn = paddle.scatter(attn, g.token_rows, part, overwrite=True)
        o = self.matmul(attn, L["w_o"])  # [num_tokens, hidden]
        if L["b_o"] is not None:
            o = o + L["b_o"]
        x = x + o
        h = rms_norm(x, L["mlp_norm"], cfg.rms_norm_eps)
        gu = self.matmul(h, L["w_gate_up"])  # [num_tokens, 2 * intermediate]
        if L["b_gate_up"] is not None:
            gu = gu + L["b_gate_up"]
        gate, up = paddle.split(gu, 2, axis=-1)
        m = self.matmul(F.silu(gate) * up, L["w_down"])  # [num_tokens, hidden]
        if L["b_down"] is not None:
            m = m + L["b_down"]
        return x + m

    def _fused_layer(self, x: paddle.Tensor, L: dict, ctx: "StepContext", k_cache: paddle.Tensor,
                     v_cache: paddle.Tensor, index: int) -> paddle.Tensor:
        """`layer` with the fused operators: with packed weights the whole block is one op (specgen_stack over one
        block), else norms, RoPE + cache write + attention, and SiLU-gate are one op each around the projections."""
        if self.fused_layer:  # every block of a packing model went through pack_layer: its projections are Packed
            return self._blocks(x, self.block_columns([L]), ctx, [k_cache], [v_cache], index)
        cfg, ops = self.config, self.ops
        eps = cfg.rms_norm_eps
        qk_norm = L["q_norm"] is not None
        pk = ctx.prefix_k[index] if ctx.prefix_k is not None else self._ones
        pv = ctx.prefix_v[index] if ctx.prefix_v is not None else self._ones
        h = ops.specgen_rms_norm(x, L["attn_norm"], eps)
        qkv = self.matmul(h, L["w_qkv"])  # [num_tokens, (H + 2 KV) * D]
        if L["b_qkv"] is not None:
            qkv = qkv + L["b_qkv"]
        attn = ops.specgen_attention(qkv, self.cos, self.sin, ctx.positions, ctx.token_slots, k_cache, v_cache,
                                     L["q_norm"] if qk_norm else self._ones, L["k_norm"] if qk_norm else self._ones,
                                     ctx.prefix_len, pk, pv, cfg.num_heads, cfg.num_kv_heads, ctx.capacity, qk_norm,
                                     eps, ctx.prefix_capacity)
        attn = attn[0] if isinstance(attn, (list, tuple)) else attn  # [num_tokens, H * D]
        o = self.matmul(attn, L["w_o"])  # [num_tokens, hidden]
        if L["b_o"] is not None:
            o = o + L["b_o"]
        x, h = ops.specgen_add_rms_norm(x, o, L["mlp_norm"], eps)
        gu = self.matmul(h, L["w_gate_up"])  # [num_tokens, 2 * intermediate]
        if L["b_gate_up"] is not None:
            gu = gu + L["b_gate_up"]
        m = self.matmul(ops.specgen_silu_mul(gu), L["w_down"])  # [num_tokens, hidden]
        if L["b_down"] is not None:
            m = m + L["b_down"]
        return x + m

    def block_columns(self, layers: list[dict]) -> list[list[paddle.Tensor]]:
        """specgen_stack's per-block arguments for `layers`, one list per argument (absent biases and q/k norms
        replaced by their stand-ins)."""
        def column(key):
            stand_in = self._ones if key in ("q_norm", "k_norm") else self._none
            return [L[key].panels if key in LINEAR_KEYS else L[key] if L[key] is not None else stand_in for L in layers]

        return [column(key) for key in _BLOCK_ARGS]

    def _blocks(self, x: paddle.Tensor, columns: list, ctx: "StepContext", k_caches: list, v_caches: list,
                first: int = 0) -> paddle.Tensor:
        """Blocks first, first + 1, ... (their `block_columns` and caches) in one specgen_stack call: x
        [num_tokens, hidden] -> the last block's output; K/V written to each block's cache."""
        cfg = self.config
        pk, pv = self._prefix_kv(ctx, first, len(k_caches))
        *weights, q_norm, k_norm = columns
        out = self.ops.specgen_stack(x, *weights, self.cos, self.sin, ctx.positions, ctx.token_slots, k_caches,
                                     v_caches, q_norm, k_norm, ctx.prefix_len, pk, pv, cfg.num_heads,
                                     cfg.num_kv_heads, ctx.capacity, cfg.qk_norm, cfg.rms_norm_eps,
                                     ctx.prefix_capacity)
        return out[0] if isinstance(out, (list, tuple)) else out  # [num_tokens, hidden]

    def norm(self, x: paddle.Tensor, w: paddle.Tensor) -> paddle.Tensor:
        """RMSNorm over the last axis, fused when the kernels are built."""
        if self.ops is not None:
            return self.ops.specgen_rms_norm(x, w, self.config.rms_norm_eps)
        return rms_norm(x, w, self.config.rms_norm_eps)

    def forward(self, batch: ForwardBatch, cache: KVCache) -> tuple[paddle.Tensor, paddle.Tensor]:
        """Returns (logits [num_logits, vocab], final normed hidden [num_tokens, hidden]) and writes K/V."""
        return self._forward(batch, cache)[:2]

    def forward_greedy(self, batch: ForwardBatch, cache: KVCache, logits: bool = True
                       ) -> tuple[paddle.Tensor | None, paddle.Tensor, np.ndarray]:
        """`forward`, plus each logit row's argmax ([num_logits] int64, lowest id on a tie): the step's greedy
        tokens, computed inside specgen_forward where it runs (no second operator after the forward). With
        `logits` False the caller needs only the greedy tokens: where this model screens its LM head
        (self.screen) the logits are not computed and come back as None; the tokens are the same."""
        out, hidden, greedy = self._forward(batch, cache, screened=not logits)
        return out, hidden, (kernels.argmax(out) if greedy is None else greedy).numpy()

    def _forward(self, batch: ForwardBatch, cache: KVCache, screened: bool = False):
        """(logits, hidden, greedy ids or None where the path does not compute them); with `screened` and a
        screen, (None, hidden, greedy)."""
        stacked = self.ops is not None and self.fused_layer and self.fused_stack
        if stacked and self._columns is None:  # every block's arguments, gathered once
            self._columns = self.block_columns(self.w.layers)
        if stacked and self.fused_forward and self.bound_forward:
            return self._forward_bound(batch, cache, screened and self.screen is not None)
        ctx = self.context(batch, cache)
        if stacked and self.fused_forward:
            return self._forward_fused(batch, ctx, cache, screened and self.screen is not None)
        x = F.embedding(paddle.to_tensor(batch.token_ids), self.w.embed)  # [num_tokens, hidden]
        if stacked:
            x = self._blocks(x, self._columns, ctx, cache.k, cache.v)
        else:
            for li, L in enumerate(self.w.layers):
                x = self.layer(x, L, ctx, cache.k[li], cache.v[li], li)
        hidden = self.norm(x, self.w.final_norm)  # [num_tokens, hidden]
        logits = self.matmul(paddle.gather(hidden, paddle.to_tensor(batch.logit_rows)), self.w.lm_head)
        return logits, hidden, None  # logits [num_logits, vocab]

    def _prefix_kv(self, ctx: "StepContext", first: int, count: int) -> tuple[list, list]:
        """The shared prefix's K and V of blocks first .. first + count - 1 (stand-ins without a prefix)."""
        if ctx.prefix_k is None:
            return [self._ones] * count, [self._ones] * count
        return ctx.prefix_k[first:first + count], ctx.prefix_v[first:first + count]

    def _forward_bound(self, batch: ForwardBatch, cache: KVCache, screened: bool = False):
        """`_forward_fused` through specgen_forward_bound: the weights and the cache's tensors are handed to the
        kernels once (specgen_bind_weights / specgen_bind_caches, again when the cache grows), each step only its
        token indices, as one tensor. The same function computes both, so the same bits."""
        cfg = self.config
        self._reserve(batch, cache)
        n = len(batch.token_ids)
        plen = batch.token_prefix_len
        index = np.concatenate([batch.token_ids, batch.positions, batch.token_slots,
                                plen if plen is not None else np.zeros(n, np.int64), batch.logit_rows])
        pre = cache.prefix
        logits, hidden, greedy = self.ops.specgen_forward_bound(
            self._index_tensor(index), *self._screen_args(screened), n,
            self._weights_handle(), self._caches_handle(cache), cfg.num_heads, cfg.num_kv_heads, cache.capacity,
            cfg.qk_norm, cfg.rms_norm_eps, pre.capacity if pre is not None else 0, self.w.lm_head.n)
        # logits [num_logits, vocab] (screened: [0, vocab], returned as None), hidden [num_tokens, hidden]
        return None if screened else logits, hidden, greedy

    INDEX_REUSE_MAX = 1 << 14  # the longest index kept for reuse (decode and verify steps; prefills make their own)
    INDEX_REUSE_SIZES = 512  # index lengths kept at most (then the kept ones are dropped and collected again)

    def _index_tensor(self, index: np.ndarray) -> paddle.Tensor:
        """`index` (int64 [m]) as a CPU tensor for specgen_forward_bound: kept per length (KeptIndex), or, past
        INDEX_REUSE_MAX (prefills), a tensor of its own."""
        if len(index) > self.INDEX_REUSE_MAX:
            return paddle.to_tensor(index.astype(np.int64, copy=False))
        return self._indices.tensors((index,))[0]

    def _screen_args(self, screened: bool) -> tuple:
        """specgen_forward's LmScreen and LmBound: the screen's (greedy tokens only), or empty (the logits)."""
        return (self.screen.panels.panels, self.screen.bound) if screened else (self._no_screen,) * 2

    def _weights_handle(self) -> int:
        """This model's weights in the kernels, for specgen_forward_bound: bound on first use, dropped with the
        model."""
        if self._bound_weights is None:
            *weights, q_norm, k_norm = self._columns
            h = self.ops.specgen_bind_weights(self.w.embed, *weights, self.cos, self.sin, q_norm, k_norm,
                                              self.w.final_norm, self.w.lm_head.panels)
            self._bound_weights = int(h.numpy()[0])
            weakref.finalize(self, self.ops.specgen_unbind, h).atexit = False
        return self._bound_weights

    def _caches_handle(self, cache: KVCache) -> int:
        """`cache`'s tensors (and its shared prefix's) in the kernels: bound again whenever they were replaced
        (the cache grew, a prefix was set); the binding is dropped with the cache or when it is replaced."""
        pre = cache.prefix
        key = (cache.version, pre, pre.version if pre is not None else 0)  # pre compares by identity
        if cache.binding is not None and cache.binding[0] == key:
            return cache.binding[1]
        cache.unbind()  # the tensors that were replaced, if any
        L = len(cache.k)
        pk, pv = (pre.k, pre.v) if pre is not None else ([self._ones] * L, [self._ones] * L)
        h = self.ops.specgen_bind_caches(cache.k, cache.v, pk, pv)
        release = weakref.finalize(cache, self.ops.specgen_unbind, h)
        release.atexit = False
        cache.binding = (key, int(h.numpy()[0]), release)
        return cache.binding[1]

    def _forward_fused(self, batch: ForwardBatch, ctx: "StepContext", cache: KVCache, screened: bool = False):
        """`forward` as one specgen_forward call: embedding, every block, final norm and LM head (same bits);
        `screened`: the greedy tokens through self.screen, without the logits (None)."""
        cfg = self.config
        pk, pv = self._prefix_kv(ctx, 0, len(cache.k))
        *weights, q_norm, k_norm = self._columns
        screen, bound = self._screen_args(screened)
        logits, hidden, greedy, *_ = self.ops.specgen_forward(
            paddle.to_tensor(batch.token_ids), self.w.embed, *weights, self.cos, self.sin, ctx.positions,
            ctx.token_slots, cache.k, cache.v, q_norm, k_norm, ctx.prefix_len, pk, pv, self.w.final_norm,
            paddle.to_tensor(batch.logit_rows), self.w.lm_head.panels, screen, bound, cfg.num_heads,
            cfg.num_kv_heads, ctx.capacity, cfg.qk_norm, cfg.rms_norm_eps, ctx.prefix_capacity, self.w.lm_head.n)
        # logits [num_logits, vocab] (screened: None), hidden [num_tokens, hidden], greedy [num_logits]
        return None if screened else logits, hidden, greedy


@dataclass
class StepContext:
    """Per-forward device indices: RoPE rows, cache rows, attention groups."""

    num_tokens: int
    cos: paddle.Tensor | None  # [num_tokens, 1, head_dim / 2] (reference path)
    sin: paddle.Tensor | None
    cache_rows: paddle.Tensor | None  # [num_tokens * num_kv_heads] cache row of each token's K/V per head
    groups: list
    single: bool  # one group holding every token in order: no scatter needed
    positions: paddle.Tensor  # [num_tokens] int64
    token_slots: paddle.Tensor | None  # [num_tokens] int64 cache slot of each token (fused path)
    capacity: int  # cache positions per (slot, kv head)
    prefix_len: paddle.Tensor | None = None  # [num_tokens] int64 positions read from the shared prefix (fused)
    prefix_k: list | None = None  # per layer [num_kv_heads * prefix_capacity, head_dim] shared prefix K
    prefix_v: list | None = None
    prefix_capacity: int = 0


class _GroupIndex:
    """Device-side gather indices of one attention group, built once per forward and used by every layer.

    Every reordering is one gather (no transposes): queries into [num_seqs, kv_heads, group * max_q, D],
    keys/values from the cache into [num_seqs, kv_heads, max_kv, D], and the output back to packed tokens.
    """

    def __init__(self, g, capacity: int, num_slots: int, num_heads: int, num_kv_heads: int, dtype: str):
        S, Q = g.pad_token_index.shape
        KV, G = num_kv_heads, num_heads // num_kv_heads
        # When the group is every slot in cache order, attend over the cache tensor itself (a free view):
        # reading a few stale positions past max_kv costs less than gathering the keys into a copy.
        self.direct = S == num_slots and bool((g.seq_slots == np.arange(num_slots)).all()) \
            and capacity <= 2 * g.max_kv
        L = capacity if self.direct else g.max_kv
        self.shape = (S, KV, G, Q, L)
        valid = np.zeros(S * Q, bool)
        valid[g.token_pad_index] = True
        tok = np.where(valid.reshape(S, Q), g.pad_token_index, 0)  # padding queries read token 0; dropped later
        head = (np.arange(KV)[:, None] * G + np.arange(G)[None, :])  # [KV, G]
        q_rows = tok[:, None, None, :] * num_heads + head[None, :, :, None]  # [S, KV, G, Q]
        self.q_rows = paddle.to_tensor(q_rows.reshape(-1))
        self.kv_rows = None
        if not self.direct:
            kv_rows = (g.seq_slots[:, None, None] * KV + np.arange(KV)[None, :, None]) * capacity + np.arange(L)
            self.kv_rows = paddle.to_tensor(kv_rows.reshape(-1))  # [S * KV * L]
        allowed = np.arange(L)[None, None, :] <= g.pad_positions[:, :, None]  # [S, Q, L]
        neg = np.finfo(np.float32).min if dtype == "float32" else np.finfo(np.float64).min
        bias = np.where(allowed, 0.0, neg).astype(dtype)[:, None, None]  # [S, 1, 1, Q, L]
        if S * num_heads * Q * L <= (1 << 24):
            # Paddle's broadcasting add is ~30x slower than a same-shape add on CPU: materialise once per forward.
            bias = np.broadcast_to(bias, (S, KV, G, Q, L))
        self.bias = paddle.to_tensor(np.ascontiguousarray(bias))
        # output rows: for each of the group's tokens (seq s, offset q) and head h = kv * G + g
        s_of, q_of = np.divmod(g.token_pad_index, Q)  # [num_tokens_g]
        # head h = kv * G + g sits at row ((s * KV + kv) * G + g) * Q + q = (s * H + h) * Q + q of the output
        out_rows = (s_of[:, None] * num_heads + np.arange(num_heads)[None, :]) * Q + q_of[:, None]  # [num_tokens_g, H]
        self.out_rows = paddle.to_tensor(out_rows.reshape(-1))
        self.num_tokens = len(g.token_rows)
        self.token_rows = paddle.to_tensor(g.token_rows)  # [num_tokens_g]

    def attend(self, q, k_cache, v_cache, KV: int, D: int) -> paddle.Tensor:
        """Causal attention of the group's queries over their slots' cached keys; [num_tokens_g, H * D].

        q [num_tokens * H, D] already scaled by 1 / sqrt(D).
        """
        S, _, G, Q, L = self.shape
        qp = paddle.gather(q, self.q_rows).reshape([S, KV, G * Q, D])
        if self.direct:
            kp, vp = k_cache.reshape([S, KV, L, D]), v_cache.reshape([S, KV, L, D])
        else:
            kp = paddle.gather(k_cache, self.kv_rows).reshape([S, KV, L, D])
            vp = paddle.gather(v_cache, self.kv_rows).reshape([S, KV, L, D])
        scores = paddle.matmul(qp, kp, transpose_y=True).reshape([S, KV, G, Q, L]) + self.bias
        probs = F.softmax(scores, axis=-1).reshape([S, KV, G * Q, L])
        out = paddle.matmul(probs, vp).reshape([S * KV * G * Q, D])
        return paddle.gather(out, self.out_rows).reshape([self.num_tokens, KV * G * D])
