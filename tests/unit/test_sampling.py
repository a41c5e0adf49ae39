"""Counter-based sampling: repeatable, distributed as the filtered softmax (chi-square), and the fused
operator (kernels/sampling.cc) the same tokens as its Paddle reference."""
import numpy as np
import paddle
import pytest

from specgen import kernels
from specgen.config import SamplingParams
from specgen.errors import ConfigError
from specgen.kernels import args
from specgen.layers.sampling import filtered_probs, gumbels, request_key, sample, streams

OPS = kernels.ops()
needs_ops = pytest.mark.skipif(OPS is None, reason="specgen's CPU kernels could not be built here")

VOCAB = 12
LOGITS = np.array([2.0, 1.5, 1.4, 1.0, 0.5, 0.3, 0.0, -0.2, -0.5, -1.0, -2.0, -3.0])


def target_probs(temperature, top_k, top_p, min_p=0.0):
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
    if min_p:
        p = np.where(p >= min_p * p.max(), p, 0)
        p /= p.sum()
    return p


def chi2_critical(df, z=3.09):  # Wilson-Hilferty: the 0.999 quantile of chi-square(df)
    return df * (1 - 2 / (9 * df) + z * np.sqrt(2 / (9 * df))) ** 3


M64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15


def _mix(x: int) -> int:  # splitmix64 (layers/sampling.py's), on Python ints
    x = (x + GOLDEN) & M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def _unshift(y: int, s: int) -> int:  # x with x ^ (x >> s) == y
    x = y
    for _ in range(64 // s + 1):
        x = y ^ (x >> s)
    return x


def _unmix(x: int) -> int:  # _mix's inverse (each step is a bijection of 64-bit words)
    x = _unshift(x, 31)
    x = (x * pow(0x94D049BB133111EB, -1, 1 << 64)) & M64
    x = _unshift(x, 27)
    x = (x * pow(0xBF58476D1CE4E5B9, -1, 1 << 64)) & M64
    x = _unshift(x, 30)
    return (x - GOLDEN) & M64


def key_with_noise(token: int, m: int, position: int) -> int:
    """A request key whose stream at `position` gives `token` the uniform (m + 1/2) / 2^52 (m < 2^52): the
    operator computes the noise from (key, position), so a test that picks a token's noise picks the key."""
    stream = (_unmix(m << 12) - token * GOLDEN) & M64
    key = _unmix(stream) ^ _mix(position)
    assert int(streams(np.array([key], np.uint64), np.array([position]))[0]) == stream
    return key


def random_keys(rng, n):
    return rng.integers(0, 2 ** 63, n, dtype=np.int64).astype(np.uint64) * np.uint64(2) + np.uint64(1)


def positions_of(n):
    return 3 + 7919 * np.arange(n)  # (output positions up to ~500,000 in the tests)


def reference(logits, temperature, top_k, top_p, keys, positions=None, greedy=None, min_p=None):
    """layers/sampling.py's sample, each row's stream that of (key, position)."""
    positions = positions_of(len(temperature)) if positions is None else positions
    return sample(logits, temperature, top_k, top_p, streams(keys, positions), greedy, min_p)


def fused(logits, temperature, top_k, top_p, keys, positions=None, greedy=None, min_p=None):
    """The fused operator, called as `reference` is."""
    greedy = paddle.argmax(logits, axis=-1).numpy() if greedy is None else greedy
    min_p = np.zeros(len(temperature)) if min_p is None else min_p
    positions = positions_of(len(temperature)) if positions is None else positions
    params = np.stack(args.sample_rows(args.SampleArgs(temperature, top_k, top_p, min_p, keys, positions,
                                                       greedy)))
    return args.sample(OPS, logits, paddle.to_tensor(params.astype(np.float64))).numpy()


SAMPLERS = {"reference": reference, "fused": pytest.param(fused, marks=needs_ops)}


def draw(n, temperature, top_k, top_p, seed=0, min_p=0.0, sampler=reference):
    keys = np.array([request_key(seed, f"req-{i}") for i in range(n)], dtype=np.uint64)
    logits = paddle.to_tensor(np.tile(LOGITS, (n, 1)).astype("float32"))
    return sampler(logits, np.full(n, temperature), np.full(n, top_k, np.int64), np.full(n, top_p), keys,
                   np.full(n, 7), None, np.full(n, min_p))


@pytest.mark.parametrize("sampler", SAMPLERS.values(), ids=SAMPLERS.keys())
@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [
    (1.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.0), (1.3, 4, 1.0, 0.0), (1.0, 0, 0.8, 0.0), (0.9, 6, 0.7, 0.0),
    (1.0, 0, 1.0, 0.2), (0.8, 8, 0.9, 0.1)])
def test_frequencies_match_filtered_softmax(sampler, temperature, top_k, top_p, min_p):
    n = 20000
    counts = np.bincount(draw(n, temperature, top_k, top_p, min_p=min_p, sampler=sampler), minlength=VOCAB)
    p = target_probs(temperature, top_k, top_p, min_p)
    assert counts[p == 0].sum() == 0  # filtered tokens are never drawn
    support = p > 0
    expected = n * p[support]
    chi2 = ((counts[support] - expected) ** 2 / expected).sum()
    assert chi2 < chi2_critical(support.sum() - 1)


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [
    (1.0, 0, 1.0, 0.0), (0.7, 0, 1.0, 0.0), (1.3, 4, 1.0, 0.0), (1.0, 0, 0.8, 0.0), (0.8, 8, 0.9, 0.1)])
def test_filtered_probs_are_the_distribution_sample_draws_from(temperature, top_k, top_p, min_p):
    """The distribution `sample` draws from (benchmarks read it): renormalized, the filtered softmax."""
    w = filtered_probs(paddle.to_tensor(LOGITS[None, :]), np.array([temperature]), np.array([top_k]),
                       np.array([top_p]), np.array([min_p])).numpy()[0]
    np.testing.assert_allclose(w / w.sum(), target_probs(temperature, top_k, top_p, min_p), rtol=1e-12,
                               atol=1e-15)


def test_seeded_draws_repeat_and_seeds_differ():
    a, b, c = draw(500, 1.0, 0, 1.0, seed=1), draw(500, 1.0, 0, 1.0, seed=1), draw(500, 1.0, 0, 1.0, seed=2)
    assert (a == b).all() and (a != c).any()


def test_streams_differ_by_position_and_their_noise_is_gumbel():
    keys = np.full(1000, request_key(0, "x"), dtype=np.uint64)
    assert len(np.unique(streams(keys, np.arange(1000)))) == 1000
    g = gumbels(streams(keys[:40], np.arange(40)), 5000)  # [40, 5000]
    assert np.isfinite(g).all() and g.max() <= 36.8 and g.min() >= -3.7  # u in [2^-53, 1 - 2^-53]
    assert abs(g.mean() - 0.5772) < 0.01 and abs(g.var() - np.pi ** 2 / 6) < 0.03  # Gumbel(0, 1)
    assert abs(np.corrcoef(g[:, :-1].ravel(), g[:, 1:].ravel())[0, 1]) < 0.01  # neighbours independent


def test_greedy_rows_take_argmax_and_mixed_rows():
    logits = paddle.to_tensor(np.stack([LOGITS, LOGITS[::-1]]).astype("float32"))
    keys = np.array([5, 6], np.uint64)
    out = reference(logits, np.array([0.0, 0.0]), np.zeros(2, np.int64), np.ones(2), keys)
    assert out.tolist() == [0, VOCAB - 1]
    out = reference(logits, np.array([0.0, 1.0]), np.array([0, 1]), np.ones(2), keys)
    assert out.tolist() == [0, VOCAB - 1]  # top_k=1 leaves only the argmax


@needs_ops
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_fused_operator_gives_the_references_tokens(dtype):
    """Random logits, every filter alone and together, greedy rows among sampled ones, a vocabulary of
    several thousand and ties: the operator's tokens are the reference's, row for row."""
    rng = np.random.default_rng(7)
    rows, vocab = 48, 3000
    for temperature, top_k, top_p, min_p in [(0.8, 0, 1.0, 0.0), (1.0, 0, 0.9, 0.0), (0.7, 40, 1.0, 0.0),
                                             (1.0, 20, 0.8, 0.05), (0.6, 0, 1.0, 0.1), (1.3, 0, 0.95, 0.0),
                                             (1.0, 1, 1.0, 0.0), (2.0, 5000, 0.5, 0.5),
                                             (1.0, 0, 1.0, 1e-12), (0.9, 2500, 1.0, 0.0)]:  # > 2,048 kept
        x = rng.standard_normal((rows, vocab)) * 3
        x[::5, 100:110] = x[::5, 100:101]  # ties at the top of some rows
        logits = paddle.to_tensor(x.astype(dtype))
        temp = np.full(rows, temperature)
        temp[::7] = 0.0  # greedy rows keep the forward's argmax
        settings = (temp, np.full(rows, top_k, np.int64), np.full(rows, top_p), random_keys(rng, rows), None)
        greedy = paddle.argmax(logits, axis=-1).numpy()
        min_ps = np.full(rows, min_p)
        ref = reference(logits, *settings, greedy, min_ps)
        assert (fused(logits, *settings, greedy, min_ps) == ref).all(), (temperature, top_k, top_p, min_p)


@needs_ops
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_fused_operator_finds_the_maximum_anywhere_in_the_row(dtype):
    """The row's maximum (scanned in 16 lanes) wherever it lies: first, at a lane's edge, in the tail past the
    last whole 16, last; vocabularies shorter than 16 and not multiples of it. One logit 10 above the rest at
    temperature 0.05 takes all the weight, so the token is its id, as the reference's. A maximum found wrong
    breaks it: the draw starts from the maximum's key, and its logit 10 above the rest at T 0.05 is 200 above
    theirs, more than any noise (|g| < 37) makes up; a maximum found wrong starts from a key too low (every
    token then gets its exact key, and the argmax still wins) or one no token reaches (the greedy token then
    comes back: the row at 0 in a lane started at 0 over negative logits)."""
    for vocab in (7, 16, 17, 3000, 49157):
        for at in sorted({0, min(15, vocab - 1), min(16, vocab - 1), vocab // 2, vocab - 1}):
            rng = np.random.default_rng(vocab + at)
            x = rng.uniform(-1.0, 1.0, (4, vocab))
            x[:, at] = 10.0
            x[1] -= 20.0  # every logit negative
            x[2, (at + 1) % vocab] = -np.inf  # a masked token beside it
            logits = paddle.to_tensor(x.astype(dtype))
            settings = (np.full(4, 0.05), np.zeros(4, np.int64), np.array([1.0, 1.0, 0.9, 1.0]),
                        np.arange(4, dtype=np.uint64) + np.uint64(vocab))
            assert fused(logits, *settings).tolist() == reference(logits, *settings).tolist() == [at] * 4, (
                vocab, at)


@needs_ops
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_one_row_split_over_the_threads_gives_the_batched_rows_tokens(dtype):
    """A step of one row (batch 1) splits the row's passes over the threads: a row alone samples the token it
    samples among 64 rows (one row a thread) and the reference's, for 64 keys, under each filter, on a
    vocabulary of 49,157 (the default model's 49,152 and a tail past the last block); the likely tokens late
    in the row (a maximum taken from the first part alone fails it); and a row whose first logit is NaN (a
    broken row: every weight NaN), the same garbage both ways."""
    rng = np.random.default_rng(11)
    vocab, n = 49157, 64
    cases = [(0.8, 0, 1.0, 0.0, ""), (0.8, 0, 0.95, 0.0, ""), (1.0, 30, 0.9, 0.02, ""),
             (0.05, 0, 1.0, 0.0, "late top"), (0.05, 0, 0.9, 0.0, "late top"), (0.7, 0, 0.8, 0.0, "nan"),
             (1.2, 0, 0.999, 0.0, "")]  # (thousands kept: their keys bounded, as an unfiltered row's)
    for temperature, top_k, top_p, min_p, how in cases:
        x = rng.standard_normal(vocab) * 1.5
        if how == "late top":  # likely tokens past the row's first half, > 100 T above every earlier logit
            x[30000:30010] = 14.0 + 0.05 * rng.standard_normal(10)  # (from a part's maximum: they overflow)
        nan = how == "nan"
        if nan:
            x[0] = np.nan
        logits = paddle.to_tensor(np.tile(x, (n, 1)).astype(dtype))
        settings = (np.full(n, temperature), np.full(n, top_k, np.int64), np.full(n, top_p),
                    random_keys(rng, n), positions_of(n), None, np.full(n, min_p))
        batched = fused(logits, *settings)
        alone = [int(fused(logits[i:i + 1], *(a if a is None else a[i:i + 1] for a in settings))[0])
                 for i in range(n)]
        assert alone == batched.tolist(), (temperature, top_k, top_p, min_p, how)
        # (the NaN row: the reference's filtered softmax keeps nothing, the operator's weights are not finite:
        # both keep the greedy token)
        assert alone == reference(logits, *settings).tolist(), (temperature, top_k, top_p, min_p, how)
        assert nan or len(set(alone)) > 3  # the keys reach several tokens: a wrong weight moves some


@needs_ops
def test_a_nan_temperature_row_is_greedy_in_both_samplers():
    logits = paddle.to_tensor(np.tile(LOGITS[::-1], (2, 1)).astype("float32"))
    settings = (np.array([np.nan, 0.0]), np.zeros(2, np.int64), np.ones(2), np.array([1, 2], np.uint64))
    assert fused(logits, *settings).tolist() == reference(logits, *settings).tolist() == [VOCAB - 1] * 2


@needs_ops
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_largest_noise_a_hair_either_side_of_the_most_likely_tokens_key(dtype):
    """Token j's noise at its largest (u = 1 - 2^-53, g = 36.74: where the operator's bound on it is
    tightest), its logit set so that its key lies just above, or just below, the most likely token's: the
    operator finds the reference's token either way, on a row longer than a vector and in the tail past the
    last whole 8."""
    temperature, vocab = 0.5, 1003
    for j in (517, 1001):
        for gap in (1e-6, -1e-6, 1e-3, -1e-3):
            x = np.zeros(vocab)
            x[7] = 40.0  # the most likely token
            key = key_with_noise(j, 2 ** 52 - 1, 11)
            g_top = float(gumbels(streams(np.array([key], np.uint64), np.array([11])), vocab)[0, 7])
            g_max = float(gumbels(streams(np.array([key], np.uint64), np.array([11])), vocab)[0, j])
            assert g_max > 36.7
            x[j] = (x[7] / temperature + g_top - g_max + gap) * temperature
            logits = paddle.to_tensor(x[None, :].astype(dtype))
            settings = (np.array([temperature]), np.zeros(1, np.int64), np.ones(1),
                        np.array([key], np.uint64), np.array([11]))
            want = reference(logits, *settings).tolist()
            # (float32 rounds x[j] by more than the smaller gap)
            assert want == ([j] if gap > 0 else [7]) or (dtype == "float32" and abs(gap) < 1e-4)
            assert fused(logits, *settings).tolist() == want, (j, gap, dtype)


def test_min_p_is_checked():
    assert SamplingParams(min_p=0.05).min_p == 0.05
    with pytest.raises(ConfigError, match="min_p must be in"):
        SamplingParams(min_p=1.5)


def test_the_device_draw_in_paddles_operators_is_the_cpu_draw_in_numpy():
    """Off the CPU the reference draws in Paddle's operators (splitmix64 in wrapping int64 ones), on the CPU
    in numpy: the same noise to the last bit or two (the two logs' roundings), the same tokens, filtered rows
    and unfiltered ones."""
    from specgen.layers.sampling import _draw, _draw_numpy, gumbel_noise

    rng = np.random.default_rng(5)
    stream = random_keys(rng, 6)
    np.testing.assert_allclose(gumbel_noise(stream, 4000).numpy(), gumbels(stream, 4000), rtol=0, atol=4e-15)
    x = rng.standard_normal((6, 4000)) * 3
    x[0, 10] = np.nan
    inv_t = np.array([1.25, 1.0, 0.5, 2.0, 1.0, 1.0])
    unfiltered = np.array([True, True, False, False, True, False])
    probs = filtered_probs(paddle.to_tensor(x), 1.0 / inv_t, np.array([0, 0, 40, 0, 0, 0]),
                           np.array([1.0, 1.0, 1.0, 0.9, 1.0, 1.0]), np.array([0, 0, 0, 0, 0, 0.05]))
    device = _draw(paddle.to_tensor(x), inv_t, stream, unfiltered, probs)
    host = _draw_numpy(x, inv_t, stream, unfiltered, probs.numpy() > 0)
    assert device[0].tolist() == host[0].tolist() and device[1].all() and host[1].all()
