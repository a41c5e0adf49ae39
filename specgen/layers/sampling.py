"""Temperature / top-k / top-p / min-p sampling driven by counter-based per-(seed, request, position)
noise: the reference of the fused backend's sampling operator (kernels/sampling.cc), in Paddle's operators and
numpy.

Every output position of every request owns a stream, a pure function of (seed, request id, position): no
global RNG state. The stream gives each token j a Gumbel variable g_j = -log(-log u_j), u_j in (0, 1) from
splitmix64 at counter j. A row's token is the one the filters (top-k, top-p, min-p) keep whose
x_j / temperature + g_j is largest (the lowest id on a tie): the Gumbel-max draw, distributed as the filtered
softmax. Plain and speculative decoding apply the same rule to the same logits row, so a draft is accepted
exactly when it equals the token plain decoding samples. The draw needs each logit only where its key could be
the largest, which lets the fused operator bound most keys without computing them exactly
(kernels/sampling.cc).
"""
from __future__ import annotations

import hashlib

import numpy as np
import paddle

# The sampling rule's version, stored in each output's manifest (a resume across versions is refused): 1, the
# first, in the model's dtype; 2, in double, with min_p (as kernels/sampling.cc computes it): the inverse CDF
# in token order at one uniform per row; 3, the Gumbel-max draw over the kept tokens.
SAMPLER_VERSION = 3
_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_TOPP_CANDIDATES = 256  # top-p looks at this many most likely tokens first; falls back to a full sort


def request_key(seed: int, request_id: str) -> np.uint64:
    """A 64-bit key for one request's random stream."""
    digest = hashlib.blake2b(f"{int(seed)}\x1f{request_id}".encode(), digest_size=8).digest()
    return np.uint64(int.from_bytes(digest, "little"))


def _splitmix64(x: np.ndarray) -> np.ndarray:
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def streams(keys: np.ndarray, out_positions: np.ndarray) -> np.ndarray:
    """[num_rows] uint64: the noise stream of each (request key, output position)."""
    with np.errstate(over="ignore"):
        return _splitmix64(keys.astype(np.uint64) ^ _splitmix64(out_positions.astype(np.uint64)))


def _as_int64(x: int) -> int:
    """A 64-bit word as the int64 with its bits (Paddle's integer tensors are signed; they wrap)."""
    return x - (1 << 64) if x >= 1 << 63 else x


_MIX = [_as_int64(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)]


def _shr(x: paddle.Tensor, bits: int) -> paddle.Tensor:
    """x >> bits, logical (the int64 tensor's bits as a uint64)."""
    return paddle.bitwise_right_shift(x, paddle.full([1], bits, "int64").to(x.place), is_arithmetic=False)


def gumbel_noise(stream: np.ndarray, vocab: int, place=None) -> paddle.Tensor:
    """[num_rows, vocab] float64 tensor (on `place`, in Paddle's operators): token j's Gumbel variable in
    each row's stream: u_j = (m + 1/2) / 2^52 for m the top 52 bits of splitmix64 at counter j (each step
    exact: u in [2^-53, 1 - 2^-53]), g_j = -log(-log u_j). splitmix64 in int64 operators, which wrap as uint64
    ones do."""
    s = paddle.to_tensor(stream.astype(np.uint64).view(np.int64), place=place).unsqueeze(-1)  # [rows, 1]
    # (int64 tensors, not Python ints: Paddle scales a tensor by a Python number in floating point)
    golden, c1, c2 = (paddle.full([1], c, "int64").to(s.place) for c in _MIX)
    x = s + paddle.arange(vocab, dtype="int64").to(s.place).unsqueeze(0) * golden + golden  # [rows, vocab]
    x = paddle.bitwise_xor(x, _shr(x, 30)) * c1
    x = paddle.bitwise_xor(x, _shr(x, 27)) * c2
    x = paddle.bitwise_xor(x, _shr(x, 31))
    u = (_shr(x, 12).astype("float64") + 0.5) * (1.0 / 4503599627370496.0)
    return -paddle.log(-paddle.log(u))


def gumbels_at(stream: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """gumbel_noise's values in numpy (the CPU's faster path): token tokens[...] of stream stream[...] (the
    two broadcast together) -> float64 of their shape."""
    with np.errstate(over="ignore"):
        h = _splitmix64(stream.astype(np.uint64) + tokens.astype(np.uint64) * _GOLDEN)
    u = ((h >> np.uint64(12)).astype(np.float64) + 0.5) * (1.0 / 4503599627370496.0)
    return -np.log(-np.log(u))


def gumbels(stream: np.ndarray, vocab: int) -> np.ndarray:
    """[num_rows, vocab] float64: every token's Gumbel variable in each row's stream (gumbel_noise's)."""
    return gumbels_at(stream[:, None], np.arange(vocab)[None, :])


DRAFT_SPAN = 12.0  # coupled_drafts: columns whose scaled logit is within this of the argmax's compete


def coupled_drafts(logits: np.ndarray, ids: np.ndarray | None, draw: np.ndarray,
                   depth: int = 0) -> np.ndarray:
    """[n] LM-head columns: drafts coupled to the tokens verification will sample (the fused MTP pass's rule,
    kernels/cpu_ops.cc coupled_draft). Row i of logits [n, v] (a drafter's LM head; its columns' token ids
    `ids`, None: the column) with draw[:, i] (MtpPass.draw: 1 / temperature, key high and low 32 bits, first
    draft's output position) above 0 takes the Gumbel-max draw with the noise the main model's sampler uses
    at output position draw[3, i] + depth, among the columns whose scaled logit is within DRAFT_SPAN of the
    argmax's (the lowest column on a tie); the others, the argmax. Where the drafter's distribution is near
    the main model's the two draws agree more often than its argmax is sampled."""
    x = logits.astype(np.float64)
    top = np.where(np.isnan(x), -np.inf, x).argmax(axis=-1)  # (NaN never wins, as the fused argmax)
    rows = np.nonzero(draw[0] > 0)[0]
    if not len(rows):
        return top
    out = top.copy()
    keys = draw[1, rows].astype(np.uint64) << np.uint64(32) | draw[2, rows].astype(np.uint64)
    stream = streams(keys, draw[3, rows].astype(np.int64) + depth)  # [rows]
    scaled = x[rows] * draw[0, rows, None]  # [rows, v]
    best = scaled[np.arange(len(rows)), top[rows]]
    cand = scaled >= (best - DRAFT_SPAN)[:, None]  # (a NaN argmax: none compares, the argmax stays)
    token = np.arange(x.shape[1]) if ids is None else ids
    g = gumbels_at(stream[:, None], token[None, :])
    pick = np.where(cand, scaled + g, -np.inf).argmax(axis=-1)  # the lowest column on a tie
    out[rows] = np.where(cand.any(axis=-1), pick, top[rows])
    return out


def _top_p_threshold(probs: paddle.Tensor, top_p: paddle.Tensor) -> paddle.Tensor:
    """Smallest probability kept by top-p: keep the most likely tokens until their mass reaches top_p.

    Returns [rows, 1]. Ties at the threshold are all kept, so the rule is independent of sort order.
    """
    vocab = probs.shape[-1]
    k = min(vocab, _TOPP_CANDIDATES)
    vals, _ = paddle.topk(probs, k, axis=-1)  # [rows, k] descending
    before = paddle.cumsum(vals, axis=-1) - vals  # mass strictly before each candidate
    if k < vocab and bool((before[:, -1] + vals[:, -1] < top_p).any()):
        vals = paddle.sort(probs, axis=-1, descending=True)
        before = paddle.cumsum(vals, axis=-1) - vals
    kept = paddle.sum((before < top_p.unsqueeze(-1)).astype("int64"), axis=-1, keepdim=True)  # >= 1
    return paddle.take_along_axis(vals, kept - 1, axis=-1)


def sample(
    logits: paddle.Tensor,  # [rows, vocab]
    temperature: np.ndarray,  # [rows] float64, 0 = greedy
    top_k: np.ndarray,  # [rows] int64, 0 = off
    top_p: np.ndarray,  # [rows] float64, 1 = off
    stream: np.ndarray | None,  # [rows] uint64 (streams); read at sampled rows only (None: every row greedy)
    greedy: np.ndarray | None = None,  # [rows] int64 the logits' argmax, where the forward computed it
    # already
    min_p: np.ndarray | None = None,  # [rows] float64, 0 = off: keep tokens at least min_p as likely as the
    # most likely one (after top-k and top-p); None: off everywhere
) -> np.ndarray:
    """Token per row; [rows] int64. Greedy rows take the argmax (lowest id on a tie); a temperature that is
    not above 0 (NaN included) is greedy. Sampled rows take the kept token with the largest
    x * (1 / temperature) + g in double (NaN keys never win; a row with no key above -inf keeps its
    argmax)."""
    if greedy is None:
        greedy = paddle.argmax(logits, axis=-1).numpy()  # [rows] the lowest id on a tie
    rows = np.nonzero(temperature > 0)[0]
    if len(rows) == 0:
        return greedy
    picked = paddle.gather(logits, paddle.to_tensor(rows, place=logits.place))
    mp = np.zeros(len(rows)) if min_p is None else min_p[rows]
    unfiltered = (top_k[rows] <= 0) & (top_p[rows] >= 1) & (mp <= 0)  # [n] (top_k >= vocab keeps every token)
    probs = None
    if not unfiltered.all():
        probs = filtered_probs(picked, temperature[rows], top_k[rows], top_p[rows], mp)
    inv_t = 1.0 / temperature[rows]  # [n] float64
    if logits.place.is_cpu_place():
        best, found = _draw_numpy(picked.astype("float64").numpy(), inv_t, stream[rows], unfiltered,
                                  None if probs is None else probs.numpy() > 0)
    else:
        best, found = _draw(picked.astype("float64"), inv_t, stream[rows], unfiltered, probs)
    out = greedy.copy()
    out[rows[found]] = best[found]
    return out


def _draw(x: paddle.Tensor, inv_t: np.ndarray, stream: np.ndarray, unfiltered: np.ndarray,
          probs: paddle.Tensor | None) -> tuple[np.ndarray, np.ndarray]:
    """The Gumbel-max draw of rows x [n, vocab] (float64) in Paddle's operators, on x's device: (each row's
    token, whether any key was above -inf); probs: filtered_probs's rows (None: no row filtered)."""
    scale = paddle.to_tensor(inv_t, place=x.place).unsqueeze(-1)
    keys = x * scale + gumbel_noise(stream, x.shape[1], x.place)
    valid = ~paddle.isnan(keys)
    if probs is not None:
        valid = valid & ((probs > 0) | paddle.to_tensor(unfiltered, place=x.place).unsqueeze(-1))
    keys = paddle.where(valid, keys, paddle.full_like(keys, -np.inf))
    return paddle.argmax(keys, axis=-1).numpy(), paddle.max(keys, axis=-1).numpy() > -np.inf


def _draw_numpy(x: np.ndarray, inv_t: np.ndarray, stream: np.ndarray, unfiltered: np.ndarray,
                kept: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """_draw in numpy, for rows on the CPU (Paddle's int64 operators took ~4x as long): the keys of a filtered
    row only at the tokens it keeps."""
    keys = np.full(x.shape, -np.inf)
    every = np.nonzero(unfiltered)[0]
    if len(every):
        keys[every] = x[every] * inv_t[every, None] + gumbels(stream[every], x.shape[1])
    if kept is not None:
        r, c = np.nonzero(kept & ~unfiltered[:, None])
        keys[r, c] = x[r, c] * inv_t[r] + gumbels_at(stream[r], c)
    keys = np.where(np.isnan(keys), -np.inf, keys)
    best = keys.argmax(axis=-1)  # the lowest id on a tie
    return best, keys[np.arange(len(x)), best] > -np.inf


def filtered_probs(
    logits: paddle.Tensor,  # [n, vocab] sampled rows
    temperature: np.ndarray,  # [n] float64 > 0
    top_k: np.ndarray,  # [n] int64, 0 = off
    top_p: np.ndarray,  # [n] float64, 1 = off
    min_p: np.ndarray | None = None,  # [n] float64, 0 = off; None: off everywhere
) -> paddle.Tensor:
    """[n, vocab] float64: each row's softmax at its temperature, the tokens top-k, top-p and min-p leave out
    set to 0 (not renormalized): the distribution `sample` draws from."""
    dtype = "float64"  # in double whatever the model's dtype, as the fused operator: the same tokens
    x = logits.astype(dtype)
    x = x / paddle.to_tensor(temperature, dtype=dtype).unsqueeze(-1)
    if (top_k > 0).any():
        kmax = int(min(top_k.max(), x.shape[-1]))
        vals, _ = paddle.topk(x, kmax, axis=-1)  # [n, kmax]
        at = paddle.to_tensor(np.clip(top_k, 1, kmax) - 1).unsqueeze(-1)  # [n, 1] the k-th largest's column
        kth = paddle.take_along_axis(vals, at, axis=-1)
        kth = paddle.where(paddle.to_tensor(top_k > 0).unsqueeze(-1), kth, paddle.full_like(kth, -np.inf))
        x = paddle.where(x < kth, paddle.full_like(x, -np.inf), x)
    probs = paddle.nn.functional.softmax(x, axis=-1)  # [n, vocab]
    # (Paddle's softmax gives -inf a weight of ~1e-28 on the CPU: the tokens top-k leaves out weigh exactly 0)
    probs = paddle.where(x == -np.inf, paddle.zeros_like(probs), probs)
    if (top_p < 1).any():
        thr = _top_p_threshold(probs, paddle.to_tensor(top_p, dtype=dtype))
        thr = paddle.where(paddle.to_tensor(top_p < 1).unsqueeze(-1), thr, paddle.zeros_like(thr))
        probs = paddle.where(probs < thr, paddle.zeros_like(probs), probs)
    if min_p is not None and (min_p > 0).any():
        floor = paddle.max(probs, axis=-1, keepdim=True) * paddle.to_tensor(min_p, dtype=dtype).unsqueeze(-1)
        probs = paddle.where(probs < floor, paddle.zeros_like(probs), probs)
    return probs
