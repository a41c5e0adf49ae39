"""Weight layouts of the fused kernels (linear.cc): packed panels of 32 output columns, in float32, float64,
16-bit or GGUF blocks, and the greedy screen of a quantized LM head; numpy references of every layout."""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import numpy as np

PANEL = 32  # output columns per panel of a packed weight (linear.cc)


@dataclass
class Packed:
    """A weight W [k, n] for specgen_linear: float32 (or float64) panels [ceil(n / 32), k, 32]; bfloat16 /
    float16 panels [ceil(n / 32), k / 32, 32 x 32] of a weight whose every value is one (see pack_linear); or
    block-quantized uint8 panels [ceil(n / 32), k / 32, QUANT_PANEL_BYTES[kind]] (int8 for integer products:
    [.., panel_bytes(kind, True)]; see pack_quantized), or a weight of parts (pack_parts)."""

    panels: object  # paddle.Tensor
    k: int
    n: int
    kind: str = "F32"  # or "F64", one of HALF_KINDS, a key of QUANT_PANEL_BYTES, or parts' joined by "+"
    int8_product: bool = False  # quantized only: int8 panels, multiplied with the inputs quantized to int8

    def numpy(self) -> np.ndarray:
        """The dense [k, n] weight, float32 (16-bit: widened; quantized: rebuilt as the GGUF reader does) or
        float64."""
        if "+" in self.kind:  # a weight of parts (pack_parts)
            return np.concatenate([part.numpy() for part in _parts(self.panels.numpy(), self.k)],
                                  axis=1)[:, :self.n]
        p = self.panels.numpy()
        if self.int8_product:
            p = _dequantize_panels(_float_layout(p.view(np.uint8), self.kind), self.kind)
        elif self.kind in HALF_KINDS:
            wide = ((p.astype(np.uint32) << 16).view(np.float32) if self.kind == "BF16"
                    else p.astype(np.float32))
            p = wide.reshape(p.shape[0], self.k, PANEL)
        elif self.kind not in ("F32", "F64"):
            p = _dequantize_panels(p, self.kind)  # [panels, k, 32]
        return np.ascontiguousarray(p.transpose(1, 0, 2).reshape(self.k, -1)[:, :self.n])

    def dense(self):
        import paddle

        return paddle.to_tensor(self.numpy())


# 16-bit panels: weights that are all exactly bfloat16 or float16 values (a bf16 / fp16 checkpoint, widened to
# float32 on load) are packed as such and widened exactly in registers, so a product reads half the bytes of
# the float32 panels and gives the same bits.
HALF_KINDS = ("BF16", "F16")


def half_kind(a: np.ndarray) -> str | None:
    """"BF16" when every float32 value of `a` is exactly a bfloat16, else "F16" when every one is exactly a
    float16 (bit for bit, so NaN payloads and -0 included), else None."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    if not (bits & 0xFFFF).any():
        return "BF16"
    with np.errstate(over="ignore"):
        back = a.astype(np.float16).astype(np.float32)
    return "F16" if np.array_equal(back.view(np.uint32), bits) else None


def pack_linear(w, halves: bool = True, dtype: str = "float32") -> Packed:
    """W [k, n] (a paddle tensor or array) -> Packed; zero columns pad n up to a multiple of 32. In float32,
    with `halves`, k a multiple of 32 and every weight exactly a bfloat16 (or float16), the panels hold those
    16-bit values [panels, k / 32, 32 inputs x 32 columns] (HALF_KINDS). In float64 the panels are float64
    [panels, k, 32] (kind "F64": a float64 model's products, one sum per output in input order)."""
    import paddle

    a = np.asarray(w.numpy() if hasattr(w, "numpy") else w,
                   dtype=np.float64 if dtype == "float64" else np.float32)
    if dtype == "float64":
        halves = False
    k, n = a.shape
    panels = -(-n // PANEL)
    if panels * PANEL != n:
        a = np.concatenate([a, np.zeros((k, panels * PANEL - n), a.dtype)], axis=1)
    p = np.ascontiguousarray(a.reshape(k, panels, PANEL).transpose(1, 0, 2))  # [panels, k, 32]
    kind = half_kind(a) if halves and k % 32 == 0 else None
    if kind == "BF16":  # paddle takes uint16 arrays as bfloat16
        return Packed(paddle.to_tensor(
            (p.view(np.uint32) >> 16).astype(np.uint16).reshape(panels, k // 32, -1)), k, n, kind)
    if kind == "F16":
        return Packed(paddle.to_tensor(p.astype(np.float16).reshape(panels, k // 32, -1)), k, n, kind)
    return Packed(paddle.to_tensor(p), k, n, "F64" if dtype == "float64" else "F32")


# Bytes per panel (32 output columns) and block of 32 inputs in specgen_linear's quantized layout: the 32
# columns' fp16 scales d (Q4_1: then their fp16 minimums m), then the quants (Q8_0: 32 rows, one per input;
# Q4: nibbles grouped by 8 inputs, see _q4_lanes). K-quants keep GGUF's super-blocks of 256 inputs (their
# bytes per block on average; see _pack_super): per super-block the columns' fp16 d (Q4_K: and dmin), then 8
# blocks, each the columns' scale bytes (Q4_K: 6-bit sc, then m; Q6_K: int8 scales of inputs 0-15, then of
# 16-31) and the quants (Q4_K nibbles; Q6_K q - 32 as int8, as Q8_0's). Q5_K is packed as QX (see qx_rows).
QUANT_PANEL_BYTES = {"Q4_0": 64 + 512, "Q4_1": 128 + 512, "Q8_0": 64 + 1024, "Q4_K": 64 + 512 + 128 // 8,
                     "Q6_K": 64 + 1024 + 64 // 8,
                     "QX": 512 + 1024, "Q5_K": 512 + 1024}  # QX: d of each half, m of each half, int8 quants
SUPER_KINDS = {"Q4_K": 128, "Q6_K": 64}  # K-quant kinds packed by super-block: bytes of its own scales
# Integer-product panels of another size: Q6_K's keep its 6 bits (the low 4 as Q4's, the high 2: _q6_high).
INT8_PANEL_BYTES = {"Q6_K": 64 + 512 + 256 + 64 // 8}


def panel_bytes(kind: str, int8_product: bool) -> int:
    """Bytes per panel and block of 32 inputs (on average, for K-quants) of `kind`'s layout."""
    return INT8_PANEL_BYTES.get(kind, QUANT_PANEL_BYTES[kind]) if int8_product else QUANT_PANEL_BYTES[kind]

INT8_KINDS = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K")  # kinds with integer products (int8_product)


def cpu_view(a: np.ndarray):
    """A CPU tensor over `a`'s memory (made contiguous first if it is not), not a copy of it: the kernels read
    GGUF blocks from it without a second copy of each weight in memory while it is packed."""
    import paddle

    a = np.ascontiguousarray(a)
    if not a.flags.writeable:
        a = a.copy()
    return paddle.base.core.eager.Tensor(a, paddle.CPUPlace(), False, True, "view", True)


def pack_quantized(kind: str, blocks: np.ndarray, int8_product: bool = False,
                   ops: ModuleType | None = None) -> Packed:
    """A GGUF block-quantized weight, uint8 blocks [n (out), k / 32, block bytes] (K-quants: super-blocks
    [n, k / 256, block bytes]), -> Packed [k, n] for
    specgen_linear, which multiplies by it without dequantizing it in memory. Zero blocks pad n to a multiple
    of 32 (d = m = 0: zero weights). With int8_product the quants are regrouped for integer products
    (linear.cc, "Integer products") and the panels are int8: specgen_linear then quantizes its inputs to int8
    per block. With `ops` (the kernels) the panels are made in one C++ pass, else in numpy (the same bytes).

    GGUF blocks (gguf.quants): Q8_0 = d, 32 int8; Q4_0 = d, 16 bytes; Q4_1 = d, m, 16 bytes, where byte j
    holds input j in its low nibble and input j + 16 in its high one.
    """

    if kind not in QUANT_PANEL_BYTES:
        raise ValueError(f"unsupported quantization {kind!r}")
    if kind not in INT8_KINDS:  # Q5_K and QX: float32 products only
        return _pack_k_numpy(kind, blocks)
    if ops is not None:  # the same bytes in one C++ pass (numpy's below: ~0.5 s for the default model)
        from specgen.kernels.args import pack_blocks

        panels, _ = pack_blocks(ops, cpu_view(blocks), int8_product, False)
        k = blocks.shape[1] * (256 if kind in SUPER_KINDS else 32)
        return Packed(panels, k, blocks.shape[0], kind, int8_product=int8_product)
    if kind in SUPER_KINDS:
        return _pack_super(kind, blocks, int8_product)
    return _pack_quantized_numpy(kind, blocks, int8_product)


def _pack_quantized_numpy(kind: str, blocks: np.ndarray, int8_product: bool = False) -> Packed:
    """pack_quantized in numpy: the reference of specgen_pack_blocks (and the path without the kernels)."""
    import paddle

    n, kb, _ = blocks.shape
    panels = -(-n // PANEL)
    if panels * PANEL != n:
        blocks = np.concatenate([blocks, np.zeros((panels * PANEL - n, kb, blocks.shape[2]), np.uint8)])
    b = blocks.reshape(panels, PANEL, kb, -1).transpose(0, 2, 1, 3)  # [panels, kb, 32 columns, block bytes]
    parts = [b[..., 0:2].reshape(panels, kb, 64)]  # d of columns 0..31, fp16 little-endian
    if kind == "Q4_1":
        parts.append(b[..., 2:4].reshape(panels, kb, 64))  # m
    qs = b[..., 2 if kind != "Q4_1" else 4:]  # [panels, kb, 32 columns, 16 or 32 bytes]
    if int8_product:
        if kind == "Q8_0":  # unsigned q + 128
            # [panels, kb, 32 columns, 32 inputs]
            u = (qs.view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        else:
            u = np.concatenate([qs & 0xF, qs >> 4], axis=-1)
        parts.append(_int8_lanes(u, nibbles=kind != "Q8_0"))
        packed = np.ascontiguousarray(np.concatenate(parts, axis=-1)).view(np.int8)
        return Packed(paddle.to_tensor(packed), kb * 32, n, kind, int8_product=True)
    if kind == "Q8_0":
        parts.append(qs.transpose(0, 1, 3, 2).reshape(panels, kb, 1024))  # [input, column] int8
    else:
        # [panels, kb, 32 inputs, 32 columns]
        q = np.concatenate([qs & 0xF, qs >> 4], axis=-1).transpose(0, 1, 3, 2)
        parts.append(_q4_lanes(q))
    packed = np.ascontiguousarray(np.concatenate(parts, axis=-1))
    return Packed(paddle.to_tensor(packed), kb * 32, n, kind)


def _k_pieces(kind: str, blocks: np.ndarray) -> tuple[list[np.ndarray], np.ndarray, np.ndarray]:
    """GGUF Q4_K / Q6_K super-blocks [n, k / 256, block bytes] -> their fp16 super-block scales ([n, k / 256]
    each: Q4_K d and dmin, Q6_K d), the two scale bytes of each block of 32 inputs [n, k / 32, 2] (Q4_K: sc
    and m, 0-63; Q6_K: the int8 scales of inputs 0-15 and 16-31, as uint8) and the quants [n, k / 32, 32]
    (int8: Q4_K 0-15, Q6_K q - 32), as gguf.quants reads them."""
    from gguf.quants import Q4_K

    n, nb, _ = blocks.shape
    kb = nb * 8

    def f16(a: np.ndarray) -> np.ndarray:  # fp16 bytes [..., 2] -> [...]
        return np.ascontiguousarray(a).view(np.float16)[..., 0]

    if kind == "Q4_K":
        sc, mn = Q4_K.get_scale_min(blocks[..., 4:16].reshape(-1, 12))  # [n nb, 8] each
        scales = np.stack([sc.reshape(n, kb), mn.reshape(n, kb)], axis=-1).astype(np.uint8)
        qs = blocks[..., 16:].reshape(n, nb, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)
        q = (qs & 0xF).reshape(n, kb, 32).astype(np.int8)
        return [f16(blocks[..., 0:2]), f16(blocks[..., 2:4])], scales, q
    ql, qh = blocks[..., :128], blocks[..., 128:192]
    low = (ql.reshape(n, nb, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)) & 0xF
    high = (qh.reshape(n, nb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 1, 4, 1)) & 0x3
    q = (low.reshape(n, nb, 8, 32) | (high.reshape(n, nb, 8, 32) << 4)).astype(np.int8) - np.int8(32)
    return [f16(blocks[..., 208:210])], blocks[..., 192:208].reshape(n, kb, 2), q.reshape(n, kb, 32)


def block_parts(kind: str, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """GGUF blocks [n, k / block weights, block bytes] of `kind` -> per block of 32 inputs and half of it
    (inputs 0-15, 16-31): scales d [n, k / 32, 2] and offsets m [n, k / 32, 2] (float32) and quants q
    [n, k / 32, 32] (int8), such that fma(d, q, m) rounds to exactly the weight gguf.quants dequantizes (its
    scale products, d * sc and dmin * m, are exact in float32; m is -0.0 where a format has no offset, so that
    a zero weight keeps the sign of d * q)."""
    from gguf.quants import Q4_K

    n, nb, _ = blocks.shape

    def f16(a: np.ndarray) -> np.ndarray:  # fp16 bytes [..., 2 j] -> float32 [..., j]
        return np.ascontiguousarray(a).view(np.float16).astype(np.float32)

    if kind in ("Q4_0", "Q4_1", "Q8_0"):
        kb = nb
        d = np.repeat(f16(blocks[..., 0:2]), 2, axis=-1)  # [n, kb, 2]
        if kind == "Q8_0":
            q = blocks[..., 2:].view(np.int8)
        else:
            qs = blocks[..., 4 if kind == "Q4_1" else 2:]
            q = (np.concatenate([qs & 0xF, qs >> 4], axis=-1).astype(np.int8)
                 - np.int8(8 if kind == "Q4_0" else 0))
        m = (np.repeat(f16(blocks[..., 2:4]), 2, axis=-1) if kind == "Q4_1"
             else np.full((n, kb, 2), -0.0, np.float32))
        return d, m, q
    kb = nb * 8
    if kind in ("Q4_K", "Q6_K"):
        supers, scales, q = _k_pieces(kind, blocks)
        up = [np.repeat(s.astype(np.float32), 8, axis=-1)[..., None] for s in supers]  # [n, kb, 1]
        if kind == "Q6_K":  # a scale per 16 inputs
            return up[0] * scales.view(np.int8).astype(np.float32), np.full((n, kb, 2), -0.0, np.float32), q
        scale = up[0] * scales[..., :1].astype(np.float32)
        offset = -(up[1] * scales[..., 1:].astype(np.float32))
        return np.repeat(scale, 2, axis=-1), np.repeat(offset, 2, axis=-1), q
    if kind == "Q5_K":  # gguf.quants' Q5_K: Q4_K's scales, 32 bytes of fifth bits, then nibbles
        d, dmin = f16(blocks[..., 0:2]), f16(blocks[..., 2:4])  # [n, nb, 1]
        sc, mn = Q4_K.get_scale_min(blocks[..., 4:16].reshape(-1, 12))  # [n nb, 8] each
        scale = (d * sc.reshape(n, nb, 8).astype(np.float32)).reshape(n, kb, 1)
        offset = -(dmin * mn.reshape(n, nb, 8).astype(np.float32)).reshape(n, kb, 1)
        qh, qs = blocks[..., 16:48], blocks[..., 48:]
        low = (qs.reshape(n, nb, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)) & 0xF
        high = (qh.reshape(n, nb, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1
        q = (low.reshape(n, nb, 8, 32) | (high << 4)).reshape(n, kb, 32)
        return np.repeat(scale, 2, axis=-1), np.repeat(offset, 2, axis=-1), q.astype(np.int8)
    raise ValueError(f"no block parts for {kind!r}")


# Rows in specgen's own block format "QX" (QuantRows.blocks [n, k / 32, 48]): per 32 inputs d and m of each
# half as float32, then the 32 quants as int8, the union of the formats above (block_parts). Fused projections
# whose parts a GGUF stores in different formats (Q4_K_M: a Q6_K attn_v beside Q4_K attn_q and attn_k) are
# converted to it, as are Q5_K rows.


def qx_rows(kind: str, blocks: np.ndarray) -> np.ndarray:
    """GGUF blocks of `kind` -> QX blocks [n, k / 32, 48] uint8 with the same weights."""
    d, m, q = block_parts(kind, blocks)
    head = np.concatenate([d, m], axis=-1).astype(np.float32).view(np.uint8)  # [n, k / 32, 16]
    return np.ascontiguousarray(np.concatenate([head, q.view(np.uint8)], axis=-1))


def _pack_k_numpy(kind: str, blocks: np.ndarray) -> Packed:
    """GGUF Q4_K / Q6_K super-blocks (_pack_super), or Q5_K super-blocks or QX rows, -> Packed [k, n] (Q5_K as
    QX: per block of 32 inputs the float32 scales and offsets of each half, int8 quants): each weight rebuilds
    to the value gguf.quants dequantizes."""
    import paddle

    if kind in SUPER_KINDS:
        return _pack_super(kind, blocks)
    if kind == "QX":
        head = blocks[..., :16].copy().view(np.float32)  # [n, kb, 4]: d of each half, then m
        d, m, q = head[..., :2], head[..., 2:], blocks[..., 16:].view(np.int8)
    else:
        d, m, q = block_parts(kind, blocks)
    n, kb, _ = q.shape
    by_panel = _by_panel(n, kb)
    cols = by_panel(q).swapaxes(2, 3)  # [panels, kb, 32 inputs, 32 columns]
    # [panels, kb, 128] each
    head = [np.ascontiguousarray(by_panel(h), np.float32).view(np.uint8)
            for h in (d[..., 0], d[..., 1], m[..., 0], m[..., 1])]
    quants = cols.reshape(*cols.shape[:2], 1024)
    packed = np.concatenate(head + [np.ascontiguousarray(quants).view(np.uint8)], axis=-1)
    return Packed(paddle.to_tensor(np.ascontiguousarray(packed)), kb * 32, n, "QX")


def _by_panel(n: int, kb: int):
    """[n, kb, ...] -> [panels, kb, 32 columns, ...], zero columns padding n to a multiple of 32 (zero
    scales: zero weights)."""
    panels = -(-n // PANEL)
    pad = panels * PANEL - n

    def by_panel(a: np.ndarray) -> np.ndarray:
        a = np.concatenate([a, np.zeros((pad, *a.shape[1:]), a.dtype)]) if pad else a
        return a.reshape(panels, PANEL, kb, *a.shape[2:]).swapaxes(1, 2)
    return by_panel


def _int8_lanes(u: np.ndarray, nibbles: bool) -> np.ndarray:
    """Unsigned quants [panels, kb, 32 columns, 32 inputs] -> the integer-product layout's bytes per block
    [panels, kb, 1024] (nibbles: 512): per group g of 4 inputs, columns 0-15 then 16-31, each column's 4
    inputs in 4 bytes (nibbles: columns c and c + 16 share a byte, c in the low nibble)."""
    panels, kb = u.shape[:2]
    # [panels, kb, column half h, column c, group g, input j] -> [.., g, h, c, j]
    u = u.reshape(panels, kb, 2, 16, 8, 4).transpose(0, 1, 4, 2, 3, 5)
    if nibbles:
        u = u[:, :, :, 0] | (u[:, :, :, 1] << 4)
    return u.reshape(panels, kb, -1)


def _q6_high(high: np.ndarray) -> np.ndarray:
    """Q6_K's high 2 bits [panels, kb, 32 columns, 32 inputs] -> the integer layout's 256 bytes per block: per
    group g of 4 inputs, 32 bytes; position b = 4 (c % 16) + j of the group's bytes of columns c < 16 (h = 0)
    or c >= 16 (h = 1) at bits 2 (b // 32) + 4 h of byte b % 32 (linear.cc, repacked_quant)."""
    panels, kb = high.shape[:2]
    x = high.reshape(panels, kb, 2, 16, 8, 4).transpose(0, 1, 4, 2, 3, 5)  # [.., g, h, c % 16, j]
    x = x.reshape(panels, kb, 8, 2, 2, 32).astype(np.uint8)  # [.., g, h, b // 32, b % 32]
    shift = (2 * np.arange(2)[None, :] + 4 * np.arange(2)[:, None]).astype(np.uint8)  # [h, b // 32]
    return (x << shift[:, :, None]).sum(axis=(3, 4), dtype=np.uint8).reshape(panels, kb, 256)


def _q6_unsigned(quants: np.ndarray) -> np.ndarray:
    """_pack_super's integer Q6_K quants [panels, kb, 768] -> u = q + 32 [panels, kb, 32 inputs, 32
    columns]."""
    panels, kb = quants.shape[:2]
    raw = quants[..., :512].reshape(panels, kb, 8, 16, 4)  # [.., g, c, j]
    low = np.stack([raw & 0xF, raw >> 4], axis=3)  # [.., g, h, c, j]
    h = quants[..., 512:].reshape(panels, kb, 8, 1, 1, 32)
    shift = (2 * np.arange(2)[None, :] + 4 * np.arange(2)[:, None]).astype(np.uint8)[:, :, None]
    high = ((h >> shift) & 3).reshape(panels, kb, 8, 2, 16, 4)  # [.., g, h, c, j]
    return (low | high << 4).transpose(0, 1, 2, 5, 3, 4).reshape(panels, kb, 32, 32)


def _pack_super(kind: str, blocks: np.ndarray, int8_product: bool = False) -> Packed:
    """GGUF Q4_K / Q6_K super-blocks [n, k / 256, bytes] -> Packed [k, n] whose panels keep them: per panel
    and super-block, SUPER_KINDS[kind] bytes of the 32 columns' fp16 scales (Q4_K: d, then dmin), then 8
    blocks of 32 inputs, each 64 bytes of the columns' scale bytes (Q4_K: sc, then m; Q6_K: the int8 scales
    of inputs 0-15, then of 16-31) and the quants (Q4_K: 512 bytes of nibbles as _q4_lanes; Q6_K: q - 32 as
    int8, 32 inputs x 32 columns). The array is [panels, k / 32, QUANT_PANEL_BYTES[kind]]: 8 of its rows
    are a super-block. With int8_product the quants are laid out for integer products (_int8_lanes; Q6_K's
    u = q + 32 as its low 4 bits, then _q6_high) and the array is int8 [panels, k / 32, panel_bytes]."""
    import paddle

    supers, scales, q = _k_pieces(kind, blocks)
    n, kb, _ = q.shape
    nb = kb // 8
    by_panel = _by_panel(n, kb)
    by_super = _by_panel(n, nb)
    head = [np.ascontiguousarray(by_super(s)).view(np.uint8) for s in supers]  # [panels, nb, 64] each
    cols = by_panel(q).swapaxes(2, 3)  # [panels, kb, 32 inputs, 32 columns]
    panels = cols.shape[0]
    if int8_product:  # [panels, kb, 32 columns, 32 inputs], unsigned
        u = by_panel(q.view(np.uint8) if kind == "Q4_K" else (q + np.int8(32)).view(np.uint8))  # padding: 0
        quants = (_int8_lanes(u, nibbles=True) if kind == "Q4_K"
                  else np.concatenate([_int8_lanes(u & 0xF, nibbles=True), _q6_high(u >> 4)], axis=-1))
    else:
        quants = (_q4_lanes(cols.astype(np.uint8)) if kind == "Q4_K"
                  else cols.reshape(panels, kb, 1024).view(np.uint8))
    sc = by_panel(scales).swapaxes(2, 3).reshape(panels, kb, 64)  # [.., scale j, column c]
    blk = np.concatenate([sc, quants], axis=-1).reshape(panels, nb, -1)  # 8 blocks a super-block
    packed = np.ascontiguousarray(np.concatenate([*[h.reshape(panels, nb, 64) for h in head], blk], axis=-1))
    packed = packed.reshape(panels, kb, panel_bytes(kind, int8_product))
    return Packed(paddle.to_tensor(packed.view(np.int8) if int8_product else packed), kb * 32, n, kind,
                  int8_product=int8_product)


# A weight of parts (linear.cc, kParts): runs of output columns in different formats, one uint8 tensor: a
# header of int64 count, then per part panels, kind (its block bytes), int8_product and the byte offset of its
# panels, then each part's panels from a 64-aligned offset.
MAX_PARTS = 4
KIND_CODES = {kind: size for kind, size in QUANT_PANEL_BYTES.items() if kind != "Q5_K"}  # float32 products


def pack_parts(parts: list[tuple[str, np.ndarray]], int8_product: bool = False,
               ops: ModuleType | None = None) -> Packed:
    """Row runs of a fused projection stored in different formats, [(kind, GGUF blocks [rows, k / block
    weights, bytes])], in output order (every run but the last a multiple of 32 rows), -> one Packed weight
    of parts: each run packed in its own format (pack_quantized; integer products for the kinds that have them
    with int8_product), so a Q4_K_M file's QKV reads Q4_K's and Q6_K's bytes instead of QX's 12 bits a
    weight."""
    import paddle

    if not 1 <= len(parts) <= MAX_PARTS or any(len(b) % PANEL for _, b in parts[:-1]):
        raise ValueError("a weight of parts needs 1 to 4 runs, each but the last of whole panels")
    packed = [pack_quantized(kind, blocks, int8_product and kind in INT8_KINDS, ops)
              for kind, blocks in parts]
    header = 8 * (1 + 4 * len(packed))
    offset = -(-header // 64) * 64
    head, pieces = [len(packed)], []
    for p in packed:  # each part's bytes from a 64-aligned offset; one copy of them all (paddle.concat)
        size = int(np.prod(p.panels.shape))
        head += [p.panels.shape[0], panel_bytes(p.kind, p.int8_product), int(p.int8_product), offset]
        pieces += [p.panels.view(paddle.uint8).reshape([-1]), paddle.zeros([-size % 64], dtype="uint8")]
        offset += size + -size % 64
    start = np.zeros(-(-header // 64) * 64, np.uint8)
    start[:header] = np.array(head, np.int64).view(np.uint8)
    out = paddle.concat([paddle.to_tensor(start), *pieces])
    return Packed(out, packed[0].k, sum(len(b) for _, b in parts), "+".join(p.kind for p in packed))


def _parts(raw: np.ndarray, k: int) -> list[Packed]:
    """The parts of a weight of parts' bytes (pack_parts), each as a Packed over a copy of its panels (whole
    panels: 32 columns each)."""
    import paddle

    count = int(raw[:8].view(np.int64)[0])
    head = raw[8:8 * (1 + 4 * count)].view(np.int64).reshape(count, 4)
    kinds = {code: kind for kind, code in [*KIND_CODES.items(), *INT8_PANEL_BYTES.items()]}
    out = []
    for panels, code, int8, at in head.tolist():
        kind = kinds[code]
        size = panels * (k // 32) * code
        p = raw[at:at + size].reshape(panels, k // 32, code)
        out.append(Packed(paddle.to_tensor(p.view(np.int8) if int8 else p.copy()), k, panels * PANEL, kind,
                          int8_product=bool(int8)))
    return out


# Block kinds whose LM head specgen_forward can screen for greedy tokens (linear.cc, "Greedy tokens without
# the logits"): weights d * q, with no offset term, so the integer products' error has a bound per block.
SCREENED_KINDS = ("Q8_0", "Q4_0", "Q6_K")


@dataclass
class Screen:
    """What specgen_forward needs to give a quantized LM head's greedy tokens without its logits: the same
    blocks as integer-product panels, and per panel, block of 32 inputs and column, |d| * sum |q| (float32
    [panels, k / 32, 32]; exact: an fp16 scale times an integer below 2^12; Q6_K: |d sc| sum |q| of each half
    block, summed, rounded as numpy rounds them)."""

    panels: Packed
    bound: object  # paddle.Tensor


def pack_screen(kind: str, blocks: np.ndarray, ops: ModuleType | None = None) -> Screen:
    """A GGUF Q8_0 / Q4_0 weight, uint8 blocks [n (out), k / 32, block bytes], or Q6_K super-blocks [n,
    k / 256, bytes], -> its Screen (in one C++ pass with `ops`, else in numpy: the same bytes). Q6_K's C sums
    both halves of a block: |d sc_0| sum |q| + |d sc_1| sum |q|."""
    import paddle

    if kind not in SCREENED_KINDS:
        raise ValueError(f"no greedy screen for {kind!r} blocks (only {', '.join(SCREENED_KINDS)})")
    n = blocks.shape[0]
    kb = blocks.shape[1] * (8 if kind in SUPER_KINDS else 1)  # blocks of 32 inputs
    # panels and bound in one C++ pass (the numpy below: ~0.4 s for the default model's head)
    if ops is not None:
        from specgen.kernels.args import pack_blocks

        panels, bound = pack_blocks(ops, cpu_view(blocks), True, True)
        return Screen(Packed(panels, kb * 32, n, kind, int8_product=True), bound.reshape([-1, kb, PANEL]))
    if kind == "Q6_K":
        d, _, q = block_parts(kind, blocks)  # [n, kb, 2] exact d sc, [n, kb, 32]
        sums = np.abs(q.astype(np.int32)).reshape(n, kb, 2, 16).sum(-1).astype(np.float32)  # [n, kb, 2]
        bound = np.abs(d[..., 0]) * sums[..., 0] + np.abs(d[..., 1]) * sums[..., 1]
        ints = _pack_super(kind, blocks, int8_product=True)
    else:
        d = np.abs(np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0].astype(np.float32))
        byte = np.arange(256)
        if kind == "Q8_0":  # |q| of each quant byte (int8)
            table = np.abs(byte.astype(np.uint8).view(np.int8).astype(np.int32))
        else:  # |low nibble - 8| + |high nibble - 8|
            table = np.abs((byte & 0xF) - 8) + np.abs((byte >> 4) - 8)
        bound = d * table.astype(np.uint8)[blocks[..., 2:]].sum(-1, dtype=np.int32).astype(np.float32)
        ints = _pack_quantized_numpy(kind, blocks, int8_product=True)
    panels = -(-n // PANEL)  # bound [n, kb] -> [panels, kb, 32]
    bound = np.concatenate([bound, np.zeros((panels * PANEL - n, kb), np.float32)])
    bound = np.ascontiguousarray(bound.reshape(panels, PANEL, kb).transpose(0, 2, 1))  # [panels, kb, 32]
    return Screen(ints, paddle.to_tensor(bound))


def _q4_lanes(q: np.ndarray) -> np.ndarray:
    """Nibbles [panels, kb, 32 inputs, 32 columns] -> the float32-product layout's 512 bytes per block: per
    group g of 8 inputs and half h of the columns, one little-endian 32-bit lane per column c, input 8g + j in
    its bits 4j .. 4j + 3 (linear.cc, q4_nibble)."""
    panels, kb = q.shape[:2]
    q = q.reshape(panels, kb, 4, 8, 2, 16).transpose(0, 1, 2, 4, 5, 3)  # [.., g, h, c, j]
    return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8).reshape(panels, kb, 512)


def _q4_nibbles(raw: np.ndarray) -> np.ndarray:
    """_q4_lanes' inverse: [panels, kb, 512] bytes -> nibbles [panels, kb, 32 inputs, 32 columns]."""
    panels, kb = raw.shape[:2]
    b = raw.reshape(panels, kb, 4, 2, 16, 4)  # [.., g, h, c, byte]
    q = np.stack([b & 0xF, b >> 4], axis=-1).reshape(panels, kb, 4, 2, 16, 8)  # [.., g, h, c, j]
    return q.transpose(0, 1, 2, 5, 3, 4).reshape(panels, kb, 32, 32)


def _float_layout(p: np.ndarray, kind: str) -> np.ndarray:
    """Integer-product panels (as uint8) -> the same weights in the float32-product layout."""
    panels, kb, _ = p.shape
    if kind in SUPER_KINDS:  # each block's 64 scale bytes and quants as a Q4_0 / Q8_0 block's head and quants
        head = SUPER_KINDS[kind]
        s = p.reshape(panels, kb // 8, -1)
        blk = s[..., head:].reshape(panels, kb, -1)
        if kind == "Q4_K":
            blk = _float_layout(blk, "Q4_0")
        else:  # q = u - 32, one int8 per input row
            q = (_q6_unsigned(blk[..., 64:]).astype(np.int16) - 32).astype(np.int8).view(np.uint8)
            blk = np.concatenate([blk[..., :64], q.reshape(panels, kb, 1024)], axis=-1)
        out = np.concatenate([s[..., :head], blk.reshape(panels, kb // 8, -1)], axis=-1)
        return out.reshape(panels, kb, QUANT_PANEL_BYTES[kind])
    head = p[..., :128 if kind == "Q4_1" else 64]
    if kind == "Q8_0":
        u = p[..., 64:].reshape(panels, kb, 8, 2, 16, 4)  # [.., g, h, c, j]
        q = (u.astype(np.int16) - 128).astype(np.int8).view(np.uint8)
        q = q.transpose(0, 1, 2, 5, 3, 4).reshape(panels, kb, 1024)  # [.., input 4g + j, column 16h + c]
        return np.concatenate([head, q], axis=-1)
    raw = p[..., -512:].reshape(panels, kb, 8, 16, 4)  # [.., g, c, j]
    q = np.stack([raw & 0xF, raw >> 4], axis=3)  # [.., g, h, c, j]
    q = q.transpose(0, 1, 2, 5, 3, 4).reshape(panels, kb, 32, 32)  # [.., input 4g + j, column 16h + c]
    return np.concatenate([head, _q4_lanes(q)], axis=-1)


def _dequantize_panels(p: np.ndarray, kind: str) -> np.ndarray:
    """uint8 panels [panels, k / 32, bytes] -> float32 [panels, k, 32], with gguf.quants' float32
    arithmetic."""
    panels, kb, _ = p.shape
    if kind == "QX":  # w = d q + m per half, d q exact
        d0, d1, m0, m1 = (p[..., a:a + 128].copy().view(np.float32)[:, :, None, :]
                          for a in (0, 128, 256, 384))
        q = p[..., 512:].copy().view(np.int8).reshape(panels, kb, 32, 32).astype(np.float32)
        w = np.concatenate([q[:, :, :16] * d0 + m0, q[:, :, 16:] * d1 + m1], axis=2)
        return w.reshape(panels, kb * 32, PANEL)
    if kind in SUPER_KINDS:  # _pack_super's layout
        head = SUPER_KINDS[kind]
        s = p.reshape(panels, kb // 8, -1)
        sup = s[..., :head].copy().view(np.float16).astype(np.float32).reshape(panels, kb // 8, 1, -1, 32)
        blk = s[..., head:].reshape(panels, kb, -1)  # [.., 64 scale bytes, quants]
        sc = blk[..., :64].reshape(panels, kb // 8, 8, 2, 32)  # [.., block, scale j, column]
        if kind == "Q4_K":  # d sc, -(dmin m): exact products
            d = (sup[..., 0, :] * sc[..., 0, :]).reshape(panels, kb, 1, 32)
            e = -(sup[..., 1, :] * sc[..., 1, :]).reshape(panels, kb, 1, 32)
            w = d * _q4_nibbles(blk[..., 64:]).astype(np.float32) + e
        else:  # (d sc) q, a scale per 16 inputs
            d = (sup * sc.view(np.int8).astype(np.float32)).reshape(panels, kb, 2, 1, 32)
            q = blk[..., 64:].view(np.int8).reshape(panels, kb, 2, 16, 32).astype(np.float32)
            w = q * d
        return w.reshape(panels, kb * 32, PANEL)
    d = p[..., :64].copy().view(np.float16).astype(np.float32)[:, :, None, :]  # [panels, kb, 1, 32]
    if kind == "Q8_0":
        q = p[..., 64:].copy().view(np.int8).reshape(panels, kb, 32, 32).astype(np.float32)
        w = q * d
    else:
        q = _q4_nibbles(p[..., -512:]).astype(np.float32)  # [panels, kb, 32 inputs, 32 columns]
        if kind == "Q4_0":
            w = d * (q - np.float32(8))
        else:
            m = p[..., 64:128].copy().view(np.float16).astype(np.float32)[:, :, None, :]
            w = d * q + m
    return w.reshape(panels, kb * 32, PANEL)


def dense(w):
    """A weight as a dense paddle tensor [k, n], whether or not it is packed."""
    return w.dense() if isinstance(w, Packed) else w
