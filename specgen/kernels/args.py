"""Typed arguments of the fused operators (cpu_ops.cc, linear.cc): one dataclass per call, built once where
its parts stay put (a model's weights, a head's block), and one function per operator that lays it out in the
operator's order. Nowhere else are the operators called with positional lists.

Tensors are paddle.Tensors; shapes in the comments use the vocabulary of specgen/engine/types.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

Tensor = Any  # paddle.Tensor


def _first(out):
    return out[0] if isinstance(out, (list, tuple)) else out


@dataclass(frozen=True)
class Geometry:
    """Attributes of a decoder block the operators need: head counts, q/k norms, the RMSNorm epsilon."""

    num_heads: int
    num_kv_heads: int
    qk_norm: bool
    eps: float


@dataclass(frozen=True)
class BlockArgs:
    """Decoder blocks' weights as the operators take them: block i's tensor at index i of every list. Absent
    biases are empty tensors, absent q/k norms ones [head_dim]; projections are packed panels
    (Packed.panels)."""

    attn_norm: list[Tensor]  # [hidden] each
    w_qkv: list[Tensor]  # [hidden] -> [(H + 2 KV) D]
    b_qkv: list[Tensor]
    w_o: list[Tensor]  # [H D] -> [hidden]
    b_o: list[Tensor]
    mlp_norm: list[Tensor]
    w_gate_up: list[Tensor]  # [hidden] -> [2 inter]
    b_gate_up: list[Tensor]
    w_down: list[Tensor]  # [inter] -> [hidden]
    b_down: list[Tensor]
    q_norm: list[Tensor]  # [head_dim]
    k_norm: list[Tensor]

    def projections(self) -> list[list[Tensor]]:
        """The lists from attn_norm to b_down, in the operators' order."""
        return [self.attn_norm, self.w_qkv, self.b_qkv, self.w_o, self.b_o, self.mlp_norm, self.w_gate_up,
                self.b_gate_up, self.w_down, self.b_down]


@dataclass(frozen=True)
class ModelArgs:
    """A main model's weights for specgen_bind_weights."""

    embed: Tensor  # [vocab, hidden]
    blocks: BlockArgs
    cos: Tensor  # [max_len, head_dim / 2]
    sin: Tensor
    final_norm: Tensor  # [hidden]
    lm_head: Tensor  # packed panels [hidden] -> [vocab]


def bind_weights(ops: ModuleType, a: ModelArgs) -> Tensor:
    """-> int64 handle [1] under which the kernels hold the weights (until unbind)."""
    b = a.blocks
    return _first(ops.specgen_bind_weights(a.embed, *b.projections(), a.cos, a.sin, b.q_norm, b.k_norm,
                                           a.final_norm, a.lm_head))


@dataclass(frozen=True)
class MoeArgs:
    """A mixture-of-experts model's routed blocks for specgen_bind_experts: routed block j (model block
    blocks[j]) has routers[j], bias[j] and its local experts l at w_gate_up / w_down[j * num_local + l], the
    expert ids [first_expert, first_expert + num_local)."""

    blocks: list[int]  # [num_routed] ascending block indices
    routers: list[Tensor]  # packed [hidden] -> [num_experts]
    bias: list[Tensor]  # float32 [num_experts] selection bias, or empty
    w_gate_up: list[Tensor]  # packed [hidden] -> [2 inter], [num_routed * num_local]
    w_down: list[Tensor]  # packed [inter] -> [hidden]
    hidden: int
    inter: int  # each expert's intermediate size
    num_experts: int
    top_k: int
    first_expert: int
    norm: bool  # divide the top-k weights by max(their sum, norm_min)
    norm_min: float


def bind_experts(ops: ModuleType, weights: Tensor, a: MoeArgs) -> None:
    """Hold the routed experts with the weights bound under `weights` (bind_weights' handle)."""
    ops.specgen_bind_experts(weights, a.routers, a.bias, a.w_gate_up, a.w_down, a.blocks, a.hidden, a.inter,
                             a.num_experts, a.top_k, a.first_expert, a.norm, a.norm_min)


def take_expert_counts(ops: ModuleType, weights: Tensor) -> Tensor:
    """-> int64 [num_routed, num_experts]: tokens each expert took since the last call (then zeroed)."""
    return _first(ops.specgen_take_expert_counts(weights))


@dataclass(frozen=True)
class CacheArgs:
    """A KV cache's per-block tensors and its shared prefix's (stand-ins without one) for
    specgen_bind_caches."""

    k: list[Tensor]  # per block [num_slots * num_kv_heads * capacity, head_dim]
    v: list[Tensor]
    prefix_k: list[Tensor]  # per block [num_kv_heads * prefix_capacity, head_dim]
    prefix_v: list[Tensor]


def bind_caches(ops: ModuleType, a: CacheArgs) -> Tensor:
    return _first(ops.specgen_bind_caches(a.k, a.v, a.prefix_k, a.prefix_v))


def unbind(ops: ModuleType, handle: Tensor) -> int:
    """Drop a handle of either kind; 1 where it was bound."""
    return int(_first(ops.specgen_unbind(handle)).numpy()[0])


@dataclass(frozen=True)
class StepArgs:
    """One specgen_forward_bound call: the step's indices and the handles of the weights and caches."""

    index: Tensor  # int64 [4 num_tokens + num_logits]: token ids, positions, slots, prefix lengths, logit
    # rows (with `tree` [6 num_tokens + num_logits]: a token tree's positions and masks before the logit rows)
    num_tokens: int
    weights: int  # bind_weights' handle
    caches: int  # bind_caches' handle
    capacity: int  # cache positions per (slot, kv head)
    prefix_capacity: int  # the shared prefix's positions (0: none)
    screen: Tensor  # the LM head's integer-product panels for tokens without logits; empty: the logits
    bound: Tensor  # the screen's error bound [panels, hidden / 32, 32]; empty with an empty screen
    geometry: Geometry
    vocab: int
    tree: bool = False  # the index holds ForwardBatch.rope_positions and tree_mask
    # sample_rows stacked (float64 [8, num_logits]) for the rows the screen samples (None or empty: greedy)
    sample: Tensor | None = None


def _no_sample() -> Tensor:
    import paddle

    return paddle.zeros([0], dtype="float64")


def forward_bound(ops: ModuleType, a: StepArgs,
                  capture: tuple[int, ...] = ()) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """-> (logits [num_logits, vocab] (screened: [0, vocab]), hidden [num_tokens, hidden], greedy
    [num_logits] (with `sample`, its sampled rows' tokens), features [num_tokens, len(capture) hidden]: the
    inputs of blocks `capture`, or None)."""
    g = a.geometry
    sample = a.sample if a.sample is not None else _no_sample()
    logits, hidden, greedy, features = ops.specgen_forward_bound(
        a.index, a.screen, a.bound, sample, a.num_tokens, a.weights, a.caches, g.num_heads, g.num_kv_heads,
        a.capacity, g.qk_norm, g.eps, a.prefix_capacity, a.vocab, a.tree, list(capture))
    return logits, hidden, greedy, features if capture else None


@dataclass(frozen=True)
class MtpHeadArgs:
    """An MTP head's weights for specgen_mtp_draft (built once per head)."""

    embed: Tensor  # [vocab, hidden]
    enorm: Tensor  # [hidden]
    hnorm: Tensor
    eh_proj: Tensor  # packed [2 hidden] -> [hidden]
    blocks: BlockArgs  # the head's decoder block(s)
    cos: Tensor
    sin: Tensor
    final_norm: Tensor
    lm_head: Tensor  # packed [hidden] -> [draft vocabulary]
    draft_vocab: Tensor  # int64 token id of each LM-head column; empty: the column is the token id
    vocab: int  # the LM head's columns
    geometry: Geometry
    ones: Tensor  # stand-in prefix caches (the head keeps no shared prefix)


@dataclass(frozen=True)
class MtpStepArgs:
    """One specgen_mtp_draft call: the step's catch-up tokens and the drafts wanted."""

    token_ids: Tensor  # int64 [num_tokens] token i + 1 of each catch-up position i
    hidden: Tensor  # [num_rows, hidden] the main model's final hidden states
    rows: Tensor  # int64 [num_tokens] row of `hidden` of each catch-up position
    positions: Tensor  # int64 [num_tokens] head positions
    slots: Tensor  # int64 [num_tokens] head cache slots
    prefix_len: Tensor  # int64 [num_tokens] zeros (no shared prefix in the head's cache)
    last_rows: Tensor  # int64 [num_wanted] the last catch-up token of each sequence that wants drafts
    k_cache: Tensor  # the head's cache [num_slots * num_kv_heads * capacity, head_dim]
    v_cache: Tensor
    capacity: int
    depth: int  # drafts per wanted sequence
    # float64 [4, num_wanted] (MtpPass.draw), or empty: every draft the LM head's argmax
    draw: Tensor


def mtp_draft(ops: ModuleType, h: MtpHeadArgs, a: MtpStepArgs) -> tuple[Tensor, Tensor]:
    """-> (drafts int64 [num_wanted, depth] (token ids, through draft_vocab), the block's output rows of the
    catch-up tokens [num_tokens, hidden])."""
    g, b = h.geometry, h.blocks
    drafts, rows = ops.specgen_mtp_draft(
        a.token_ids, a.hidden, a.rows, h.embed, h.enorm, h.hnorm, h.eh_proj, *b.projections(), h.cos, h.sin,
        a.positions, a.slots, [a.k_cache], [a.v_cache], b.q_norm, b.k_norm, a.prefix_len, [h.ones], [h.ones],
        a.last_rows, h.final_norm, h.lm_head, h.draft_vocab, a.draw, g.num_heads, g.num_kv_heads, a.capacity,
        g.qk_norm, g.eps, 0, a.depth, h.vocab)[:2]
    return drafts, rows


@dataclass(frozen=True)
class EagleArgs:
    """An EAGLE layer's weights for specgen_eagle_pass (built once per layer)."""

    embed: Tensor  # [vocab, hidden]
    fc: Tensor  # packed [2 hidden] -> [hidden]
    fc_bias: Tensor  # [hidden], or empty
    blocks: BlockArgs  # its one decoder layer (an empty attn_norm: no input norm)
    cos: Tensor
    sin: Tensor
    final_norm: Tensor  # [hidden], or empty: none
    lm_head: Tensor  # packed [hidden] -> [draft vocabulary]
    vocab: int  # the LM head's columns
    geometry: Geometry
    ones: Tensor  # stand-in prefix caches (the layer keeps no shared prefix)


def eagle_pass(ops: ModuleType, e: EagleArgs, index: Tensor, num_tokens: int, hidden: Tensor, k_cache: Tensor,
               v_cache: Tensor, capacity: int, topk: int) -> tuple[Tensor, Tensor, Tensor]:
    """index int64 [7 num_tokens + num_logits] (token ids, hidden rows, cache rows, slots, zeros, RoPE
    positions, tree masks, logit rows) -> (features [num_tokens, hidden], top-k log-probabilities
    [num_logits, topk], their LM-head columns int64 [num_logits, topk])."""
    g, b = e.geometry, e.blocks
    feat, vals, cols = ops.specgen_eagle_pass(
        index, hidden, e.embed, e.fc, e.fc_bias, *b.projections(), e.cos, e.sin, [k_cache], [v_cache],
        b.q_norm, b.k_norm, [e.ones], [e.ones], e.final_norm, e.lm_head, num_tokens, g.num_heads,
        g.num_kv_heads, capacity, g.qk_norm, g.eps, e.vocab, topk)[:3]
    return feat, vals, cols


def linear(ops: ModuleType, x: Tensor, panels: Tensor, n: int) -> Tensor:
    """x [rows, k] @ a packed weight [k, n]."""
    return _first(ops.specgen_linear(x, panels, n))


def pack_blocks(ops: ModuleType, blocks: Tensor, int8_product: bool,
                with_bound: bool) -> tuple[Tensor, Tensor]:
    """GGUF Q4_0 / Q4_1 / Q8_0 blocks uint8 [n, k / 32, bytes] (or Q4_K / Q6_K super-blocks [n, k / 256,
    bytes]) -> (packed panels, the greedy screen's bound or an empty tensor)."""
    panels, bound = ops.specgen_pack_blocks(blocks, int8_product, with_bound)
    return panels, bound


@dataclass(frozen=True)
class SampleArgs:
    """specgen_sample's per-row settings (sampling.cc), each [rows]; laid out as float64 [8, rows]
    (sample_rows)."""

    temperature: Any  # float64, 0 = greedy
    top_k: Any  # int64, 0 = off
    top_p: Any  # float64, 1 = off
    min_p: Any  # float64, 0 = off
    key: Any  # uint64 the row's request key, and
    position: Any  # int64 its output position: the row's noise stream (layers/sampling.streams)
    greedy: Any  # int64 the row's argmax (the token of a greedy row)


def sample_rows(a: SampleArgs) -> tuple[Any, ...]:
    """The operator's params, one [rows] array per setting in its order (stacked: float64 [8, rows]): the key
    as its high and low 32 bits (each exact in a double)."""
    import numpy as np

    key = np.asarray(a.key, np.uint64)
    return (a.temperature, a.top_k, a.top_p, a.min_p, key >> np.uint64(32), key & np.uint64(0xFFFFFFFF),
            a.position, a.greedy)


def sample(ops: ModuleType, logits: Tensor, params: Tensor) -> Tensor:
    """int64 [rows]: each logits row's token (sampling.cc; logits [rows, vocab] float32 or float64, params
    float64 [8, rows]: sample_rows stacked)."""
    return _first(ops.specgen_sample(logits, params))


def logprobs(ops: ModuleType, logits: Tensor, tokens: Tensor, top: int) -> tuple[Tensor, Tensor, Tensor]:
    """Each logits row's log-softmax at its token (float64 [rows]) and its `top` most likely tokens (int64 and
    float64 [rows, top]), sampling.cc's specgen_logprobs."""
    lp, ids, top_lp = ops.specgen_logprobs(logits, tokens, top)
    return lp, ids, top_lp


def argmax(ops: ModuleType, x: Tensor) -> Tensor:
    """int64 [rows]: each row's largest value's index, the lowest on a tie."""
    return _first(ops.specgen_argmax(x))
