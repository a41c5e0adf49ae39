"""Counter-based sampling: repeatable, and distributed as the filtered softmax (chi-square)."""
import numpy as np
import paddle
import pytest

from specgen.engine.sampling import request_key, sample, uniforms

VOCAB = 12
LOGITS = np.array([2.0, 1.5, 1.4, 1.0, 0.5, 0.3, 0.0, -0.2, -0.5, -1.0, -2.0, -3.0])


def target_probs(temperature, top_k, top_p):
    x = LOGITS / temperature
    if top_k:
        x = np.where(x < np.sort(x)[::-1][top_k - 1], -np.inf, x)
    p = np.exp(x - x.max())
    p /= p.sum()
    if top_p < 1:
        order = np.argsort(-p)
        before = np.cumsum(p[order]) - p[order]
        keep = order[before < top_p]
        p = np.where(np.isin(np.arange(VOCAB), keep), p, 0)
        p /= p.sum()
    return p


def chi2_critical(df, z=3.09):  # Wilson-Hilferty: the 0.999 quantile of chi-square(df)
    return df * (1 - 2 / (9 * df) + z * np.sqrt(2 / (9 * df))) ** 3


def draw(n, temperature, top_k, top_p, seed=0):
    keys = np.array([request_key(seed, f"req-{i}") for i in range(n)], dtype=np.uint64)
    u = uniforms(keys, np.full(n, 7))
    logits = paddle.to_tensor(np.tile(LOGITS, (n, 1)).astype("float32"))
    return sample(logits, np.full(n, temperature), np.full(n, top_k, np.int64), np.full(n, top_p), u)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 4, 1.0),
                                                     (1.0, 0, 0.8), (0.9, 6, 0.7)])
def test_frequencies_match_filtered_softmax(temperature, top_k, top_p):
    n = 20000
    counts = np.bincount(draw(n, temperature, top_k, top_p), minlength=VOCAB)
    p = target_probs(temperature, top_k, top_p)
    assert counts[p == 0].sum() == 0  # filtered tokens are never drawn
    support = p > 0
    expected = n * p[support]
    chi2 = ((counts[support] - expected) ** 2 / expected).sum()
    assert chi2 < chi2_critical(support.sum() - 1)


def test_seeded_draws_repeat_and_seeds_differ():
    a, b, c = draw(500, 1.0, 0, 1.0, seed=1), draw(500, 1.0, 0, 1.0, seed=1), draw(500, 1.0, 0, 1.0, seed=2)
    assert (a == b).all() and (a != c).any()


def test_uniforms_in_unit_interval_and_position_dependent():
    keys = np.full(1000, request_key(0, "x"), dtype=np.uint64)
    u = uniforms(keys, np.arange(1000))
    assert (u > 0).all() and (u <= 1).all() and len(np.unique(u)) == 1000
    assert abs(u.mean() - 0.5) < 0.05


def test_greedy_rows_take_argmax_and_mixed_rows():
    logits = paddle.to_tensor(np.stack([LOGITS, LOGITS[::-1]]).astype("float32"))
    out = sample(logits, np.array([0.0, 0.0]), np.zeros(2, np.int64), np.ones(2), np.array([0.5, 0.5]))
    assert out.tolist() == [0, VOCAB - 1]
    out = sample(logits, np.array([0.0, 1.0]), np.array([0, 1]), np.ones(2), np.array([0.5, 0.99]))
    assert out.tolist() == [0, VOCAB - 1]  # top_k=1 leaves only the argmax
