"""The whole-forward ops in float64 (float64 panels, caches and tables) against numpy references, and exact:
a row's bits never depend on the batch or on how many tokens its slot feeds."""
from dataclasses import dataclass

import numpy as np
import paddle
import pytest

from specgen.kernels import ops

K = ops()
pytestmark = pytest.mark.skipif(K is None,
                                reason="fused CPU kernels not built (no C++ compiler or not on CPU)")

PANEL = 32  # output columns per panel (linear.cc)
EPS = 1e-6


def pack64(w: np.ndarray) -> paddle.Tensor:
    """W [k, n] -> float64 panels [ceil(n / 32), k, 32]: column 32 p + c of W at [p, :, c],
    zero columns past n."""
    k, n = w.shape
    panels = -(-n // PANEL)
    padded = np.zeros((k, panels * PANEL), np.float64)
    padded[:, :n] = w
    return paddle.to_tensor(np.ascontiguousarray(padded.reshape(k, panels, PANEL).transpose(1, 0, 2)))


def _first(out):
    return out[0] if isinstance(out, (list, tuple)) else out


@pytest.mark.parametrize("k,n", [(576, 1536), (64, 45), (7, 33), (96, 64)])
def test_float64_linear_matches_numpy_and_each_row_is_computed_alone(k, n):
    """specgen_linear over float64 panels: numpy's float64 product to 1e-12 of its scale, the output float64,
    and every row bit-identical whether computed alone (m = 1), in a batch of 7 (one full row group and a
    tail) or in the batch of 130, at any offset."""
    rng = np.random.default_rng(k * n)
    w = rng.standard_normal((k, n))
    x = rng.standard_normal((130, k))
    p = pack64(w)
    y = K.specgen_linear(paddle.to_tensor(x), p, n)
    assert y.dtype == paddle.float64 and y.shape == [130, n]
    y = y.numpy()
    ref = x @ w
    assert np.abs(y - ref).max() <= 1e-12 * np.abs(ref).max()
    alone = np.concatenate([K.specgen_linear(paddle.to_tensor(x[r:r + 1]), p, n).numpy() for r in range(130)])
    assert np.array_equal(alone, y)
    for at in (0, 3, 60, 123):
        assert np.array_equal(K.specgen_linear(paddle.to_tensor(x[at:at + 7]), p, n).numpy(),
                              y[at:at + 7]), at
    assert K.specgen_linear(paddle.to_tensor(x[:0]), p, n).shape == [0, n]


def test_float64_panels_and_float32_inputs_do_not_mix():
    """A float64 weight with float32 inputs, or the other way round, is an error naming what it needs."""
    w = np.random.default_rng(0).standard_normal((64, 40))
    x = np.ones((2, 64))
    with pytest.raises(OSError, match="float64 panels need float64 inputs"):
        K.specgen_linear(paddle.to_tensor(x.astype(np.float32)), pack64(w), 40)
    f32 = paddle.to_tensor(np.zeros((2, 64, PANEL), np.float32))
    with pytest.raises(OSError, match="float64 inputs need float64 panels"):
        K.specgen_linear(paddle.to_tensor(x), f32, 40)


@dataclass
class TinyModel:
    """A random pre-norm Llama model (GQA, rotate-half RoPE, fused QKV with a bias, fused gate/up), float64;
    numpy arrays, the projections [in, out]."""

    embed: np.ndarray  # [vocab, hidden]
    blocks: list[dict]  # attn_norm [hidden], w_qkv [hidden, (H + 2 KV) D], b_qkv, w_o, mlp_norm, w_gu, w_down
    final_norm: np.ndarray  # [hidden]
    lm_head: np.ndarray  # [hidden, vocab]
    cos: np.ndarray  # [max_len, D / 2]
    sin: np.ndarray
    H: int = 4
    KV: int = 2
    D: int = 16

    @property
    def vocab(self) -> int:
        return self.embed.shape[0]


def tiny_model(rng, hidden=64, num_blocks=2, H=4, KV=2, D=16, inter=96, vocab=100, max_len=64) -> TinyModel:
    def proj(k, n):
        return rng.standard_normal((k, n)) / np.sqrt(k)

    def norm(n):
        return 1 + 0.1 * rng.standard_normal(n)

    blocks = [{"attn_norm": norm(hidden), "w_qkv": proj(hidden, (H + 2 * KV) * D),
               "b_qkv": 0.1 * rng.standard_normal((H + 2 * KV) * D), "w_o": proj(H * D, hidden),
               "mlp_norm": norm(hidden), "w_gu": proj(hidden, 2 * inter), "w_down": proj(inter, hidden)}
              for _ in range(num_blocks)]
    ang = np.arange(max_len)[:, None] * (1e4 ** (-np.arange(0, D, 2) / D))[None, :]
    return TinyModel(rng.standard_normal((vocab, hidden)), blocks, norm(hidden), proj(hidden, vocab),
                     np.cos(ang), np.sin(ang), H, KV, D)


def _rms(x, w):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + EPS) * w


def _rope(x, cos, sin):  # x [L, heads, D], rotate-half on the first / second halves of each head
    half = x.shape[-1] // 2
    c, s = cos[:, None, :], sin[:, None, :]
    return np.concatenate([x[..., :half] * c - x[..., half:] * s, x[..., half:] * c + x[..., :half] * s],
                          axis=-1)


def np_blocks(m: TinyModel, blocks: list[dict], x: np.ndarray) -> np.ndarray:
    """The blocks over one slot's sequence x [L, hidden] at positions 0 .. L-1, causal: [L, hidden]."""
    L, H, KV, D = len(x), m.H, m.KV, m.D
    cos, sin = m.cos[:L], m.sin[:L]
    causal = np.tril(np.ones((L, L), bool))
    for b in blocks:
        qkv = _rms(x, b["attn_norm"]) @ b["w_qkv"] + b["b_qkv"]
        q = _rope(qkv[:, :H * D].reshape(L, H, D), cos, sin) / np.sqrt(D)
        k = _rope(qkv[:, H * D:(H + KV) * D].reshape(L, KV, D), cos, sin)
        v = qkv[:, (H + KV) * D:].reshape(L, KV, D)
        att = np.zeros((L, H, D))
        for h in range(H):
            g = h // (H // KV)
            s = np.where(causal, q[:, h] @ k[:, g].T, -np.inf)
            p = np.exp(s - s.max(-1, keepdims=True))
            att[:, h] = (p / p.sum(-1, keepdims=True)) @ v[:, g]
        x = x + att.reshape(L, H * D) @ b["w_o"]
        gu = _rms(x, b["mlp_norm"]) @ b["w_gu"]
        g, u = np.split(gu, 2, axis=-1)
        x = x + (g / (1 + np.exp(-g)) * u) @ b["w_down"]
    return x


def np_forward(m: TinyModel, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(logits [L, vocab], final normed hidden [L, hidden]) of one slot's tokens ids [L] from position 0."""
    hidden = _rms(np_blocks(m, m.blocks, m.embed[ids]), m.final_norm)
    return hidden @ m.lm_head, hidden


class Columns:
    """specgen_stack's per-block argument lists of a TinyModel (absent biases and q/k norms: stand-ins), and
    fresh float64 caches [num_slots * KV * capacity, D] per block."""

    def __init__(self, m: TinyModel, blocks: list[dict]):
        t = paddle.to_tensor
        none, self.ones = paddle.zeros([0], dtype="float64"), paddle.ones([m.D], dtype="float64")
        self.weights = [[t(b["attn_norm"]) for b in blocks], [pack64(b["w_qkv"]) for b in blocks],
                        [t(b["b_qkv"]) for b in blocks], [pack64(b["w_o"]) for b in blocks],
                        [none for _ in blocks], [t(b["mlp_norm"]) for b in blocks],
                        [pack64(b["w_gu"]) for b in blocks], [none for _ in blocks],
                        [pack64(b["w_down"]) for b in blocks], [none for _ in blocks]]
        self.q_norm = self.k_norm = self.prefix = [self.ones] * len(blocks)  # qk_norm off, no shared prefix
        self.m, self.num_blocks = m, len(blocks)

    def caches(self, num_slots: int, capacity: int) -> tuple[list, list]:
        rows = num_slots * self.m.KV * capacity
        return ([paddle.zeros([rows, self.m.D], dtype="float64") for _ in range(self.num_blocks)],
                [paddle.zeros([rows, self.m.D], dtype="float64") for _ in range(self.num_blocks)])


CAPACITY = 32


class Bound:
    """A TinyModel bound for specgen_forward_bound, with caches for num_slots slots."""

    def __init__(self, m: TinyModel, num_slots: int):
        self.m, self.c = m, Columns(m, m.blocks)
        t = paddle.to_tensor
        self.cos, self.sin, self.final_norm, self.lm_head = (t(m.cos), t(m.sin), t(m.final_norm),
                                                             pack64(m.lm_head))
        self.embed = t(m.embed)
        self.weights = int(K.specgen_bind_weights(self.embed, *self.c.weights, self.cos, self.sin,
                                                  self.c.q_norm, self.c.k_norm, self.final_norm,
                                                  self.lm_head).numpy()[0])
        self.k, self.v = self.c.caches(num_slots, CAPACITY)
        self.caches = int(K.specgen_bind_caches(self.k, self.v, self.c.prefix, self.c.prefix).numpy()[0])
        self.no_screen = paddle.zeros([0], dtype="float32")

    def step(self, ids, positions, slots) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One forward of tokens ids [n] at positions [n] in slots [n], logits at every token: (logits [n,
        vocab], hidden [n, hidden], greedy [n])."""
        n = len(ids)
        index = np.concatenate([ids, positions, slots, np.zeros(n), np.arange(n)]).astype(np.int64)
        logits, hidden, greedy, _ = K.specgen_forward_bound(
            paddle.to_tensor(index), self.no_screen, self.no_screen, paddle.zeros([0], dtype="float64"), n,
            self.weights, self.caches, self.m.H,
            self.m.KV, CAPACITY, False, EPS, 0, self.m.vocab, False, [])
        assert logits.dtype == hidden.dtype == paddle.float64
        return logits.numpy(), hidden.numpy(), greedy.numpy()

    def release(self):
        for h in (self.weights, self.caches):
            K.specgen_unbind(paddle.to_tensor(np.array([h])))


def test_float64_forward_matches_numpy_and_is_exact_across_blocks_and_batches():
    """specgen_forward_bound in float64 on a tiny random model: a two-slot prefill (10 and 7 tokens), then
    slot 0's next 6 tokens as one block beside slot 1's next token, equal numpy's float64 model to 1e-10; and
    feeding those 6 tokens one at a time, alone, gives the same logits, hidden rows and greedy tokens bit for
    bit. specgen_forward with the tensors passed per call, and specgen_stack with the final norm after it,
    give the bound forward's bits."""
    rng = np.random.default_rng(0)
    m = tiny_model(rng)
    seq0, seq1 = rng.integers(0, m.vocab, 16), rng.integers(0, m.vocab, 8)
    want0, want1 = np_forward(m, seq0), np_forward(m, seq1)
    runs = []
    for one_at_a_time in (False, True):
        b = Bound(m, num_slots=2)
        pre = b.step(np.concatenate([seq0[:10], seq1[:7]]), np.r_[0:10, 0:7], np.r_[[0] * 10, [1] * 7])
        if one_at_a_time:
            steps = [b.step(seq0[p:p + 1], np.array([p]), np.array([0])) for p in range(10, 16)]
            block = tuple(np.concatenate(parts) for parts in zip(*steps))
        else:
            both = b.step(np.r_[seq0[10:16], seq1[7]], np.r_[10:16, 7], np.r_[[0] * 6, 1])
            block = tuple(a[:6] for a in both)
            for got, want in zip(both[:2], want1):
                assert np.abs(got[6] - want[7]).max() <= 1e-10 * np.abs(want).max()
        for got, want in zip(pre[:2], want0):
            assert np.abs(got[:10] - want[:10]).max() <= 1e-10 * np.abs(want).max()
        for got, want in zip(pre[:2], want1):
            assert np.abs(got[10:] - want[:7]).max() <= 1e-10 * np.abs(want).max()
        for got, want in zip(block[:2], want0):
            assert np.abs(got - want[10:16]).max() <= 1e-10 * np.abs(want).max()
        assert np.array_equal(block[2], np.argmax(block[0], axis=-1))
        runs.append(pre + block)
        b.release()
    assert all(np.array_equal(a, b) for a, b in zip(*runs))

    c = Columns(m, m.blocks)  # the same prefill through specgen_forward and specgen_stack
    ids, pos, slots = np.concatenate([seq0[:10], seq1[:7]]), np.r_[0:10, 0:7], np.r_[[0] * 10, [1] * 7]
    t = paddle.to_tensor
    k, v = c.caches(2, CAPACITY)
    logits, hidden, greedy = K.specgen_forward(
        t(ids), t(m.embed), *c.weights, t(m.cos), t(m.sin), t(pos), t(slots), k, v, c.q_norm, c.k_norm,
        t(np.zeros(17, np.int64)), c.prefix, c.prefix, t(m.final_norm), t(np.arange(17)), pack64(m.lm_head),
        paddle.zeros([0]), paddle.zeros([0]), m.H, m.KV, CAPACITY, False, EPS, 0, m.vocab)[:3]
    assert all(np.array_equal(a.numpy(), b) for a, b in zip((logits, hidden, greedy), runs[0][:3]))
    k, v = c.caches(2, CAPACITY)
    x = _first(K.specgen_stack(t(m.embed[ids]), *c.weights, t(m.cos), t(m.sin), t(pos), t(slots), k, v,
                               c.q_norm, c.k_norm, t(np.zeros(17, np.int64)), c.prefix, c.prefix, m.H, m.KV,
                               CAPACITY, False, EPS, 0))
    assert x.dtype == paddle.float64
    assert np.array_equal(_first(K.specgen_rms_norm(x, t(m.final_norm), EPS)).numpy(), runs[0][1])


def test_float64_forward_refuses_float32_only_features():
    """The screened LM head, float16 caches and float32 panels serve float32 only: float64 asks for them (or
    for float32 norms) get an error that says so before anything is computed, not wrong numbers."""
    m = tiny_model(np.random.default_rng(1))
    c = Columns(m, m.blocks)
    t = paddle.to_tensor
    k, v = c.caches(1, CAPACITY)

    def args(k, v, screen, lm_head):  # specgen_forward's arguments for two tokens of slot 0
        return (t(np.array([1, 2])), t(m.embed), *c.weights, t(m.cos), t(m.sin), t(np.arange(2)),
                t(np.zeros(2, np.int64)), k, v, c.q_norm, c.k_norm, t(np.zeros(2, np.int64)), c.prefix,
                c.prefix, t(m.final_norm), t(np.arange(2)), lm_head, screen, paddle.zeros([4 * 2 * 32]), m.H,
                m.KV, CAPACITY, False, EPS, 0, m.vocab)

    with pytest.raises(OSError, match="float32 only"):
        K.specgen_forward(*args(k, v, paddle.zeros([1], dtype="int8"), pack64(m.lm_head)))
    half = [paddle.zeros(k[0].shape, dtype="float16") for _ in k]
    with pytest.raises(OSError, match="float16 caches serve float32 only"):
        K.specgen_forward(*args(half, list(half), paddle.zeros([0]), pack64(m.lm_head)))
    f32_head = pack64(m.lm_head).astype("float32")
    with pytest.raises(OSError, match="lm_head: float64 activations need float64 panels"):
        K.specgen_forward(*args(k, v, paddle.zeros([0]), f32_head))
    c.weights[5] = [w.astype("float32") for w in c.weights[5]]  # mlp_norm
    with pytest.raises(OSError, match="norms and biases must be float64"):
        K.specgen_forward(*args(k, v, paddle.zeros([0]), pack64(m.lm_head)))


@dataclass
class TinyHead:
    """A random MTP head: input norms, eh_proj [2 hidden, hidden], one block, final norm and LM head, beside
    the TinyModel whose embedding and RoPE tables it shares."""

    m: TinyModel
    enorm: np.ndarray
    hnorm: np.ndarray
    eh_proj: np.ndarray
    block: dict
    final_norm: np.ndarray
    lm_head: np.ndarray


def np_drafts(h: TinyHead, ids: np.ndarray, hidden: np.ndarray, depth: int, draw: np.ndarray | None = None,
              vocab: np.ndarray | None = None) -> tuple[list[int], float]:
    """The head's drafts after catching up on one sequence (tokens ids [L], the main model's hidden rows [L,
    hidden] at positions 0 .. L-1), as MtpProposer chains them: each the argmax, or with `draw` (one
    MtpPass.draw column [4, 1]) coupled_drafts', each LM-head column the token vocab[column] (None: the
    column); and the smallest gap between the top two logits."""
    from specgen.layers.sampling import coupled_drafts

    m = h.m

    def head_input(token, row):
        return np.concatenate([_rms(m.embed[token], h.enorm), _rms(row, h.hnorm)]) @ h.eh_proj

    inputs = [head_input(t, r) for t, r in zip(ids, hidden)]
    drafts, gap = [], np.inf
    for _ in range(depth):
        last = np_blocks(m, [h.block], np.stack(inputs))[-1]
        logits = _rms(last, h.final_norm) @ h.lm_head
        top = np.sort(logits)[-2:]
        if draw is None:
            col = int(np.argmax(logits))
        else:
            col = int(coupled_drafts(logits[None], vocab, draw, len(drafts))[0])
        drafts.append(col if vocab is None else int(vocab[col]))
        gap = min(gap, top[1] - top[0])
        inputs.append(head_input(drafts[-1], last))
    return drafts, gap


def test_float64_mtp_draft_matches_numpy_and_catch_up_in_pieces():
    """specgen_mtp_draft in float64 with a one-block head: two sequences (slots 0 and 1) caught up in one call
    give numpy's drafts at depth 3 (the top two logits far apart next to float64's error); caught up in two
    calls (the first without drafts), the same drafts. Sampled sequences (MtpPass.draw) draw drafts coupled to
    verification's noise: numpy's coupled_drafts chain, at T 0.7 and 3 (moving drafts off the argmax)."""
    rng = np.random.default_rng(2)
    m = tiny_model(rng, num_blocks=1)
    donor = tiny_model(rng, num_blocks=1)
    hid = m.embed.shape[1]
    head = TinyHead(m, 1 + 0.1 * rng.standard_normal(hid), 1 + 0.1 * rng.standard_normal(hid),
                    rng.standard_normal((2 * hid, hid)) / np.sqrt(2 * hid), donor.blocks[0],
                    1 + 0.1 * rng.standard_normal(hid),
                    4 * rng.standard_normal((hid, m.vocab)) / np.sqrt(hid))
    lens, depth = (9, 5), 3
    ids = [rng.integers(0, m.vocab, n) for n in lens]
    hidden = [rng.standard_normal((n, hid)) for n in lens]
    want = [np_drafts(head, i, h, depth) for i, h in zip(ids, hidden)]
    assert min(gap for _, gap in want) > 1e-6

    c = Columns(m, [head.block])
    t = paddle.to_tensor
    all_hidden = t(np.concatenate(hidden))  # [14, hidden]: sequence 0's rows, then sequence 1's

    def draft(tokens, slots, positions, rows, last_rows, k, v, draw=np.zeros((4, 0)),
              vocab=np.zeros(0, np.int64)):
        out = K.specgen_mtp_draft(
            t(tokens), all_hidden, t(rows), t(m.embed), t(head.enorm), t(head.hnorm), pack64(head.eh_proj),
            *c.weights, t(m.cos), t(m.sin), t(positions), t(slots), k, v, c.q_norm, c.k_norm,
            t(np.zeros(len(tokens), np.int64)), c.prefix, c.prefix, t(np.asarray(last_rows, np.int64)),
            t(head.final_norm), pack64(head.lm_head), t(vocab), t(draw), m.H, m.KV, CAPACITY,
            False, EPS, 0, depth, m.vocab)
        return _first(out).numpy()

    tokens, slots = np.concatenate(ids), np.r_[[0] * 9, [1] * 5]
    positions, rows = np.r_[0:9, 0:5], np.arange(14)
    k, v = c.caches(2, CAPACITY)
    whole = draft(tokens, slots, positions, rows, [8, 13], k, v)
    assert whole.tolist() == [d for d, _ in want]
    k, v = c.caches(2, CAPACITY)
    first = np.r_[0:6, 9:12]  # positions 0-5 of sequence 0 and 0-2 of sequence 1: caught up, no drafts
    assert draft(tokens[first], slots[first], positions[first], rows[first], [], k, v).shape == (0, depth)
    rest = np.r_[6:9, 12:14]
    assert np.array_equal(draft(tokens[rest], slots[rest], positions[rest], rows[rest], [2, 4], k, v), whole)
    moved = 0
    for temperature in (0.7, 3.0):  # sequence 0 sampled (key, first draft at output position 4), 1 greedy
        draw = np.array([[1 / temperature, 0.0], [12345.0, 0.0], [678.0, 0.0], [4.0, 0.0]])
        k, v = c.caches(2, CAPACITY)
        got = draft(tokens, slots, positions, rows, [8, 13], k, v, draw)
        assert got[1].tolist() == want[1][0]
        coupled = np_drafts(head, ids[0], hidden[0], depth, draw[:, :1])[0]
        assert got[0].tolist() == coupled
        moved += coupled != want[0][0]
    assert moved  # the noise moved a draft off the argmax
    # a draft vocabulary (its columns' token ids shuffled): each column's noise is its token's
    vocab = rng.permutation(m.vocab).astype(np.int64)
    draw = np.array([[1 / 0.7, 1 / 0.7], [12345.0, 9.0], [678.0, 10.0], [4.0, 2.0]])
    k, v = c.caches(2, CAPACITY)
    got = draft(tokens, slots, positions, rows, [8, 13], k, v, draw, vocab)
    for s in (0, 1):
        assert got[s].tolist() == np_drafts(head, ids[s], hidden[s], depth, draw[:, s:s + 1], vocab)[0]
