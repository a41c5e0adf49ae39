"""The fused CPU operators (specgen/kernels) against their references: numpy and the model's Paddle path."""
import numpy as np
import paddle
import paddle.nn.functional as F
import pytest
from conftest import TINY, TINY_ARCHS

from specgen import load_model
from specgen.kernels import has_vnni, ops
from specgen.layers.norm import rms_norm
from specgen.runtime.batch import build_forward_batch

K = ops()
NO_SAMPLE = paddle.zeros([0], dtype="float64")  # specgen_screened_argmax: greedy rows
pytestmark = pytest.mark.skipif(K is None,
                                reason="fused CPU kernels not built (no C++ compiler or not on CPU)")


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_norms_and_silu_match_reference(dtype):
    rng = np.random.default_rng(0)
    x, r = (paddle.to_tensor(rng.standard_normal((7, 48)).astype(dtype)) for _ in range(2))
    w = paddle.to_tensor(rng.random(48).astype(dtype))
    tol = 1e-6 if dtype == "float32" else 1e-14
    assert float((K.specgen_rms_norm(x, w, 1e-5) - rms_norm(x, w, 1e-5)).abs().max()) <= tol
    s, n = K.specgen_add_rms_norm(x, r, w, 1e-5)
    assert float((s - (x + r)).abs().max()) == 0.0
    assert float((n - rms_norm(x + r, w, 1e-5)).abs().max()) <= tol
    gu = paddle.to_tensor(rng.standard_normal((5, 64)).astype(dtype))
    assert float((K.specgen_silu_mul(gu) - F.silu(gu[:, :32]) * gu[:, 32:]).abs().max()) <= tol
    # a width that is not a multiple of 16 lanes, and gates far out in both tails (e^-g over- and underflows)
    g = rng.standard_normal((6, 90)) * 40
    out = K.specgen_silu_mul(paddle.to_tensor(g.astype(dtype))).numpy()
    want = g[:, :45] / (1 + np.exp(-g[:, :45])) * g[:, 45:]
    assert np.all(np.isfinite(out)) and np.abs(out - want).max() <= tol * np.abs(want).max()


def _numpy_attention(qkv, cos, sin, pos, slots, kc, vc, H, KV, cap):
    """Straightforward reference: RoPE, cache write, causal softmax attention per token (float64)."""
    n, D = len(pos), kc.shape[1]
    G, half = H // KV, D // 2
    x = qkv.reshape(n, H + 2 * KV, D).astype(np.float64)
    c, s = cos[pos][:, None, :], sin[pos][:, None, :]
    rot = np.concatenate([x[..., :half] * c - x[..., half:] * s, x[..., half:] * c + x[..., :half] * s],
                         axis=-1)
    q, k, v = rot[:, :H] / np.sqrt(D), rot[:, H:H + KV], x[:, H + KV:]
    kc, vc = kc.astype(np.float64).copy(), vc.astype(np.float64).copy()
    for t in range(n):
        for h in range(KV):
            row = (slots[t] * KV + h) * cap + pos[t]
            kc[row], vc[row] = k[t, h], v[t, h]
    out = np.zeros((n, H, D))
    for t in range(n):
        for h in range(H):
            base = (slots[t] * KV + h // G) * cap
            sc = kc[base: base + pos[t] + 1] @ q[t, h]
            p = np.exp(sc - sc.max())
            out[t, h] = (p / p.sum()) @ vc[base: base + pos[t] + 1]
    return out.reshape(n, H * D), kc, vc


@pytest.mark.parametrize("D,H,KV", [(64, 9, 3), (24, 4, 2), (32, 4, 4), (128, 4, 2)])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_attention_matches_numpy_and_writes_the_cache(D, H, KV, dtype):
    """Ragged blocks: a 21-token prompt (several tiles), a 6-token verify block, a 1-token decode, and a
    block of another slot sitting between two blocks of... distinct slots at unrelated positions."""
    rng = np.random.default_rng(D + H)
    cap, num_slots = 64, 4
    slots = np.array([2] * 21 + [0] * 6 + [3] + [1] * 2, np.int64)
    pos = np.concatenate([np.arange(21), np.arange(30, 36), [40], [5, 6]]).astype(np.int64)
    qkv = rng.standard_normal((len(pos), (H + 2 * KV) * D)).astype(dtype)
    ang = np.arange(cap)[:, None] * (1e4 ** (-np.arange(0, D, 2) / D))[None, :]
    cos, sin = np.cos(ang).astype(dtype), np.sin(ang).astype(dtype)
    kc = rng.standard_normal((num_slots * KV * cap, D)).astype(dtype)  # stale history the queries also read
    vc = rng.standard_normal((num_slots * KV * cap, D)).astype(dtype)
    want, want_k, want_v = _numpy_attention(qkv, cos, sin, pos, slots, kc, vc, H, KV, cap)
    pk, pv = paddle.to_tensor(kc), paddle.to_tensor(vc)
    ones = paddle.ones([D], dtype=dtype)
    got = K.specgen_attention(paddle.to_tensor(qkv), paddle.to_tensor(cos), paddle.to_tensor(sin),
                              paddle.to_tensor(pos), paddle.to_tensor(slots), pk, pv, ones, ones,
                              paddle.zeros([len(pos)], dtype="int64"), ones, ones, H, KV, cap, False, 1e-6, 0)
    got = got[0] if isinstance(got, (list, tuple)) else got
    tol = 2e-5 if dtype == "float32" else 1e-12
    assert np.abs(got.numpy() - want).max() <= tol
    assert np.abs(pk.numpy() - want_k).max() <= tol  # written in place
    assert np.abs(pv.numpy() - want_v).max() == 0.0


def test_attention_rows_do_not_depend_on_the_rest_of_the_batch():
    """A token's output is bit-identical whether it runs alone or packed with other slots' blocks."""
    rng = np.random.default_rng(1)
    H, KV, D, cap = 9, 3, 64, 64
    kc0 = rng.standard_normal((3 * KV * cap, D)).astype(np.float32)
    vc0 = rng.standard_normal((3 * KV * cap, D)).astype(np.float32)
    cos = paddle.to_tensor(rng.random((cap, D // 2)).astype(np.float32))
    sin = paddle.to_tensor(rng.random((cap, D // 2)).astype(np.float32))
    ones = paddle.ones([D])
    qkv = rng.standard_normal((9, (H + 2 * KV) * D)).astype(np.float32)
    slots = np.array([0, 1, 1, 1, 1, 1, 1, 2, 2], np.int64)
    pos = np.array([7, 20, 21, 22, 23, 24, 25, 3, 4], np.int64)

    def run(rows):
        out = K.specgen_attention(paddle.to_tensor(qkv[rows]), cos, sin, paddle.to_tensor(pos[rows]),
                                  paddle.to_tensor(slots[rows]), paddle.to_tensor(kc0), paddle.to_tensor(vc0),
                                  ones, ones, paddle.zeros([len(rows)], dtype="int64"), ones, ones,
                                  H, KV, cap, False, 1e-6, 0)
        return (out[0] if isinstance(out, (list, tuple)) else out).numpy()

    together = run(np.arange(9))
    assert np.array_equal(run(np.array([0])), together[:1])
    assert np.array_equal(run(np.arange(1, 7)), together[1:7])
    assert np.array_equal(run(np.arange(1, 2)), together[1:2])  # first token of the block alone
    # Work items are each run exactly once: `omp for schedule(dynamic)` under libiomp5 gave one item to two
    # threads, which corrupted a merged row about 1 call in 20 (alternating these two calls showed it).
    for _ in range(100):
        assert np.array_equal(run(np.arange(9)), together)
        assert np.array_equal(run(np.array([0])), together[:1])


@pytest.mark.parametrize("D", [64, 24])
def test_shared_prefix_attention_equals_a_private_copy(D):
    """Cascade attention: keys [0, p) from the shared prefix cache, the rest from the slot's rows shifted by
    p, gives bit-identical outputs to the same keys held privately; own K/V land at row position - p."""
    rng = np.random.default_rng(D)
    H, KV, cap, P = 4, 2, 32, 10
    prefix_k = rng.standard_normal((KV * 16, D)).astype(np.float32)  # prefix capacity 16, P = 10 used
    prefix_v = rng.standard_normal((KV * 16, D)).astype(np.float32)
    own_k = rng.standard_normal((2 * KV * cap, D)).astype(np.float32)
    own_v = rng.standard_normal((2 * KV * cap, D)).astype(np.float32)
    # the private layout: slot s holds prefix rows [0, P) then its own rows
    priv_k, priv_v = own_k.copy(), own_v.copy()
    for s in range(2):
        for h in range(KV):
            base = (s * KV + h) * cap
            priv_k[base + P: base + cap] = own_k[base: base + cap - P]
            priv_v[base + P: base + cap] = own_v[base: base + cap - P]
            priv_k[base: base + P] = prefix_k[h * 16: h * 16 + P]
            priv_v[base: base + P] = prefix_v[h * 16: h * 16 + P]
    slots = np.array([0, 0, 0, 1], np.int64)
    pos = np.array([12, 13, 14, 20], np.int64)
    qkv = paddle.to_tensor(rng.standard_normal((4, (H + 2 * KV) * D)).astype(np.float32))
    cos = paddle.to_tensor(rng.random((cap, D // 2)).astype(np.float32))
    sin = paddle.to_tensor(rng.random((cap, D // 2)).astype(np.float32))
    ones = paddle.ones([D])
    args = (paddle.to_tensor(pos), paddle.to_tensor(slots))
    kc, vc = paddle.to_tensor(priv_k), paddle.to_tensor(priv_v)
    want = K.specgen_attention(qkv, cos, sin, *args, kc, vc, ones, ones, paddle.zeros([4], dtype="int64"),
                               ones, ones, H, KV, cap, False, 1e-6, 0)
    sk, sv = paddle.to_tensor(own_k), paddle.to_tensor(own_v)
    got = K.specgen_attention(qkv, cos, sin, *args, sk, sv, ones, ones, paddle.full([4], P, dtype="int64"),
                              paddle.to_tensor(prefix_k), paddle.to_tensor(prefix_v),
                              H, KV, cap, False, 1e-6, 16)
    first = lambda r: r[0] if isinstance(r, (list, tuple)) else r  # noqa: E731
    assert np.array_equal(first(got).numpy(), first(want).numpy())
    for t in range(4):
        for h in range(KV):
            row = (slots[t] * KV + h) * cap
            assert np.array_equal(sk.numpy()[row + pos[t] - P], kc.numpy()[row + pos[t]])


@pytest.mark.parametrize("k,n", [(576, 960), (1536, 576), (7, 45), (64, 33), (32, 32)])
def test_packed_linear_matches_numpy_and_rows_do_not_depend_on_each_other(k, n):
    """specgen_linear over a packed weight: pack/unpack round trip, float64 reference, and each row's result
    bit-identical whatever rows come with it (1 to 41 rows, any offset, row groups of any balance) - the
    property that keeps float32 speculation exact."""
    from specgen.kernels import pack_linear

    rng = np.random.default_rng(k + n)
    w = rng.standard_normal((k, n)).astype(np.float32)
    p = pack_linear(paddle.to_tensor(w))
    assert p.panels.shape == [-(-n // 32), k, 32] and np.array_equal(p.numpy(), w)
    x = rng.standard_normal((41, k)).astype(np.float32)
    y = K.specgen_linear(paddle.to_tensor(x), p.panels, n).numpy()
    ref = x.astype(np.float64) @ w.astype(np.float64)
    assert y.shape == (41, n)
    assert np.abs(y - ref).max() <= 1e-6 * np.sqrt(k) * np.abs(ref).max() + 1e-6
    for m, at in [(1, 0), (1, 40), (3, 5), (6, 2), (8, 12), (9, 0), (15, 4), (17, 20), (33, 7)]:
        part = K.specgen_linear(paddle.to_tensor(x[at:at + m]), p.panels, n).numpy()
        assert np.array_equal(part, y[at:at + m]), (m, at)
    assert K.specgen_linear(paddle.to_tensor(x[:0]), p.panels, n).shape == [0, n]


def _random_blocks(rng: np.random.Generator, kind: str, k: int, n: int, tiny: float = 0.0) -> np.ndarray:
    """Random GGUF blocks of `kind` [n, k / block weights, block bytes] whose fp16 scales (d; Q4_1: and m;
    Q4_K: and dmin) are finite values of either sign, a `tiny` fraction of them subnormal."""
    from specgen.models.checkpoint import QUANT_BLOCK_BYTES, QUANT_BLOCK_WEIGHTS

    nb = k // QUANT_BLOCK_WEIGHTS[kind]
    blocks = rng.integers(0, 256, (n, nb, QUANT_BLOCK_BYTES[kind]), dtype=np.uint8)
    at = {"Q4_1": slice(0, 4), "Q4_K": slice(0, 4), "Q6_K": slice(208, 210)}.get(kind, slice(0, 2))
    count = (at.stop - at.start) // 2
    halves = (rng.standard_normal((n, nb, count)) * np.where(rng.random((n, nb, 1)) < tiny, 1e-6, 0.05))
    blocks[..., at] = halves.astype(np.float16).view(np.uint8).reshape(n, nb, 2 * count)
    return blocks


@pytest.mark.parametrize("kind,k,n", [("Q4_1", 576, 960), ("Q4_1", 64, 45), ("Q4_0", 96, 70),
                                      ("Q8_0", 576, 33), ("Q4_K", 512, 70), ("Q6_K", 768, 45)])
def test_quantized_linear_equals_float32_over_the_dequantized_weight(kind, k, n):
    """specgen_linear over GGUF blocks packed by pack_quantized: the packed blocks dequantize to exactly what
    gguf.quants gives, and every product (1 to 41 rows: the in-register path up to 8 rows; beyond, a first
    group in registers that keeps the rebuilt panel and balanced groups over it) is bit-identical to
    specgen_linear over that float32 weight. K-quants keep their super-blocks (fp16 scales per 256 inputs,
    scale bytes per 32): ~4.6 bits a weight for Q4_K, ~8.6 for Q6_K."""
    import gguf
    from gguf.quants import dequantize

    from specgen.kernels import pack_linear, pack_quantized

    rng = np.random.default_rng(k + n)
    blocks = _random_blocks(rng, kind, k, n, tiny=0.1)
    w = dequantize(blocks.reshape(n, -1), gguf.GGMLQuantizationType[kind]).reshape(n, k).T.astype(np.float32)
    q = pack_quantized(kind, blocks)
    bytes_per_block = {"Q4_0": 576, "Q4_1": 640, "Q8_0": 1088, "Q4_K": 592, "Q6_K": 1096}[kind]
    assert q.panels.dtype == paddle.uint8 and q.panels.shape == [-(-n // 32), k // 32, bytes_per_block]
    assert np.array_equal(q.numpy().view(np.uint32), w.view(np.uint32))  # zeros' signs too
    f = pack_linear(w, halves=False)
    x = rng.standard_normal((41, k)).astype(np.float32)
    y = K.specgen_linear(paddle.to_tensor(x), q.panels, n).numpy()
    assert np.array_equal(y, K.specgen_linear(paddle.to_tensor(x), f.panels, n).numpy())
    for m, at in [(1, 0), (1, 40), (2, 3), (3, 38), (5, 5), (6, 2), (7, 30), (8, 12), (9, 0), (16, 4),
                  (17, 20), (26, 15)]:
        part = K.specgen_linear(paddle.to_tensor(x[at:at + m]), q.panels, n).numpy()
        assert np.array_equal(part, y[at:at + m]), (m, at)
    with pytest.raises(OSError, match="not a quantized"):
        K.specgen_linear(paddle.to_tensor(x[:, :k - 32]), q.panels, n)  # blocks for k inputs, not k - 32


@pytest.mark.parametrize("kind,k,n", [("float32", 576, 960), ("float32", 64, 45), ("Q4_1", 576, 70),
                                       ("Q8_0", 96, 33), ("Q4_0", 64, 32), ("Q4_K", 256, 70),
                                       ("Q6_K", 256, 33)])
def test_wide_linear_equals_the_one_panel_path(kind, k, n):
    """Past 16 rows specgen_linear multiplies two panels at a time in chunks of 48 rows (wide_linear); its
    products for 130 rows (three chunks; an odd panel count, a partial last panel, one panel alone) are
    bit-identical to each row computed alone (one row: the one-panel path), and each row's result is the same
    whatever rows come with it (17 to 130 rows, any offset)."""
    import gguf
    from gguf.quants import dequantize

    from specgen.kernels import pack_linear, pack_quantized

    rng = np.random.default_rng(k + n)
    if kind == "float32":
        w = rng.standard_normal((k, n)).astype(np.float32)
        panels = pack_linear(paddle.to_tensor(w)).panels
    else:
        blocks = _random_blocks(rng, kind, k, n)
        w = dequantize(blocks.reshape(n, -1),
                       gguf.GGMLQuantizationType[kind]).reshape(n, k).T.astype(np.float32)
        panels = pack_quantized(kind, blocks).panels
    x = rng.standard_normal((130, k)).astype(np.float32)
    y = K.specgen_linear(paddle.to_tensor(x), panels, n).numpy()
    ref = x.astype(np.float64) @ w.astype(np.float64)
    assert np.abs(y - ref).max() <= 1e-6 * np.sqrt(k) * np.abs(ref).max() + 1e-6
    alone = np.concatenate([K.specgen_linear(paddle.to_tensor(x[r:r + 1]), panels, n).numpy()
                            for r in range(130)])
    assert np.array_equal(alone, y)
    for m, at in [(17, 0), (18, 100), (47, 3), (48, 50), (49, 81), (97, 33), (130, 0)]:
        part = K.specgen_linear(paddle.to_tensor(x[at:at + m]), panels, n).numpy()
        assert np.array_equal(part, y[at:at + m]), (m, at)


def _int8_product_reference(x: np.ndarray, blocks: np.ndarray, kind: str) -> np.ndarray:
    """The integer product's definition (linear.cc, "Integer products") in numpy: x [m, k] float32 quantized
    per block of 32 inputs (dx = max |x| / 127, xq = round-to-even(x / dx) through a float32 reciprocal, sx =
    the block's sum in input order); then per block, in block order, acc = fma(sum u xq - offset sum xq, d dx,
    acc) (Q4_1: then acc = fma(m, sx, acc)); K-quants with their scale products (Q4_K: m = -(dmin m);
    Q6_K: per half of the block). An FMA is emulated in float64, where a product of two float32s is exact."""
    from specgen.kernels import block_parts

    m_rows = x.shape[0]
    kb = x.shape[1] // 32
    xb = x.reshape(m_rows, kb, 32)
    dx = (np.abs(xb).max(axis=-1) / np.float32(127)).astype(np.float32)  # [m, kb]
    inv = np.where(dx > 0, np.float32(1) / np.where(dx > 0, dx, np.float32(1)),
                   np.float32(0)).astype(np.float32)
    xq = np.clip(np.rint((xb * inv[..., None]).astype(np.float32)), -127, 127).astype(np.int64)  # [m, kb, 32]
    sx = np.zeros((m_rows, kb), np.float32)
    for i in range(32):  # in input order, as the kernel adds
        sx = (sx + xb[..., i]).astype(np.float32)
    if kind in ("Q4_K", "Q6_K"):  # scales d sc (Q4_K: offsets -(dmin m)); Q6_K a sum and scale per 16 inputs
        # [n, kb, 2], [n, kb, 2], [n, kb, 32] (Q4_K 0..15, Q6_K -32..31)
        d, mins, qk = block_parts(kind, blocks)
        n = d.shape[0]
        halves = 2 if kind == "Q6_K" else 1
        acc = np.zeros((m_rows, n), np.float32)
        for b in range(kb):
            for h in range(halves):
                span = slice(h * 32 // halves, (h + 1) * 32 // halves)
                sums = np.einsum("ci,ri->rc", qk[:, b, span].astype(np.int64), xq[:, b, span])  # exact
                scale = (d[None, :, b, h] * dx[:, b, None]).astype(np.float32)
                acc = (sums.astype(np.float32).astype(np.float64) * scale + acc).astype(np.float32)
                if kind == "Q4_K":
                    acc = (mins[None, :, b, 0].astype(np.float64) * sx[:, b, None] + acc).astype(np.float32)
        return acc
    n = blocks.shape[0]
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [n, kb]
    if kind == "Q8_0":
        u, offset = blocks[..., 2:].view(np.int8).astype(np.int64) + 128, 128
    else:
        qs = blocks[..., 4 if kind == "Q4_1" else 2:].astype(np.int64)
        u, offset = np.concatenate([qs & 0xF, qs >> 4], axis=-1), 8 if kind == "Q4_0" else 0  # [n, kb, 32]
    sums = np.einsum("cbi,rbi->rcb", u, xq) - offset * xq.sum(axis=-1)[:, None, :]  # [m, n, kb] exact
    acc = np.zeros((m_rows, n), np.float32)
    for b in range(kb):
        scale = (d[None, :, b] * dx[:, b, None]).astype(np.float32)  # [m, n]
        acc = (sums[..., b].astype(np.float32).astype(np.float64) * scale + acc).astype(np.float32)
        if kind == "Q4_1":
            mins = blocks[:, b, 2:4].copy().view(np.float16)[:, 0].astype(np.float32)  # [n]
            acc = (mins[None, :].astype(np.float64) * sx[:, b, None] + acc).astype(np.float32)
    return acc


@pytest.mark.parametrize("kind,k,n", [("Q4_1", 576, 70), ("Q4_0", 96, 45), ("Q8_0", 160, 33),
                                      ("Q4_1", 64, 32), ("Q4_K", 512, 70), ("Q6_K", 768, 45)])
def test_int8_products_equal_their_definition(kind, k, n):
    """specgen_linear over blocks packed for integer products (pack_quantized(..., int8_product=True)): the
    repacked quants still rebuild the GGUF reader's float32 weight, every product equals the definition in
    numpy bit for bit (row groups of 1 to 6 and their tails, rows of zeros, a row with one huge input), each
    row's result is the same whatever rows it is computed with, and it stays within the inputs' rounding of
    the float32 product. K-quants keep their super-blocks; Q6_K sums each half of a block apart."""
    if not has_vnni():
        pytest.skip("integer products need AVX-512 VNNI")
    import gguf
    from gguf.quants import dequantize

    from specgen.kernels import pack_quantized

    rng = np.random.default_rng(k + n)
    blocks = _random_blocks(rng, kind, k, n, tiny=0.1)
    w = dequantize(blocks.reshape(n, -1), gguf.GGMLQuantizationType[kind]).reshape(n, k).T.astype(np.float32)
    q = pack_quantized(kind, blocks, int8_product=True)
    assert q.int8_product and q.panels.dtype == paddle.int8 and q.panels.shape == [-(-n // 32), k // 32, {
        "Q4_0": 576, "Q4_1": 640, "Q8_0": 1088, "Q4_K": 592, "Q6_K": 840}[kind]]
    assert np.array_equal(q.numpy().view(np.uint32), w.view(np.uint32))
    x = rng.standard_normal((20, k)).astype(np.float32)
    x[3] = 0.0  # dx = 0: the row's products are 0
    x[7, 5] = 1e4  # one outlier: its block's other inputs round to 0
    y = K.specgen_linear(paddle.to_tensor(x), q.panels, n).numpy()
    assert np.array_equal(y, _int8_product_reference(x, blocks, kind))
    assert not y[3].any()
    for m, at in [(1, 0), (1, 19), (2, 3), (5, 5), (6, 2), (7, 12), (13, 0)]:
        part = K.specgen_linear(paddle.to_tensor(x[at:at + m]), q.panels, n).numpy()
        assert np.array_equal(part, y[at:at + m]), (m, at)
    exact = x.astype(np.float64) @ w.astype(np.float64)
    normal = [r for r in range(20) if r != 7]
    err = np.abs(y[normal] - exact[normal]).max() / np.abs(exact[normal]).max()
    assert 0 < err < 0.02  # the inputs' 8-bit rounding: not float32's, but close
    with pytest.raises(OSError, match="not a quantized"):
        K.specgen_linear(paddle.to_tensor(x[:, :k - 32]), q.panels, n)


def test_a_weight_of_parts_multiplies_each_run_in_its_own_format():
    """pack_parts: runs of output columns in Q4_K, Q6_K and Q8_0 (the last run a partial panel) in one packed
    weight: it dequantizes to the runs' weights side by side; its float32 products (1 to 130 rows: the
    one-panel and the wide paths) are bit-identical to float32 panels over that weight; with integer products
    each run's columns equal that run's own integer product; a malformed header is refused."""
    import gguf
    from gguf.quants import dequantize

    from specgen.kernels import pack_linear, pack_parts, pack_quantized

    rng = np.random.default_rng(1)
    k = 512
    parts = [(kind, _random_blocks(rng, kind, k, n, tiny=0.1)) for kind, n in (("Q4_K", 64), ("Q6_K", 32),
                                                                               ("Q8_0", 45))]
    w = np.concatenate([dequantize(b.reshape(len(b), -1), gguf.GGMLQuantizationType[kind]).reshape(len(b), k)
                        for kind, b in parts]).T.astype(np.float32)
    n = w.shape[1]
    p = pack_parts(parts)
    assert p.kind == "Q4_K+Q6_K+Q8_0" and p.n == n and p.panels.dtype == paddle.uint8
    assert np.array_equal(p.numpy().view(np.uint32), w.view(np.uint32))
    f = pack_linear(w, halves=False)
    x = rng.standard_normal((130, k)).astype(np.float32)
    for m in (1, 5, 8, 9, 17, 41, 130):
        assert np.array_equal(K.specgen_linear(paddle.to_tensor(x[:m]), p.panels, n).numpy(),
                              K.specgen_linear(paddle.to_tensor(x[:m]), f.panels, n).numpy()), m
    if has_vnni():
        q = pack_parts(parts, int8_product=True)
        assert np.array_equal(q.numpy().view(np.uint32), w.view(np.uint32))
        y = K.specgen_linear(paddle.to_tensor(x[:20]), q.panels, n).numpy()
        assert np.array_equal(y, np.concatenate([
            K.specgen_linear(paddle.to_tensor(x[:20]), pack_quantized(kind, b, True).panels, len(b)).numpy()
            for kind, b in parts], axis=1))
    with pytest.raises(OSError, match="output columns"):
        K.specgen_linear(paddle.to_tensor(x[:1]), p.panels, n + 32)
    good = p.panels.numpy()
    head = good[:8 * 13].view(np.int64)  # count 3, then panels, kind, int8, offset of each part
    for at, value in [(4, 7),  # the first part's offset: not 64-aligned
                      (4, 0),  # ... over the header
                      (4, (2**63 - 1) // 64 * 64),  # ... past the end (offset + bytes would overflow)
                      (1, 2**55 * 255), (5, 2**55 * 255),  # panels whose bytes wrap to 0
                      (9, 3),  # 6 panels in all, not 5
                      (2, 592 + 2**32),  # a kind that truncates to Q4_K's
                      (3, 2)]:  # an int8 flag of 2
        bad = good.copy()
        bad[8 * at:8 * at + 8] = np.array([value], np.int64).view(np.uint8)
        with pytest.raises(OSError, match="part of a weight of parts|output columns"):
            K.specgen_linear(paddle.to_tensor(x[:1]), paddle.to_tensor(bad), n)
    assert head[0] == 3 and np.array_equal(head[1:].reshape(3, 4)[:, :3],
                                           [[2, 592, 0], [1, 1096, 0], [2, 1088, 0]])
    with pytest.raises(ValueError, match="whole panels"):
        pack_parts([parts[2], parts[0]])  # a first run of 45 rows


def test_packed_float32_model_rows_equal_whatever_the_block():
    """Float32 with packed weights: a position's hidden state is bit-identical whether it is computed inside a
    whole-prompt prefill or as part of a later verify block beside another slot; and it stays within float32
    rounding of the same model on the reference backend (MKL's matmul)."""
    lm = load_model(TINY / "llama", dtype="float32", backend="fused")
    m = lm.model
    rng = np.random.default_rng(5)
    ids = rng.integers(3, 250, 24)
    whole = build_forward_batch(np.array([0]), np.array([0]), np.array([24]), ids, np.array([False]))
    h_whole = m.forward(whole, m.new_cache(2, 64)).hidden.numpy()
    cache = m.new_cache(2, 64)
    m.forward(build_forward_batch(np.array([0, 1]), np.array([0, 0]), np.array([18, 9]),
                                  np.concatenate([ids[:18], ids[:9]]), np.zeros(2, bool)), cache)
    ver = build_forward_batch(np.array([1, 0]), np.array([9, 18]), np.array([3, 6]),
                              np.concatenate([ids[9:12], ids[18:24]]), np.ones(2, bool))
    h_ver = m.forward(ver, cache).hidden.numpy()
    assert np.array_equal(h_ver[3:], h_whole[18:24])
    assert np.array_equal(h_ver[:3], h_whole[9:12])
    ref = load_model(TINY / "llama", dtype="float32", backend="reference").model
    h_ref = ref.forward(whole, ref.new_cache(2, 64)).hidden.numpy()
    assert np.abs(h_ref - h_whole).max() < 1e-4


def op_by_op_forward(m, batch, cache):
    """The fused backend's forward as its kernels called one at a time (the per-op operators over the same
    packed weights and caches, in specgen_forward's order): (logits, hidden, greedy)."""
    from specgen.backends.reference import reserve

    cfg, w = m.config, m.weights
    reserve(batch, cache)
    eps, n = cfg.rms_norm_eps, len(batch.token_ids)
    ones = paddle.ones([cfg.head_dim], dtype="float32")
    plen = paddle.to_tensor(batch.token_prefix_len if batch.token_prefix_len is not None
                            else np.zeros(n, np.int64))
    pre = cache.prefix

    def linear(x, lin):
        y = K.specgen_linear(x, lin.weight.panels, lin.weight.n)
        y = y[0] if isinstance(y, (list, tuple)) else y
        return y + lin.bias if lin.bias is not None else y

    def first(out):
        return out[0] if isinstance(out, (list, tuple)) else out

    x = F.embedding(paddle.to_tensor(batch.token_ids), w.embed)
    for i, blk in enumerate(w.blocks):
        qkv = linear(first(K.specgen_rms_norm(x, blk.attn_norm, eps)), blk.qkv)
        qk = blk.q_norm is not None
        att = first(K.specgen_attention(
            qkv, m.rope.cos, m.rope.sin,
            paddle.to_tensor(batch.positions), paddle.to_tensor(batch.token_slots),
            cache.k[i], cache.v[i], blk.q_norm if qk else ones, blk.k_norm if qk else ones, plen,
            pre.k[i] if pre is not None else ones, pre.v[i] if pre is not None else ones, cfg.num_heads,
            cfg.num_kv_heads, cache.capacity, qk, eps, pre.capacity if pre is not None else 0))
        x, h = K.specgen_add_rms_norm(x, linear(att, blk.o), blk.mlp_norm, eps)
        x = x + linear(first(K.specgen_silu_mul(linear(h, blk.gate_up))), blk.down)
    hidden = first(K.specgen_rms_norm(x, w.final_norm, eps))
    logits = linear(paddle.gather(hidden, paddle.to_tensor(batch.logit_rows)), w.lm_head)
    return logits, hidden, first(K.specgen_argmax(logits)).numpy()


# MoE: tests/unit/test_moe.py
@pytest.mark.parametrize("arch", [a for a in TINY_ARCHS if not a.endswith("_moe")])
def test_fused_forward_is_bit_identical_to_its_kernels_op_by_op(arch):
    """specgen_forward_bound (embedding, every block, final norm, LM head in one operator, weights and caches
    bound by handle), float32 packed, against the same kernels called one by one: every architecture (biases,
    qk-norm, GQA, interleaved RoPE), prefill then mixed verify/prefill blocks, with and without a shared
    prefix: identical logits, hidden states, greedy tokens and caches, bit for bit."""
    m = load_model(TINY / arch, dtype="float32", backend="fused").model
    rng = np.random.default_rng(7)
    prefix = rng.integers(3, 250, 12)
    pre = build_forward_batch(np.arange(3), np.zeros(3, np.int64), np.array([20, 5, 33]),
                              rng.integers(3, 250, 58), np.zeros(3, bool))
    ver = build_forward_batch(np.array([0, 1, 2, 3]), np.array([20, 5, 33, 0]), np.array([1, 4, 6, 17]),
                              rng.integers(3, 250, 28), np.array([True, True, True, False]))
    tails = rng.integers(3, 250, 9)
    shared = build_forward_batch(np.array([0, 1]), np.array([12, 12]), np.array([4, 5]), tails,
                                 np.zeros(2, bool), prefix_lens=np.array([12, 12]))
    results = []
    for fused in (True, False):
        run = (lambda b, c: tuple(vars(m.forward(b, c)).values())[:3]) if fused else \
            (lambda b, c: op_by_op_forward(m, b, c))
        cache = m.new_cache(4, 64)
        out = [run(b, cache) for b in (pre, ver)]
        pcache = m.new_cache(1, 64)  # the shared prefix's own cache, computed once
        run(build_forward_batch(np.array([0]), np.array([0]), np.array([12]), prefix,
                                np.array([False])), pcache)
        scache = m.new_cache(2, 64)
        scache.prefix = pcache
        out.append(run(shared, scache))
        for logits, _, greedy in out:
            assert np.array_equal(greedy, np.argmax(logits.numpy(), axis=-1))
        # the rows written: positions 0-20, 0-8, 0-38, 0-16 of slots 0-3 (the rest are uninitialized)
        kv = m.config.num_kv_heads
        written = np.concatenate([(s * kv + h) * cache.capacity + np.arange(n)
                                  for s, n in enumerate([21, 9, 39, 17]) for h in range(kv)])
        results.append([np.asarray(t) for triple in out for t in triple]
                       + [c.numpy()[written] for c in cache.k + cache.v])
    for a, b in zip(*results):
        assert np.array_equal(a, b)


def test_bound_forward_follows_a_growing_cache_and_lets_it_go(monkeypatch):
    """specgen_forward_bound holds the cache's tensors by handle: when the cache grows (new tensors) the next
    forward binds the new ones, so a slot that outgrows its cache gets the same bits as in a cache that never
    grew; a dropped cache's binding goes with it."""
    import gc

    from specgen.kernels import args
    from specgen.runtime import kv_cache

    m = load_model(TINY / "llama", dtype="float32", backend="fused").model
    backend = m.backend
    ids = np.random.default_rng(5).integers(3, 250, 256)
    # then a block without logits
    steps = [(0, 50), (50, 1), (51, 30), (81, 6), (87, 100), (187, 3), (190, 6)]
    runs, bindings = {}, []  # every cache binding the growing run made
    for grows in (True, False):
        # 64 -> 128 -> 256 (the tiny model's context), or 256 from the start
        monkeypatch.setattr(kv_cache, "INITIAL_CAPACITY", 64 if grows else 256)
        cache = m.new_cache(1, 512)
        out = []
        for start, n in steps:
            b = build_forward_batch(np.array([0]), np.array([start]), np.array([n]), ids[start:start + n],
                                    np.array([True]))
            o = m.forward(b, cache)
            out += [o.logits.numpy(), o.hidden.numpy(), o.greedy]
            if grows and cache.binding[1] not in bindings:
                bindings.append(cache.binding[1])
        b = build_forward_batch(np.array([0]), np.array([196]), np.array([8]), ids[196:204],
                                np.array([False]), no_logits=np.array([True]))
        o = m.forward(b, cache)
        assert o.logits.shape[0] == 0 and len(o.greedy) == 0
        out += [o.hidden.numpy()]
        assert cache.capacity == 256 and cache.version == (3 if grows else 1)
        runs[grows] = out
        if grows:
            handle = paddle.to_tensor(np.array([cache.binding[1]]))
            cfg = m.config
            with pytest.raises(Exception, match="outside the bound caches"):  # slot 1 of a 1-slot cache
                args.forward_bound(backend.ops, args.StepArgs(
                    index=paddle.to_tensor(np.array([5, 0, 1, 0, 0])),
                    num_tokens=1, weights=backend._weights(m),
                    caches=cache.binding[1], capacity=cache.capacity, prefix_capacity=0,
                    screen=backend._no_screen, bound=backend._no_screen,
                    geometry=args.Geometry(cfg.num_heads, cfg.num_kv_heads, cfg.qk_norm, cfg.rms_norm_eps),
                    vocab=m.weights.lm_head.weight.n))
            assert cache.binding[0][0] == 3  # bound again after each growth
            assert len(bindings) == 3 and bindings[-1] == cache.binding[1]
            assert all(args.unbind(backend.ops, paddle.to_tensor(np.array([h]))) == 0
                       for h in bindings[:-1])  # the replaced bindings were dropped when the cache grew
            assert backend._weights(m) == backend._weights(m)  # the weights are bound once
            del cache, b
            gc.collect()
            assert args.unbind(backend.ops, handle) == 0  # already dropped with the cache
    assert [i for i, (a, b) in enumerate(zip(runs[True], runs[False])) if not np.array_equal(a, b)] == []


def test_bound_forward_index_tensors_are_reused_per_length(monkeypatch):
    """The step's index tensor is kept per length and overwritten (zero copy): a second index of the same
    length comes back in the same tensor with the new contents, one of another length in its own, one past
    INDEX_REUSE_MAX in a fresh tensor each time; and a run of steps that reuse them gives the bits of fresh
    ones."""
    m = load_model(TINY / "llama", dtype="float32", backend="fused").model
    backend = m.backend
    a, b = np.arange(10, dtype=np.int64), np.arange(10, 20, dtype=np.int64)
    ta = backend._index(a)
    assert ta.numpy().tolist() == a.tolist()
    tb = backend._index(b)
    assert tb is ta and ta.numpy().tolist() == b.tolist()
    assert backend._index(np.arange(3, dtype=np.int64)) is not ta
    monkeypatch.setattr(type(backend), "INDEX_REUSE_MAX", 12)
    big = np.arange(13, dtype=np.int64)
    assert backend._index(big) is not backend._index(big)
    ids = np.random.default_rng(9).integers(3, 250, 40)
    runs = []
    for fresh in (False, True):
        if fresh:  # every index a new tensor
            monkeypatch.setattr(type(backend), "INDEX_REUSE_MAX", 0)
        cache = m.new_cache(2, 64)
        out = []
        # lengths repeat, contents differ
        for start, n in [(0, 20), (20, 2), (22, 2), (24, 2), (26, 1), (27, 1)]:
            batch = build_forward_batch(np.array([0, 1]), np.array([start, start]), np.array([n, n]),
                                        np.concatenate([ids[start:start + n], ids[start + 5:start + 5 + n]]),
                                        np.array([True, True]))
            o = m.forward(batch, cache)
            out += [o.logits.numpy(), o.greedy]
        runs.append(out)
    assert all(np.array_equal(x, y) for x, y in zip(*runs))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_argmax_matches_paddle_lowest_index_on_ties(dtype):
    """specgen_argmax against paddle.argmax: vocabularies that are and are not multiples of 16 lanes, rows
    with ties (the lowest index wins), with the maximum in the last partial block, and all -inf."""
    from specgen.kernels import args

    rng = np.random.default_rng(3)
    for v in (1, 7, 16, 33, 49152):
        x = rng.integers(-3, 4, (9, v)).astype(dtype)  # many ties
        x[1] = rng.standard_normal(v)
        x[2, -1] = 10.0  # the maximum in the tail
        x[3] = -np.inf
        got = args.argmax(K, paddle.to_tensor(x)).numpy()
        assert got.dtype == np.int64
        assert np.array_equal(got, paddle.argmax(paddle.to_tensor(x), axis=-1).numpy())
        assert np.array_equal(got, np.argmax(x, axis=-1))  # numpy: first occurrence


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_attention_over_many_key_chunks_matches_numpy(dtype):
    """Contexts longer than one 128-key chunk: a decode at position 600 (5 chunks), a verify block whose rows
    straddle the chunk boundary at 128, and a prompt piece at 250-270; against numpy, and each block alone
    (its chunks spread over the threads) bit-identical to the whole batch (chunks run within one work
    item)."""
    rng = np.random.default_rng(11)
    H, KV, D, cap = 9, 3, 64, 704
    slots = np.array([0] + [1] * 6 + [2] * 21, np.int64)
    pos = np.concatenate([[600], np.arange(125, 131), np.arange(250, 271)]).astype(np.int64)
    qkv = rng.standard_normal((len(pos), (H + 2 * KV) * D)).astype(dtype)
    ang = np.arange(cap)[:, None] * (1e4 ** (-np.arange(0, D, 2) / D))[None, :]
    cos, sin = np.cos(ang).astype(dtype), np.sin(ang).astype(dtype)
    kc = rng.standard_normal((3 * KV * cap, D)).astype(dtype)
    vc = rng.standard_normal((3 * KV * cap, D)).astype(dtype)
    want = _numpy_attention(qkv, cos, sin, pos, slots, kc, vc, H, KV, cap)[0]
    ones = paddle.ones([D], dtype=dtype)

    def run(rows):
        out = K.specgen_attention(paddle.to_tensor(qkv[rows]), paddle.to_tensor(cos), paddle.to_tensor(sin),
                                  paddle.to_tensor(pos[rows]), paddle.to_tensor(slots[rows]),
                                  paddle.to_tensor(kc), paddle.to_tensor(vc), ones, ones,
                                  paddle.zeros([len(rows)], dtype="int64"), ones, ones, H, KV, cap,
                                  False, 1e-6, 0)
        return (out[0] if isinstance(out, (list, tuple)) else out).numpy()

    whole = run(np.arange(len(pos)))
    tol = 2e-5 if dtype == "float32" else 1e-12
    assert np.abs(whole - want).max() <= tol * max(1.0, np.abs(want).max())
    for rows in (np.array([0]), np.arange(1, 7), np.arange(7, 28)):
        assert np.array_equal(run(rows), whole[rows])


def test_a_finished_build_loads_without_the_builder(tmp_path, monkeypatch):
    """Once a build directory holds a finished build (its library and the BUILT_MARK written after loading
    it), later processes load the library directly instead of running Paddle's builder (a setup.py subprocess
    of ~2 s at every start): the module has the operators. A directory without the mark, or without the
    library, or a loader that fails, goes through the builder."""
    import subprocess
    import sys

    from specgen.config import EngineConfig
    from specgen.kernels import build

    d = build.build_dir("native", EngineConfig().cache_root())
    assert (d / build.BUILT_MARK).exists()  # this process's ops() built or loaded it
    code = ("import sys; from paddle.utils import cpp_extension; from specgen import kernels\n"
            "cpp_extension.load = lambda **kw: sys.exit('the builder ran')\n"  # load() must not be called
            "m = kernels.ops(); print(m is not None and hasattr(m, 'specgen_linear'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         check=False)
    assert out.returncode == 0 and out.stdout.strip().endswith("True"), out.stderr[-2000:]
    empty = tmp_path / "build"
    empty.mkdir()
    assert build.load_built(empty) is None
    (empty / build.BUILT_MARK).touch()
    assert build.load_built(empty) is None  # marked, but no library
    from paddle.utils.cpp_extension import extension_utils

    def broken(*args):
        raise TypeError("a Paddle whose private loader changed")

    monkeypatch.setattr(extension_utils, "_import_module_from_library", broken)
    assert build.load_built(d) is None  # ops() then runs Paddle's builder, as before


@pytest.mark.skipif(not has_vnni(), reason="the greedy screen's integer products need AVX-512 VNNI")
@pytest.mark.parametrize("kind,k,n", [("Q8_0", 576, 1000), ("Q4_0", 96, 333), ("Q8_0", 64, 45)])
def test_screened_argmax_equals_the_float32_logits_argmax(kind, k, n):
    """specgen_screened_argmax (the greedy tokens of a screened LM head) against the argmax of
    specgen_linear's float32 logits over the same blocks: equal on every row, for rows whose top logits are
    near-ties built to sit inside the screen's error bound (columns that copy the best one with one weight
    changed by a quant, or exactly, which must give the lowest index), over more rows than one screening chunk
    (64), and for rows with a NaN or an infinity (the full product's rule)."""
    from specgen.kernels import pack_quantized, pack_screen
    from specgen.models.checkpoint import QUANT_BLOCK_BYTES

    rng = np.random.default_rng(k + n)
    blocks = rng.integers(0, 256, (n, k // 32, QUANT_BLOCK_BYTES[kind]), dtype=np.uint8)
    blocks[..., :2] = (rng.standard_normal((n, k // 32, 1)) * 0.02).astype(np.float16).view(np.uint8)
    for base in (5, 12, 17, 30):  # larger weights: a row along one of them has its top logit there
        blocks[base, :, :2] = np.full((k // 32, 1), 0.06, np.float16).view(np.uint8)
    qoff = 2  # near-ties: each pair copies column `base` and moves one quant of one block by one step
    for base, copy, b, at in [(5, 6, 0, 3), (5, 900 % n, 1, 0), (17, 40, 0, 31), (30, 31, 0, 7)]:
        blocks[copy] = blocks[base]
        byte = qoff + (at if kind == "Q8_0" else at % 16)
        step = 1 if kind == "Q8_0" else (1 if at < 16 else 16)
        blocks[copy, b, byte] = (int(blocks[copy, b, byte]) + step) % 256
    blocks[n - 1] = blocks[12]  # an exact tie: the lower index must win
    w = pack_quantized(kind, blocks)
    screen = pack_screen(kind, blocks)
    wd = w.numpy()  # [k, n] float32
    x = rng.standard_normal((150, k)).astype(np.float32)
    for r, col in enumerate([5, 17, 30, 12, 12, 5] * 10):  # rows pointing at a tied column, some scaled
        x[r] = wd[:, col] * rng.uniform(0.5, 40) + rng.standard_normal(k).astype(np.float32) * 1e-3
    x[80:150, ::32] *= 300  # an outlier per block: the integer products' inputs lose most of their bits
    x[70, 3] = np.nan
    x[71, 0] = np.inf
    x[72] = 0.0  # every logit 0: index 0
    want = _screened_as_float32(x, w, screen, n, near_ties=20)
    approx = K.specgen_argmax(K.specgen_linear(paddle.to_tensor(x), screen.panels.panels, n)).numpy()
    assert (approx[80:] != want[80:]).sum() >= 5  # where the integer products alone pick another token


def _screened_as_float32(x: np.ndarray, w, screen, n: int, near_ties: int) -> np.ndarray:
    """specgen_screened_argmax of rows x over LM head w (Packed) and its Screen equals the argmax of the
    float32 logits (returned): on every row; at least `near_ties` of rows 0-59 are near-ties; where column 12
    ties exactly with column n - 1 (at least 5 rows) the lower index wins; rows alone and in other chunks of
    64 give the same tokens; row 72 (all zeros) gives 0."""
    xt = paddle.to_tensor(x)
    logits = K.specgen_linear(xt, w.panels, n)
    want = K.specgen_argmax(logits).numpy()
    got = K.specgen_screened_argmax(xt, w.panels, screen.panels.panels, screen.bound, NO_SAMPLE, n).numpy()
    assert np.array_equal(got, want), np.nonzero(got != want)[0]
    z = logits.numpy()[:60]
    top2 = np.sort(z, axis=1)[:, -2:]
    assert (top2[:, 1] - top2[:, 0] < 1e-3 * np.abs(top2[:, 1])).sum() >= near_ties  # the rows are near-ties
    tied = (z[:, 12] == z[:, n - 1]) & (z[:, 12] == z.max(axis=1))
    assert tied.sum() >= 5 and (want[:60][tied] == 12).all()  # exact ties: the lower index
    for m, at in [(1, 0), (3, 12), (64, 5), (65, 1)]:  # rows alone and in other chunks: the same tokens
        part = K.specgen_screened_argmax(paddle.to_tensor(x[at:at + m]), w.panels, screen.panels.panels,
                                         screen.bound, NO_SAMPLE, n).numpy()
        assert np.array_equal(part, want[at:at + m]), (m, at)
    assert want[72] == 0
    _screened_samples_as_float32(xt, logits, w, screen, n)
    return want


def _screened_samples_as_float32(xt, logits, w, screen, n: int) -> None:
    """Sampled rows (temperature above 0, no filter) of specgen_screened_argmax, drawn from the screen's
    bounds, against specgen_sample over the float32 logits: the same tokens, at temperatures from
    near-greedy to near-uniform, greedy rows among them, rows alone and in other chunks of 64."""
    from specgen.kernels import args

    m = xt.shape[0]
    rng = np.random.default_rng(m + n)
    greedy = K.specgen_argmax(logits).numpy()
    for temperature in (0.05, 0.7, 1.0, 3.0, 20.0):
        temp = np.full(m, temperature)
        temp[::9] = 0.0
        keys = rng.integers(0, 2 ** 63, m).astype(np.uint64)
        settings = args.SampleArgs(temp, np.zeros(m, np.int64), np.ones(m), np.zeros(m), keys,
                                   1 + 7 * np.arange(m), greedy)
        params = np.stack(args.sample_rows(settings)).astype(np.float64)
        want = args.sample(K, logits, paddle.to_tensor(params)).numpy()
        got = K.specgen_screened_argmax(xt, w.panels, screen.panels.panels, screen.bound,
                                        paddle.to_tensor(params), n).numpy()
        assert np.array_equal(got, want), (temperature, np.nonzero(got != want)[0])
        assert temperature < 20 or (want != greedy).sum() > 3  # the noise moves tokens
        for rows, at in [(1, 3), (65, 2)]:
            part = np.ascontiguousarray(params[:, at:at + rows])
            got = K.specgen_screened_argmax(paddle.to_tensor(xt.numpy()[at:at + rows]), w.panels,
                                            screen.panels.panels, screen.bound, paddle.to_tensor(part),
                                            n).numpy()
            assert np.array_equal(got, want[at:at + rows]), (temperature, rows, at)


@pytest.mark.skipif(not has_vnni(), reason="the greedy screen's integer products need AVX-512 VNNI")
def test_screened_argmax_of_a_q6_k_head_equals_the_float32_logits_argmax():
    """A Q6_K LM head (llama.cpp's Q4_K_M keeps its output in Q6_K) is screened as Q8_0 / Q4_0 heads are: its
    6.6-bit integer panels score every column with a bound over both halves of each block, float32 decides
    among the candidates; the tokens equal the float32 logits' argmax for near-ties (a column copying a larger
    one with one quant moved), an exact tie (the lower index), outlier inputs, NaN / infinite rows, and rows
    alone or in other chunks."""
    from specgen.kernels import pack_quantized, pack_screen

    rng = np.random.default_rng(11)
    k, n = 512, 700
    blocks = _random_blocks(rng, "Q6_K", k, n)
    for base in (5, 17, 30, 12):  # larger weights: a row along one of them has its top logit there
        blocks[base, :, 208:210] = np.full((k // 256, 1), 0.2, np.float16).view(np.uint8)
    for base, copy, sb, byte in [(5, 6, 0, 3), (17, 40, 1, 70), (30, 31, 0, 127)]:
        blocks[copy] = blocks[base]
        low = int(blocks[copy, sb, byte])
        blocks[copy, sb, byte] = (low & 0xF0) | ((low & 0xF) ^ 1)  # one quant moved by one step
    blocks[n - 1] = blocks[12]  # an exact tie
    w = pack_quantized("Q6_K", blocks, ops=K)
    screen = pack_screen("Q6_K", blocks, K)
    assert screen.panels.panels.shape[-1] == 840 and screen.bound.shape == [-(-n // 32), k // 32, 32]
    wd = w.numpy()
    x = rng.standard_normal((140, k)).astype(np.float32)
    for r, col in enumerate([5, 17, 30, 12, 6, 40] * 10):
        x[r] = wd[:, col] * rng.uniform(0.5, 40) + rng.standard_normal(k).astype(np.float32) * 1e-3
    x[80:140, ::32] *= 300
    x[70, 3], x[71, 0], x[72] = np.nan, np.inf, 0.0
    _screened_as_float32(x, w, screen, n, near_ties=10)


@pytest.mark.skipif(not has_vnni(), reason="the greedy screen's integer products need AVX-512 VNNI")
def test_screened_argmax_takes_columns_its_bound_cannot_cover():
    """Columns whose screen is not finite or could have overflowed are candidates whatever their bound: a Q6_K
    column of +inf weights whose first half block's integer sum is 0 (0 x inf: NaN; its logit is +inf), and
    a Q8_0 column whose integer products overflow float32 while its float32 chains do not (inputs of 2^104):
    the screened token is the float32 logits' argmax in both; a NaN logit never wins."""
    from specgen.kernels import pack_quantized, pack_screen

    rng = np.random.default_rng(5)
    k, n, j = 256, 64, 40
    blocks = _random_blocks(rng, "Q6_K", k, n)
    blocks[j, :, :128], blocks[j, :, 128:192], blocks[j, :, 192:208] = 0x11, 0xAA, 1  # every q = 1, scales 1
    blocks[j, :, 208:210] = np.full((1, 1), np.inf, np.float16).view(np.uint8)  # d = +inf
    blocks[j + 1, :, 208:210] = np.full((1, 1), np.nan, np.float16).view(np.uint8)  # a NaN column
    x = np.full((1, k), 1e-3, np.float32)
    x[0, 16::32] = 1.0  # inputs 0-15 of every block quantize to 0
    cases = [("Q6_K", blocks, x)]
    q8 = np.zeros((n, 2, 32), np.int8)
    q8[:, 0, 5] = 1 + np.arange(n) % 7  # the other columns: logits -0.01 q < 0
    q8[9] = 0
    q8[9, 0, :3], q8[9, 1, :3] = -127, 127  # +-3 * 127 * 60000 * 2^104 per block: past float32's range
    d8 = np.full((n, 2), 0.01, np.float16)
    d8[9] = 60000
    blocks8 = np.concatenate([d8[..., None].view(np.uint8), q8.view(np.uint8)], axis=-1)
    x8 = np.zeros((1, 64), np.float32)
    x8[0, [0, 1, 2, 32, 33, 34]], x8[0, 5] = 2.0 ** 104, -1.0
    cases.append(("Q8_0", blocks8, x8))
    for kind, b, xs in cases:
        w, screen = pack_quantized(kind, b, ops=K), pack_screen(kind, b, K)
        xt = paddle.to_tensor(xs)
        logits = K.specgen_linear(xt, w.panels, n).numpy()
        want = int(np.nanargmax(logits[0]))
        assert want == (j if kind == "Q6_K" else 9), (kind, logits[0, want])
        got = K.specgen_screened_argmax(xt, w.panels, screen.panels.panels, screen.bound, NO_SAMPLE,
                                        n).numpy()
        assert got[0] == want, (kind, got, want)


@pytest.mark.skipif(not has_vnni(), reason="the greedy screen's integer products need AVX-512 VNNI")
def test_screened_argmax_keeps_a_column_its_integer_product_misses_by_nearly_the_bound():
    """A row built so that one column's integer product errs by 0.98 of the bound on it: every input but each
    block's first sits at 0.49 of a quantization step, with the sign of that column's weight, and rounds to 0;
    the first inputs are exact. Column a (weights only on the rounded inputs) then scores 0 in the integer
    products against a true logit of 0.49 E_a, and column b (a weight only on an exact input) scores its true
    logit, just below a's. The screen must still keep a (a margin under 0.49 E_a would not), and pick b once
    b's logit is just above a's."""
    from specgen.kernels import pack_quantized, pack_screen

    k, n, a, b, D = 64, 40, 7, 23, 0.0625
    rng = np.random.default_rng(11)
    blocks = np.zeros((n, k // 32, 34), np.uint8)
    q = rng.integers(-127, 128, (n, k // 32, 32)).astype(np.int8)
    q[:, :, 0] = 0  # the exact inputs carry no weight ...
    q[b] = 0
    q[b, 0, 0] = 127  # ... but b's
    blocks[..., 2:] = q.view(np.uint8)
    d = np.full((n, k // 32), 0.02, np.float16)
    d[a] = 0.0625
    x = np.zeros(k, np.float32)
    x[::32] = 127 * D  # each block's largest input: the step is D exactly
    sign = np.where(q[a].reshape(-1) >= 0, 1.0, -1.0)
    x[1:32], x[33:] = (0.49 * D * sign.reshape(2, 32)[:, 1:]).astype(np.float32)
    w_a = q[a].astype(np.float64).reshape(-1) * np.float64(d[a, 0])
    z_a = float(x.astype(np.float64) @ w_a)
    for side, target in ((-1, a), (1, b)):  # b's logit just below a's, then just above
        db = np.float16(z_a / (127 * 127 * D))
        while (127 * 127 * D * float(db) - z_a) * side <= 0:
            db = np.nextafter(db, np.float16(np.inf * side))
        d[b, 0] = db
        blocks[..., :2] = d[..., None].view(np.uint8)
        w, screen = pack_quantized("Q8_0", blocks), pack_screen("Q8_0", blocks)
        xt = paddle.to_tensor(x[None])
        exact = K.specgen_argmax(K.specgen_linear(xt, w.panels, n)).numpy()[0]
        approx = K.specgen_argmax(K.specgen_linear(xt, screen.panels.panels, n)).numpy()[0]
        got = K.specgen_screened_argmax(xt, w.panels, screen.panels.panels, screen.bound, NO_SAMPLE,
                                        n).numpy()[0]
        assert exact == target and approx == b  # the integer products alone would always say b
        assert got == target, side


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("int8", [False, True])
def test_blocks_are_packed_in_cpp_as_in_numpy(kind, int8):
    """specgen_pack_blocks (what pack_quantized runs with the kernels) gives the bytes of the numpy reference,
    for both layouts, with a partial last panel (K-quants: 2 super-blocks of 256 inputs)."""
    from specgen.kernels.packing import pack_quantized
    from specgen.models.checkpoint import QUANT_BLOCK_BYTES

    per_row = 2 if kind in ("Q4_K", "Q6_K") else 3
    blocks = np.random.default_rng(7).integers(0, 256, (77, per_row, QUANT_BLOCK_BYTES[kind]), dtype=np.uint8)
    fast, ref = pack_quantized(kind, blocks, int8, K), pack_quantized(kind, blocks, int8)
    assert (fast.panels.dtype == ref.panels.dtype
            and (fast.k, fast.n, fast.int8_product) == (ref.k, ref.n, int8))
    assert np.array_equal(fast.panels.numpy(), ref.panels.numpy())
    if kind in ("Q4_0", "Q8_0", "Q6_K") and int8:  # the greedy screen's panels and bound, both ways
        from specgen.kernels import pack_screen

        screen = pack_screen(kind, blocks, K)
        with np.errstate(invalid="ignore", over="ignore"):  # (random scales: some are NaN or huge)
            numpy_screen = pack_screen(kind, blocks)
        assert np.array_equal(screen.panels.panels.numpy(), numpy_screen.panels.panels.numpy())
        assert screen.bound.shape == numpy_screen.bound.shape == [3, 16 if kind == "Q6_K" else 3, 32]
        # (random d: some NaN)
        assert np.array_equal(screen.bound.numpy(), numpy_screen.bound.numpy(), equal_nan=True)


def test_build_target_hides_features_it_lacks():
    """EngineConfig.cpu_target builds for another CPU (x86-64-v3: AVX2, FMA and F16C, no AVX-512), so the
    paths such a machine takes can be run here: the engine then sees no AVX-512 even on a CPU that has it (the
    AVX2 product, no integer products), no packed weights at all for a plain x86-64 target, and each target
    builds into its own directory."""
    from specgen.config import EngineConfig
    from specgen.kernels import build

    root = EngineConfig().cache_root()
    native = {f: build.cpu_has(f, "native") for f in build.FEATURE_MACROS}
    assert not build.cpu_has("avx512f", "x86-64-v3") and not build.has_vnni("x86-64-v3")
    assert build.packs("x86-64-v3") == all(native[f] for f in ("avx2", "fma", "f16c"))
    assert build.build_dir("x86-64-v3", root) != build.build_dir("native", root)
    assert not any(build.cpu_has(f, "x86-64") for f in build.FEATURE_MACROS)
    assert not build.packs("x86-64")


_AVX2_PRODUCTS = """
import sys
import numpy as np
import paddle
from specgen.kernels import ops
K = ops("x86-64-v3")
panels = np.load(sys.argv[1])
x = np.load(sys.argv[2])
out = {}
for name in panels.files:
    w = paddle.to_tensor(panels[name])  # (uint8, or int8 for integer products; a weight of parts: uint8)
    for m in (1, 3, 4, 9, 41):
        out[f"{name}:{m}"] = K.specgen_linear(paddle.to_tensor(x[:m]), w, int(name.split(":")[1])).numpy()
np.savez(sys.argv[3], **out)
"""


def test_avx2_build_multiplies_k_quants_and_parts_as_the_native_build(tmp_path):
    """The AVX2 build (cpu_target x86-64-v3, in a process of its own: one process holds one build) multiplies
    Q4_K and Q6_K panels and a weight of parts to the bits this build gives over float32 panels of the
    dequantized weights, for 1 to 41 rows (its one-row, few-row and whole-panel paths); their integer-product
    panels (its scalar reference, ipanel_ref) to the bits of this build's (VNNI, where it has it)."""
    import subprocess
    import sys

    import gguf
    from gguf.quants import dequantize

    from specgen.kernels import build, pack_linear, pack_parts, pack_quantized

    if not build.packs("x86-64-v3"):
        pytest.skip("no AVX2 build here")
    rng = np.random.default_rng(9)
    k = 512
    runs = [(kind, _random_blocks(rng, kind, k, n, tiny=0.1)) for kind, n in (("Q4_K", 64), ("Q6_K", 45))]

    def dense(kind, b):
        return dequantize(b.reshape(len(b), -1), gguf.GGMLQuantizationType[kind]).reshape(len(b), k).T

    weights = {f"{kind}:{len(b)}": (pack_quantized(kind, b).panels.numpy(), dense(kind, b))
               for kind, b in runs}
    weights[f"parts:{64 + 45}"] = (pack_parts(runs).panels.numpy(),
                                   np.concatenate([dense(kind, b) for kind, b in runs], axis=1))
    if has_vnni():
        weights |= {f"{kind}_int8:{len(b)}": (pack_quantized(kind, b, True).panels.numpy(), None)
                    for kind, b in runs}
        weights[f"parts_int8:{64 + 45}"] = (pack_parts(runs, int8_product=True).panels.numpy(), None)
    x = rng.standard_normal((41, k)).astype(np.float32)
    np.savez(tmp_path / "panels.npz", **{name: p for name, (p, _) in weights.items()})
    np.save(tmp_path / "x.npy", x)
    (tmp_path / "run.py").write_text(_AVX2_PRODUCTS)
    files = [str(tmp_path / f) for f in ("run.py", "panels.npz", "x.npy", "out.npz")]
    subprocess.run([sys.executable, *files], check=True, capture_output=True, timeout=600)
    got = np.load(tmp_path / "out.npz")
    for name, (p, w) in weights.items():
        n = int(name.split(":")[1])
        if w is None:  # integer products: this build's over the same panels
            panels = paddle.to_tensor(p)
        else:
            panels = pack_linear(w.astype(np.float32), halves=False).panels
        for m in (1, 3, 4, 9, 41):
            want = K.specgen_linear(paddle.to_tensor(x[:m]), panels, n).numpy()
            assert np.array_equal(got[f"{name}:{m}"], want), (name, m)


def _two_chains(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """linear.cc's definition of every product: y[r, c] = (even chain) + (odd chain), each chain an FMA per
    input in input order, acc = fma(x[r, i], w[i, c], acc), from 0. An FMA is emulated in float64, where the
    product of two float32s is exact."""
    acc = np.zeros((2, x.shape[0], w.shape[1]), np.float32)
    for i in range(x.shape[1]):
        acc[i % 2] = (x[:, i, None].astype(np.float64) * w[i].astype(np.float64)
                      + acc[i % 2]).astype(np.float32)
    return acc[0] + acc[1]


@pytest.mark.parametrize("k,n", [(64, 45), (7, 33), (96, 64)])
def test_packed_linear_is_two_fma_chains_in_input_order(k, n):
    """Every build (AVX-512, AVX2, generic) computes the same bits: the definition above, for 1 to 40 rows
    (each row-group shape of each path, and the many-row paths)."""
    from specgen.kernels import pack_linear

    rng = np.random.default_rng(k * n)
    w = rng.standard_normal((k, n)).astype(np.float32)
    p = pack_linear(paddle.to_tensor(w)).panels
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 17, 40):
        x = rng.standard_normal((m, k)).astype(np.float32)
        assert np.array_equal(K.specgen_linear(paddle.to_tensor(x), p, n).numpy(), _two_chains(x, w)), m
