"""The one decision: how many drafts each decoding slot verifies this step.

A slot whose drafts are accepted with probability a and that verifies k of them emits E(k) = 1 + a + ... + a^k
tokens on average (Leviathan et al., 2023): its j-th draft adds a^j, less than the one before. A step feeding
T tokens costs c(T) (CostModel) plus the drafter's own time d when it speculates. The step maximises emitted
tokens per second, sum_s E_s(k_s) / (c(n + other + sum_s k_s) + d). For a total of K drafts the best split
gives them to the K largest marginal gains a_s^j (each slot's gains decrease with j, so that is a prefix per
slot); every K from 0 to all the drafts offered is priced, and the best kept. That is the exact optimum for
any number of slots, one slot included.
The drafter's time d is spent this step whatever is chosen (it drafted at the end of the last step, and
catches up on this one's tokens), so the choice compares against k = 0 at n / (c(n + other) + d): speculation
is chosen only when the model predicts it min_gain faster (gains smaller than that are within the cost model's
error).
Whether drafting pays for itself is a second answer: the chosen rate against plain decoding without the
drafter, n / c(n + other), by the same margin. The controller detaches slots from a drafter that keeps not
paying (a choice that flips between 0 and 1 draft would otherwise keep a draft model running beside plain
decoding).
"""
from __future__ import annotations

import numpy as np

from specgen.engine.adaptive.costs import CostModel

ALPHA_MAX = 0.999  # acceptance estimates are capped below 1, where E(k) would not converge


def choose_drafts(
    alpha: np.ndarray,  # [num_seqs] acceptance estimate of each slot's drafts
    num_avail: np.ndarray,  # [num_seqs] int64 drafts each slot offers (<= max_draft)
    other_tokens: int,  # tokens of the step that are not decode blocks (prefill chunks)
    draft_seconds: float,  # the drafter's time per speculative step
    cost: CostModel,
    min_gain: float,
    gains: np.ndarray | None = None,  # [num_seqs, >= max(num_avail)] each draft's expected tokens,
    # non-increasing along a row (a token tree's nodes: tree.node_gains); None: alpha ** j, a chain's
) -> tuple[np.ndarray, bool]:
    """Drafts to verify per slot ([num_seqs] int64 in [0, num_avail]), and whether that choice beats plain
    decoding without the drafter's time by min_gain."""
    n = len(num_avail)
    k = np.zeros(n, np.int64)
    width = int(num_avail.max(initial=0))
    if width == 0:
        return k, False
    a = np.minimum(np.maximum(alpha, 0.0), ALPHA_MAX)
    j = np.arange(1, width + 1)  # [width]
    per = a[:, None] ** j[None, :] if gains is None else gains[:, :width]  # [n, width]
    gain = np.where(j[None, :] <= num_avail[:, None], per, -1.0).ravel()  # [n * width]
    total = int(num_avail.sum())
    order = np.argsort(-gain, kind="stable")[:total]  # the offered drafts, largest gain first
    base = n + other_tokens
    emitted = n + np.cumsum(gain[order])  # [total] tokens of the best split of K = 1..total drafts
    rate = emitted / (cost(base + np.arange(1, total + 1)) + draft_seconds)
    best = int(np.argmax(rate))
    if rate[best] <= (1.0 + min_gain) * n / (cost.at(base) + draft_seconds):
        return k, False
    pays = bool(rate[best] > (1.0 + min_gain) * n / cost.at(base))
    return np.bincount(order[:best + 1] // width, minlength=n).astype(np.int64), pays
