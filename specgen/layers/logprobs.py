"""Log-probabilities of chosen tokens and the top K per logit row, in numpy: the reference of the fused
backend's operator (kernels/sampling.cc, specgen_logprobs), and the reference backend's own; and those of the
distribution a row is sampled from (logprobs_mode processed: layers/sampling.py's filters, in numpy)."""
from __future__ import annotations

import numpy as np
import paddle


def row_logprobs(
    logits: paddle.Tensor,  # [num_logits, vocab]
    rows: np.ndarray,  # [n] int64 the rows wanted
    tokens: np.ndarray,  # [n] int64 the token chosen at each of them
    top: int,  # most likely tokens wanted per row (0: none)
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(logprob [n] float64 of each chosen token, top_ids [n, top] int64, top_logprobs [n, top] float64): the
    log-softmax in float64, its normalizer in numpy, whose reductions along a row do not depend on the other
    rows (Paddle's logsumexp gave the same row other bits at batch 1 than at batch 4). The top tokens come
    most likely first, the lower id first on a tie: Paddle's top-k of the logits (the log-softmax keeps their
    order), re-sorted here; a full sort of the rows when a tie reaches past the top."""
    picked = paddle.gather(logits, paddle.to_tensor(rows))  # [n, vocab]
    x = picked.numpy().astype(np.float64)
    if top == 0:
        return _logprobs_of(x, tokens, 0)
    k = min(top + 1, x.shape[-1])
    vals, ids = (a.numpy() for a in paddle.topk(picked, k, axis=-1))
    return _logprobs_of(x, tokens, top, ids.astype(np.int64), vals)


def _logprobs_of(x: np.ndarray, tokens: np.ndarray, top: int, ids: np.ndarray | None = None,
                 vals: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """row_logprobs over float64 rows x [n, vocab] (-inf entries: tokens no sample can take); ids / vals: the
    rows' top k > top candidates, if known (else found here)."""
    peak = x.max(axis=-1, keepdims=True)
    lse = peak + np.log(np.exp(x - peak).sum(axis=-1, keepdims=True))  # [n, 1]
    logprob = np.take_along_axis(x, tokens[:, None], axis=-1)[:, 0] - lse[:, 0]
    if top == 0:
        return logprob, np.zeros((len(x), 0), np.int64), np.zeros((len(x), 0))
    k = min(top + 1, x.shape[-1])
    if ids is None:
        ids = np.argsort(-x, axis=-1, kind="stable")[:, :k]
        vals = np.take_along_axis(x, ids, -1)
    if k > top and (vals[:, top] == vals[:, top - 1]).any():  # a tie at the edge: tokens past the k returned
        ids = np.argsort(-x, axis=-1, kind="stable")[:, :k]  # by value, the lower id first
    vals = np.take_along_axis(x, ids, -1) - lse
    order = np.lexsort((ids, -vals), axis=-1)[:, :top]  # by value, then id
    return logprob, np.take_along_axis(ids, order, -1), np.take_along_axis(vals, order, -1)


def processed_logprobs(
    x: np.ndarray,  # [n, vocab] the rows' logits after penalties, logit bias and masks
    temperature: np.ndarray,  # [n] float64, 0 = greedy
    top_k: np.ndarray,  # [n] int64, 0 = off
    top_p: np.ndarray,  # [n] float64, 1 = off
    min_p: np.ndarray,  # [n] float64, 0 = off
    tokens: np.ndarray,  # [n] int64 the token chosen at each row
    top: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """row_logprobs of the distribution each row is sampled from (layers/sampling.py's rule, in float64):
    sampled rows divided by their temperature, then top-k, top-p (ties at the threshold kept) and min-p, the
    tokens filtered out at -inf; greedy rows as given. Top tokens at -inf come back as -inf (the writer leaves
    them out)."""
    x = x.astype(np.float64, copy=True)
    s = temperature > 0
    if s.any():
        z = x[s] / temperature[s, None]
        rows = np.arange(len(z))
        ks = np.clip(top_k[s], 0, z.shape[1])
        if (ks > 0).any():  # the k-th largest of each row (all rows at once; k = 0: off)
            kth = -np.sort(-z, axis=1)[rows, np.maximum(ks, 1) - 1]
            z[(ks[:, None] > 0) & (z < kth[:, None])] = -np.inf
        e = np.exp(z - z.max(axis=1, keepdims=True))
        p = e / e.sum(axis=1, keepdims=True)  # (top-k's tokens at 0)
        ps = top_p[s]
        if (ps < 1).any():  # the smallest probability kept: the most likely until their mass reaches top_p
            vals = -np.sort(-p, axis=1)
            before = np.cumsum(vals, axis=1) - vals
            kept = np.maximum(1, (before < ps[:, None]).sum(axis=1))
            threshold = np.where(ps < 1, vals[rows, kept - 1], 0.0)
            p[p < threshold[:, None]] = 0.0
        mp = min_p[s]
        if (mp > 0).any():
            floor = p.max(axis=1, keepdims=True) * mp[:, None]
            p[p < floor] = 0.0
        z[p == 0] = -np.inf
        x[s] = z
    return _logprobs_of(x, tokens, top)
