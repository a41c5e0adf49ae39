"""The fused CPU backend: specgen's kernels run the whole forward as one operator (specgen_forward_bound:
embedding, every block, final norm, LM head and the greedy tokens), over weights packed at load and handed to
the kernels once, by handle, as are the KV cache's tensors; a step passes only its token indices. An MTP
head's pass for a step is one operator too (specgen_mtp_draft). Rows are computed independently, in a fixed
order, so results do not depend on what else is in the batch: the same bits at any batch size, with
speculation on or off.

Weights are packed for the kernels' products (specgen/kernels/packing.py): projections a GGUF file stores as
blocks stay in them (rebuilt exactly in registers: the dequantized weights' bits, a fraction of the bytes
read); float32 weights that are all exactly bfloat16 / float16 as 16-bit panels; with matmul int8 the blocks'
integer products (inputs quantized per block of 32, AVX-512 VNNI). A greedy step over a Q8_0 / Q4_0 / Q6_K LM
head skips the logits: integer products screen every column with an error bound, float32 products settle the
few left.
"""
from __future__ import annotations

import weakref
from types import ModuleType
from typing import Any

import numpy as np
import paddle

from specgen import kernels
from specgen.backends.base import ForwardOutput, ModelView, MtpPass, RowSampling
from specgen.backends.reference import reserve
from specgen.config import EngineConfig
from specgen.errors import ConfigError
from specgen.kernels import args
from specgen.kernels.packing import (
    INT8_KINDS,
    SCREENED_KINDS,
    pack_linear,
    pack_parts,
    pack_quantized,
    pack_screen,
)
from specgen.layers.block import DecoderBlock
from specgen.layers.linear import Linear
from specgen.models.checkpoint import QuantRows
from specgen.runtime.batch import ForwardBatch
from specgen.runtime.kv_cache import KVCache


class KeptIndex:
    """CPU tensors for a kernel call's small inputs (int64 indices, or the sampler's float64 params), kept per
    shape (the lengths of its parts) and overwritten by the next call of that shape. Making a tensor right
    after a forward costs ~90 us here, and a view of one ~10 us more (paddle's allocation path runs cold once
    the weights have streamed through the caches), so each shape's tensors are made once over views of one
    kept numpy buffer (zero copy) and a call only copies its values in. The kernels read them during the call
    and keep no reference. Past max_shapes shapes the kept ones are dropped and made again."""

    def __init__(self, max_shapes: int, dtype: type = np.int64):
        self.max_shapes, self.dtype = max_shapes, dtype
        self._kept: dict[tuple[tuple[int, ...], bool], tuple[np.ndarray, list[paddle.Tensor]]] = {}

    def tensors(self, parts: tuple[np.ndarray, ...], stacked: bool = False) -> list[paddle.Tensor]:
        """One CPU tensor per part, holding its values; stacked (parts of one length): one tensor
        [len(parts), length]."""
        lengths = tuple(len(p) for p in parts)
        if stacked and len(set(lengths)) > 1:
            raise ValueError(f"stacked parts must have one length, got {lengths}")
        kept = self._kept.get((lengths, stacked))
        if kept is None:
            if len(self._kept) >= self.max_shapes:
                self._kept.clear()
            buf = np.empty(sum(lengths), self.dtype)
            ends = np.cumsum(lengths)
            views = ([buf.reshape(len(parts), -1)] if stacked
                     else [buf[e - n:e] for n, e in zip(lengths, ends.tolist())])
            kept = (buf, [paddle.base.core.eager.Tensor(v, paddle.CPUPlace(), False, True, "specgen_kept",
                                                        True) for v in views])
            self._kept[(lengths, stacked)] = kept
        np.concatenate(parts, out=kept[0])
        return kept[1]


class FusedBackend:
    name = "fused"
    # the longest index kept for reuse (decode and verify steps; prefills make their own)
    INDEX_REUSE_MAX = 1 << 14
    INDEX_REUSE_SIZES = 512  # index lengths kept at most

    def __init__(self, ops: ModuleType, engine: EngineConfig):
        self.engine = engine  # the settings the model was loaded with
        self.ops, self.dtype = ops, engine.dtype
        self.vnni = kernels.has_vnni(engine.cpu_target)
        self.int8_product = engine.matmul == "int8"
        self.screen: kernels.Screen | None = None  # the LM head's greedy screen, when it has one
        self._model_args: args.ModelArgs | None = None
        self._weights_handle: int | None = None
        self._moe_args: args.MoeArgs | None = None  # a mixture-of-experts model's routed blocks, once bound
        self._counts_handle: paddle.Tensor | None = None
        self._indices = KeptIndex(self.INDEX_REUSE_SIZES)
        self._params = KeptIndex(self.INDEX_REUSE_SIZES, np.float64)  # the sampler's, per row count
        self._no_screen = paddle.zeros([0], dtype="float32")
        self._no_sample = paddle.zeros([0], dtype="float64")

    @property
    def keeps_blocks(self) -> bool:
        return self.dtype == "float32"  # float64 models multiply float64 panels of the dequantized weights

    def pack(self, lin: Linear, int8_product: bool | None = None) -> Linear:
        """lin with its weight packed (from its GGUF blocks where it has them, as integer-product panels with
        int8_product, default: the engine's matmul), in place."""
        if lin.packed:
            return lin
        if lin.blocks is not None and self.keeps_blocks:
            int8 = self.int8_product if int8_product is None else int8_product
            parts = getattr(lin.blocks, "parts", ())  # rows of several formats: each run in its own
            lin.weight = (pack_parts([(p.kind, p.blocks) for p in parts], int8, self.ops) if parts
                          else pack_quantized(lin.blocks.kind, lin.blocks.blocks, int8, self.ops))
        else:
            lin.weight = pack_linear(lin.weight, dtype=self.dtype)
        return lin

    def prepare_linear(self, lin: Linear) -> Linear:
        """A block's Linear packed as it is read; its blocks' memory goes (the LM head's stays: its screen and
        drafters' heads are made from them)."""
        self.pack(lin)
        lin.blocks = None
        return lin

    def prepare(self, model: ModelView) -> None:
        weights = model.weights
        if self.int8_product:
            has_blocks = bool(weights.block_kinds & set(INT8_KINDS))
            if not (has_blocks and self.vnni and self.dtype == "float32"):
                raise ConfigError("matmul int8 needs block weights (GGUF Q4_0 / Q4_1 / Q8_0 / Q4_K / Q6_K, "
                                  "or --quantization wint8 | wint4), a float32 model and a CPU with AVX-512 "
                                  f"VNNI (here: blocks {'yes' if has_blocks else 'no'}, {self.dtype}, VNNI "
                                  f"{'yes' if self.vnni else 'no'})")
        q = weights.lm_head.blocks
        if (self.keeps_blocks and not self.int8_product and q is not None and q.kind in SCREENED_KINDS
                and self.vnni):
            self.screen = pack_screen(q.kind, q.blocks, self.ops)
        for lin in weights.linears():
            self.pack(lin)
        self._kinds = sorted({lin.weight.kind for lin in weights.linears()})
        cfg = model.config
        self._geometry = args.Geometry(cfg.num_heads, cfg.num_kv_heads, cfg.qk_norm, cfg.rms_norm_eps)
        # stand-ins for absent q/k norms and prefix caches, and for absent biases
        self.ones = paddle.ones([model.config.head_dim], dtype=self.dtype)
        self.none = paddle.zeros([0], dtype=self.dtype)

    def block_args(self, blocks: list[DecoderBlock]) -> args.BlockArgs:
        """The operators' per-block lists (absent biases and q/k norms replaced by their stand-ins)."""
        none, ones = self.none, self.ones

        def bias(lin: Linear | None):
            return lin.bias if lin is not None and lin.bias is not None else none

        def panels(lin: Linear | None):  # a routed block without shared experts has no dense MLP
            return lin.weight.panels if lin is not None else none

        return args.BlockArgs(
            attn_norm=[b.attn_norm if b.attn_norm is not None else none for b in blocks],
            w_qkv=[b.qkv.weight.panels for b in blocks],
            b_qkv=[bias(b.qkv) for b in blocks], w_o=[b.o.weight.panels for b in blocks],
            b_o=[bias(b.o) for b in blocks], mlp_norm=[b.mlp_norm for b in blocks],
            w_gate_up=[panels(b.gate_up) for b in blocks], b_gate_up=[bias(b.gate_up) for b in blocks],
            w_down=[panels(b.down) for b in blocks], b_down=[bias(b.down) for b in blocks],
            q_norm=[b.q_norm if b.q_norm is not None else ones for b in blocks],
            k_norm=[b.k_norm if b.k_norm is not None else ones for b in blocks])

    def _weights(self, model: ModelView) -> int:
        """The model's weights in the kernels: bound on first use, dropped with this backend."""
        if self._weights_handle is None:
            w = model.weights
            self._model_args = args.ModelArgs(w.embed, self.block_args(w.blocks),
                                              model.rope.cos, model.rope.sin, w.final_norm,
                                              w.lm_head.weight.panels)
            handle = args.bind_weights(self.ops, self._model_args)
            if model.config.moe is not None:
                self._moe_args = moe_args(model)
                args.bind_experts(self.ops, handle, self._moe_args)
                self._counts_handle = handle
            self._weights_handle = int(handle.numpy()[0])
            # at exit too: a binding left to the kernels' static destructors would release the mapped rows
            # after the interpreter is gone (a hang)
            weakref.finalize(self, unbind_keeping, self.ops, handle, self._model_args, self._moe_args)
        return self._weights_handle

    def _caches(self, model: ModelView, cache: KVCache) -> int:
        """`cache`'s tensors (and its shared prefix's) in the kernels: bound again whenever they were replaced
        (the cache grew, a prefix was set); the binding is dropped with the cache or when it is replaced."""
        pre = cache.prefix
        key = (cache.version, pre, pre.version if pre is not None else 0)  # pre compares by identity
        if cache.binding is not None and cache.binding[0] == key:
            return cache.binding[1]
        cache.unbind()  # the tensors that were replaced, if any
        n = len(cache.k)
        stand_in = [self.ones] * n
        handle = args.bind_caches(self.ops, args.CacheArgs(cache.k, cache.v,
                                                           pre.k if pre is not None else stand_in,
                                                           pre.v if pre is not None else stand_in))
        release = weakref.finalize(cache, args.unbind, self.ops, handle)
        release.atexit = False
        cache.binding = (key, int(handle.numpy()[0]), release)
        return cache.binding[1]

    def _index(self, index: np.ndarray) -> paddle.Tensor:
        """`index` as a CPU tensor: kept per length (KeptIndex), or, past INDEX_REUSE_MAX (prefills), its
        own."""
        if len(index) > self.INDEX_REUSE_MAX:
            return paddle.to_tensor(index.astype(np.int64, copy=False))
        return self._indices.tensors((index,))[0]

    @property
    def samples_in_forward(self) -> bool:
        return self.screen is not None  # (the screen's bounds give the sampled rows' keys: linear.cc)

    def forward(self, model: ModelView, batch: ForwardBatch, cache: KVCache,
                logits: bool = True, features: tuple[int, ...] = (),
                sampling: RowSampling | None = None) -> ForwardOutput:
        reserve(batch, cache)
        n = len(batch.token_ids)
        plen = batch.token_prefix_len
        tree = batch.tree_mask is not None
        index = np.concatenate([batch.token_ids, batch.positions, batch.token_slots,
                                plen if plen is not None else np.zeros(n, np.int64),
                                *((batch.model_positions, batch.tree_mask) if tree else ()),
                                batch.logit_rows])
        screened = not logits and self.screen is not None
        screen, bound = (self.screen.panels.panels, self.screen.bound) if screened else (self._no_screen,) * 2
        sampled = screened and sampling is not None and sampling.key is not None
        sample = self._no_sample
        if sampled:
            sample = self._params.tensors(args.sample_rows(args.SampleArgs(
                sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p, sampling.key,
                sampling.position, np.zeros(len(sampling.temperature), np.int64))), stacked=True)[0]
        pre = cache.prefix
        out, hidden, greedy, feats = args.forward_bound(self.ops, args.StepArgs(
            index=self._index(index), num_tokens=n, weights=self._weights(model),
            caches=self._caches(model, cache),
            capacity=cache.capacity, prefix_capacity=pre.capacity if pre is not None else 0, screen=screen,
            bound=bound, sample=sample, geometry=self._geometry, vocab=model.weights.lm_head.weight.n,
            tree=tree), features)
        counts = args.take_expert_counts(self.ops, self._counts_handle).numpy() if self._moe_args else None
        return ForwardOutput(None if screened else out, hidden, greedy.numpy(), counts, feats, sampled)

    def logits(self, model: ModelView, hidden: paddle.Tensor) -> paddle.Tensor:
        lm = model.weights.lm_head.weight
        return args.linear(self.ops, hidden, lm.panels, lm.n)

    def sample(self, logits: paddle.Tensor | None, s: RowSampling, greedy: np.ndarray) -> np.ndarray:
        """specgen_sample: every row in one operator (the reference's rule: layers/sampling.py)."""
        if s.key is None:
            return greedy
        rows = args.sample_rows(args.SampleArgs(s.temperature, s.top_k, s.top_p, s.min_p, s.key, s.position,
                                                greedy))
        return args.sample(self.ops, logits, self._params.tensors(rows, stacked=True)[0]).numpy()

    def logprobs(self, logits: paddle.Tensor, rows: np.ndarray, tokens: np.ndarray,
                 top: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """specgen_logprobs: every row in one operator, one pass for the normalizer and one for the top
        (the reference's rule: layers/logprobs.py)."""
        whole = len(rows) == logits.shape[0] and np.array_equal(rows, np.arange(len(rows)))
        picked = logits if whole else paddle.gather(logits, paddle.to_tensor(rows))  # (every row: no copy)
        lp, ids, top_lp = args.logprobs(self.ops, picked, paddle.to_tensor(tokens.astype(np.int64)), top)
        return lp.numpy(), ids.numpy(), top_lp.numpy()

    def new_cache(self, model: ModelView, num_slots: int, max_capacity: int, kv_dtype: str = "auto",
                  num_layers: int | None = None) -> KVCache:
        dtype = self.dtype if kv_dtype == "auto" else kv_dtype
        if dtype != self.dtype and (self.dtype != "float32" or dtype != "float16"):
            raise ConfigError(f"a {dtype} KV cache needs a float32 model (this one: {self.dtype})")
        cfg = model.config
        # the kernels read only positions written before: the storage can start uninitialized (KVCache.admit)
        return KVCache(cfg.num_layers if num_layers is None else num_layers, num_slots, cfg.num_kv_heads,
                       cfg.head_dim, dtype, max_capacity, zeroed=False)

    def prepare_drafter(self, model: ModelView, weights: Any, quantize: bool) -> Any:
        """A learned drafter's pass: the fused kernel its weights name (`fused`: an MTP head's
        specgen_mtp_draft, an EAGLE layer's specgen_eagle_pass), else its reference pass (EAGLE-3)."""
        fused = {"mtp": FusedHead, "eagle": FusedEagle}.get(getattr(weights, "fused", None))
        return fused(self, model, weights, quantize) if fused is not None else weights.reference_pass(model)

    def describe(self) -> list:
        return [self.name, self.int8_product, self.screen is not None, self._kinds]


def unbind_keeping(ops: ModuleType, handle: paddle.Tensor, *bound: Any) -> None:
    """Drop a weights binding while `bound` (the tensors it holds) still has its Python references: the last
    reference to a tensor over a mapped file (the embedding's rows) must go in Python, whose release takes the
    interpreter lock safely, not inside the kernels' call or their static destructors (measured: a hang)."""
    args.unbind(ops, handle)


def moe_args(model: ModelView) -> args.MoeArgs:
    """The routed blocks of an MoE model whose Linears are packed, for specgen_bind_experts."""
    routed = [(i, b.moe) for i, b in enumerate(model.weights.blocks) if b.moe is not None]
    first = routed[0][1]
    none = paddle.zeros([0], dtype="float32")
    return args.MoeArgs(
        blocks=[i for i, _ in routed], routers=[m.router.weight.panels for _, m in routed],
        bias=[m.selection_bias.astype("float32") if m.selection_bias is not None else none
              for _, m in routed],
        w_gate_up=[e.gate_up.weight.panels for _, m in routed for e in m.experts],
        w_down=[e.down.weight.panels for _, m in routed for e in m.experts],
        hidden=model.config.hidden_size, inter=model.config.moe.intermediate_size,
        num_experts=first.num_experts, top_k=first.top_k, first_expert=first.first_expert,
        norm=first.norm_topk_prob, norm_min=first.norm_min)


def q8_0(lin: Linear) -> QuantRows | None:
    """A dense weight [in, out] as GGUF Q8_0 blocks of its rows (gguf.quants), when `in` is a multiple
    of 32."""
    from gguf import GGMLQuantizationType, quants

    rows = np.ascontiguousarray(lin.weight.numpy().T)  # [out, in]
    if rows.dtype != np.float32 or rows.shape[1] % 32:
        return None
    blocks = quants.quantize(rows, GGMLQuantizationType.Q8_0)  # [out, in / 32 * 34] uint8
    return QuantRows("Q8_0", blocks.reshape(rows.shape[0], rows.shape[1] // 32, -1))


def draft_lm_head(backend: FusedBackend, main_lm: Linear, own: Linear | None, draft_vocab: np.ndarray | None,
                  int8_product: bool) -> Linear:
    """A drafter's packed LM head [hidden] -> [draft vocabulary]: its own or the main model's, restricted to
    the draft vocabulary's columns where it has one (from the main model's blocks where they are kept)."""
    if draft_vocab is None:  # its own LM head, or the main model's
        return backend.pack(own) if own is not None else main_lm
    if own is None and main_lm.blocks is not None and backend.keeps_blocks:
        # the draft vocabulary's rows of the main model's blocks
        return Linear(pack_quantized(main_lm.blocks.kind, main_lm.blocks.blocks[draft_vocab],
                                     backend.int8_product or int8_product, backend.ops))
    src = own if own is not None else main_lm  # the draft vocabulary's columns
    cols = paddle.gather(src.dense(), paddle.to_tensor(draft_vocab), axis=1)  # [hidden, V']
    return Linear(pack_linear(cols, dtype=backend.dtype))


class FusedHead:
    """An MTP head packed for specgen_mtp_draft. Beside a main model kept in GGUF blocks (and with
    `quantize`), its projections are packed as Q8_0 blocks too: its pass reads ~4.5 instead of ~17 MB for the
    default model; on a CPU with AVX-512 VNNI with integer products (drafts need not be float32's, only
    cheap). Only the drafts can change, never the outputs."""

    def __init__(self, backend: FusedBackend, model: ModelView, head: Any, quantize: bool):
        self.backend = backend
        main_blocks = backend.keeps_blocks and model.weights.lm_head.blocks is not None
        q8 = quantize and main_blocks
        self.int8_product = q8 and backend.vnni
        for lin in [head.eh_proj, *head.block.linears()]:
            if q8:
                lin.blocks = q8_0(lin)
            backend.pack(lin, self.int8_product)
        lm = draft_lm_head(backend, model.weights.lm_head, head.lm_head, head.draft_vocab, self.int8_product)
        self.lm_head = lm  # [hidden] -> [draft vocabulary]
        cfg = model.config
        vocab = head.draft_vocab if head.draft_vocab is not None else np.zeros(0, np.int64)
        self.args = args.MtpHeadArgs(
            embed=head.embed, enorm=head.enorm, hnorm=head.hnorm, eh_proj=head.eh_proj.weight.panels,
            blocks=backend.block_args([head.block]), cos=model.rope.cos, sin=model.rope.sin,
            final_norm=head.final_norm, lm_head=lm.weight.panels, draft_vocab=paddle.to_tensor(vocab),
            vocab=lm.weight.n,
            geometry=args.Geometry(cfg.num_heads, cfg.num_kv_heads, cfg.qk_norm, cfg.rms_norm_eps),
            ones=backend.ones)
        self._indices = KeptIndex(256)  # the pass's index tensors, kept per (tokens, sequences) shape
        self._no_draw = paddle.zeros([4, 0], dtype="float64")  # MtpPass.draw None: every draft the argmax

    def run(self, cache: KVCache, p: MtpPass) -> tuple[np.ndarray, paddle.Tensor]:
        cache.reserve(int(p.positions.max()) + p.depth)
        tok, row, pos, slot, pre, last = self._indices.tensors(
            (p.token_ids, p.rows, p.positions, p.token_slots, np.zeros(len(p.token_ids), np.int64),
             p.last_rows))
        drafts, rows = args.mtp_draft(self.backend.ops, self.args, args.MtpStepArgs(
            token_ids=tok, hidden=p.hidden, rows=row, positions=pos, slots=slot, prefix_len=pre,
            last_rows=last, k_cache=cache.k[0], v_cache=cache.v[0], capacity=cache.capacity, depth=p.depth,
            draw=self._no_draw if p.draw is None else paddle.to_tensor(p.draw, dtype="float64")))
        return drafts.numpy(), rows


class FusedEagle:
    """An EAGLE layer packed for specgen_eagle_pass; beside a main model kept in GGUF blocks (and with
    `quantize`) its projections are Q8_0 blocks, as an MTP head's (FusedHead). Only the drafts can change,
    never the outputs."""

    def __init__(self, backend: FusedBackend, model: ModelView, w: Any, quantize: bool):
        # weakly: the prepared layer is cached per model (proposers/base.py prepared_once, weak on the model)
        self.backend, self._model = backend, weakref.ref(model)
        q8 = quantize and backend.keeps_blocks and model.weights.lm_head.blocks is not None
        int8 = q8 and backend.vnni
        for lin in [w.fc, *w.block.linears()]:
            if q8:
                lin.blocks = q8_0(lin)
            backend.pack(lin, int8)
        lm = draft_lm_head(backend, model.weights.lm_head, None, w.draft_vocab, int8)
        cfg = model.config
        self.args = args.EagleArgs(
            embed=w.embed, fc=w.fc.weight.panels,
            fc_bias=w.fc.bias if w.fc.bias is not None else backend.none,
            blocks=backend.block_args([w.block]), cos=model.rope.cos, sin=model.rope.sin,
            final_norm=w.norm if w.norm is not None else backend.none, lm_head=lm.weight.panels,
            vocab=lm.weight.n,
            geometry=args.Geometry(cfg.num_heads, cfg.num_kv_heads, cfg.qk_norm, cfg.rms_norm_eps),
            ones=backend.ones)
        self.token_ids = w.token_ids
        self._indices = KeptIndex(256)

    def new_cache(self, num_slots: int) -> KVCache:
        model = self._model()
        return self.backend.new_cache(model, num_slots, model.max_len, "auto", num_layers=1)

    def run(self, cache: KVCache, slots: np.ndarray, starts: np.ndarray, lens: np.ndarray,
            token_ids: np.ndarray, hidden: paddle.Tensor, rows: np.ndarray, logit_rows: np.ndarray,
            topk: int, rope: np.ndarray | None = None, mask: np.ndarray | None = None):
        """EaglePass.run's pass in one operator."""
        n = len(token_ids)
        seq = np.repeat(np.arange(len(lens)), lens)
        positions = starts[seq] + np.arange(n) - (np.cumsum(lens) - lens)[seq]  # [num_tokens] cache rows
        cache.reserve(int(positions.max()) + 1)
        index = self._indices.tensors((np.concatenate([
            token_ids, rows, positions, slots[seq], np.zeros(n, np.int64),
            positions if rope is None else rope, np.full(n, -1, np.int64) if mask is None else mask,
            logit_rows]),))[0]
        feat, vals, cols = args.eagle_pass(self.backend.ops, self.args, index, n, hidden, cache.k[0],
                                           cache.v[0], cache.capacity, topk)
        return feat, vals.numpy().astype(np.float64), self.token_ids(cols.numpy())
