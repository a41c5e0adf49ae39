"""The fused log-probabilities operator (kernels/sampling.cc, specgen_logprobs) against its numpy reference
(layers/logprobs.py): the same top tokens in the same order (ties by id, ties reaching past the top
included), values within 1e-12, and each row's result independent of the rows beside it."""
import numpy as np
import paddle
import pytest

from specgen.kernels import args, ops
from specgen.layers.logprobs import row_logprobs

pytestmark = pytest.mark.skipif(ops() is None, reason="the fused kernels cannot be built here")


def _fused(logits, rows, tokens, top):
    picked = paddle.gather(logits, paddle.to_tensor(rows))
    return tuple(t.numpy() for t in args.logprobs(ops(), picked, paddle.to_tensor(tokens), top))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("top", [0, 1, 5, 20])
def test_operator_equals_reference(dtype, top):
    rng = np.random.default_rng(top)
    x = rng.normal(0, 3, (9, 5003)).astype(dtype)
    x[1, :40] = x[1].max() + 1  # 40 tokens tied for the top: the lowest ids come first
    x[2, rng.choice(5003, 30, replace=False)] = 7.5  # ties across the top's edge
    x[3] = 0.0  # a flat row
    x[4, 17] = 80.0  # one certain token: others' log-probabilities far below
    logits = paddle.to_tensor(x)
    rows = np.array([0, 1, 2, 3, 4, 5, 8, 8, 6])
    tokens = rng.integers(0, 5003, len(rows))
    want = row_logprobs(logits, rows, tokens, top)
    got = _fused(logits, rows, tokens, top)
    assert np.array_equal(got[1], want[1])
    np.testing.assert_allclose(got[0], want[0], rtol=0, atol=1e-12)
    np.testing.assert_allclose(got[2], want[2], rtol=0, atol=1e-12)
    if top:
        assert got[1][1].tolist() == list(range(top)) and got[1][4][0] == 17
    alone = [_fused(logits, rows[i:i + 1], tokens[i:i + 1], top) for i in range(len(rows))]
    for i, one in enumerate(alone):  # bit for bit, whatever the batch
        assert one[0][0] == got[0][i] and np.array_equal(one[2][0], got[2][i])
