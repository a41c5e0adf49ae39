"""Log-probabilities of chosen tokens and the top K per logit row, in numpy: the reference of the fused
backend's operator (kernels/sampling.cc, specgen_logprobs), and the reference backend's own."""
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
    peak = x.max(axis=-1, keepdims=True)
    lse = peak + np.log(np.exp(x - peak).sum(axis=-1, keepdims=True))  # [n, 1]
    logprob = np.take_along_axis(x, tokens[:, None], axis=-1)[:, 0] - lse[:, 0]
    if top == 0:
        return logprob, np.zeros((len(rows), 0), np.int64), np.zeros((len(rows), 0))
    k = min(top + 1, x.shape[-1])
    vals, ids = (a.numpy() for a in paddle.topk(picked, k, axis=-1))
    ids = ids.astype(np.int64)
    if k > top and (vals[:, top] == vals[:, top - 1]).any():  # a tie at the edge: tokens past the k returned
        ids = np.argsort(-x, axis=-1, kind="stable")[:, :k]  # by value, the lower id first
    vals = np.take_along_axis(x, ids, -1) - lse
    order = np.lexsort((ids, -vals), axis=-1)[:, :top]  # by value, then id
    return logprob, np.take_along_axis(ids, order, -1), np.take_along_axis(vals, order, -1)
