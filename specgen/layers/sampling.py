"""Temperature / top-k / top-p / min-p sampling driven by counter-based per-(seed, request, position)
uniforms: the reference of the fused backend's sampling operator (kernels/sampling.cc), in Paddle's operators.

Every output position of every request owns one uniform u in (0, 1], a pure function of (seed, request id,
position): no global RNG state. A token is sampled by filtering, normalizing, and taking the first token
(in token-id order) where the cumulative probability reaches u. Plain and speculative decoding apply the same
rule to the same logits row, so a draft is accepted exactly when it equals the token plain decoding samples.
"""
from __future__ import annotations

import hashlib

import numpy as np
import paddle

# The sampling rule's version, stored in each output's manifest (a resume across versions is refused): 1, the
# first, in the model's dtype; 2, in double, with min_p (as kernels/sampling.cc computes it).
SAMPLER_VERSION = 2
_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)
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


def uniforms(keys: np.ndarray, out_positions: np.ndarray) -> np.ndarray:
    """u in (0, 1] for each (request key, output position); [num_rows] float64."""
    with np.errstate(over="ignore"):
        x = _splitmix64(keys.astype(np.uint64) ^ _splitmix64(out_positions.astype(np.uint64)))
    return ((x >> np.uint64(11)).astype(np.float64) + 1.0) * (1.0 / 9007199254740992.0)


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
    u: np.ndarray | None,  # [rows] float64 in (0, 1]; only read at sampled rows (None: every row is greedy)
    greedy: np.ndarray | None = None,  # [rows] int64 the logits' argmax, where the forward computed it
    # already
    min_p: np.ndarray | None = None,  # [rows] float64, 0 = off: keep tokens at least min_p as likely as the
    # most likely one (after top-k and top-p); None: off everywhere
) -> np.ndarray:
    """Token per row; [rows] int64. Greedy rows take the argmax (lowest id on a tie)."""
    if greedy is None:
        greedy = paddle.argmax(logits, axis=-1).numpy()  # [rows] the lowest id on a tie
    sampled_rows = np.nonzero(temperature > 0)[0]
    if len(sampled_rows) == 0:
        return greedy
    mp = None if min_p is None else min_p[sampled_rows]
    probs = filtered_probs(paddle.gather(logits, paddle.to_tensor(sampled_rows)), temperature[sampled_rows],
                           top_k[sampled_rows], top_p[sampled_rows], mp)
    cdf = paddle.cumsum(probs, axis=-1)  # [n, vocab]
    target = cdf[:, -1:] * paddle.to_tensor(u[sampled_rows], dtype=probs.dtype).unsqueeze(-1)
    idx = paddle.sum((cdf < target).astype("int64"), axis=-1)  # first index where cdf >= target
    idx = paddle.clip(idx, max=probs.shape[-1] - 1)
    out = greedy.copy()
    out[sampled_rows] = idx.numpy()
    return out


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
    if (top_p < 1).any():
        thr = _top_p_threshold(probs, paddle.to_tensor(top_p, dtype=dtype))
        thr = paddle.where(paddle.to_tensor(top_p < 1).unsqueeze(-1), thr, paddle.zeros_like(thr))
        probs = paddle.where(probs < thr, paddle.zeros_like(probs), probs)
    if min_p is not None and (min_p > 0).any():
        floor = paddle.max(probs, axis=-1, keepdim=True) * paddle.to_tensor(min_p, dtype=dtype).unsqueeze(-1)
        probs = paddle.where(probs < floor, paddle.zeros_like(probs), probs)
    return probs
