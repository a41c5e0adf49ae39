"""The float16 KV cache (EngineConfig.kv_cache_dtype): the attention kernel rounds keys and values to halves
as numpy does, reads them back exactly, and the engine stays exact across speculation, batching and prefix
sharing."""
import numpy as np
import paddle
import pytest
from conftest import TINY

from specgen import EngineConfig, MtpConfig, SamplingParams, SpecConfig, generate, load_model
from specgen.api import make_engine
from specgen.engine.types import Request
from specgen.errors import ConfigError
from specgen.kernels import ops

K = ops()
needs_kernels = pytest.mark.skipif(K is None,
                                   reason="fused CPU kernels not built (no C++ compiler or not on CPU)")


def _attention(qkv, cos, sin, pos, slots, kc, vc, H, KV, cap):
    out = K.specgen_attention(paddle.to_tensor(qkv), paddle.to_tensor(cos), paddle.to_tensor(sin),
                              paddle.to_tensor(pos), paddle.to_tensor(slots), kc, vc,
                              paddle.ones([kc.shape[1]]), paddle.ones([kc.shape[1]]),
                              paddle.zeros([len(pos)], dtype="int64"), paddle.ones([1]), paddle.ones([1]),
                              H, KV, cap, False, 1e-6, 0)
    return (out[0] if isinstance(out, (list, tuple)) else out).numpy()


@needs_kernels
@pytest.mark.parametrize("D,H,KV", [(64, 9, 3), (24, 4, 2), (128, 4, 2)])
def test_half_cache_attention_matches_numpy_over_the_rounded_keys(D, H, KV):
    """A prompt block, a verify block and a decode token over half caches holding stale history: K rows are
    the roped keys rounded to halves, V rows numpy's float16 of the values bit for bit, and the output is
    float64 attention over what the cache holds."""
    rng = np.random.default_rng(D)
    cap, num_slots = 64, 3
    slots = np.array([2] * 13 + [0] * 6 + [1], np.int64)
    pos = np.concatenate([np.arange(13), np.arange(30, 36), [40]]).astype(np.int64)
    n = len(pos)
    qkv = rng.standard_normal((n, (H + 2 * KV) * D)).astype(np.float32)
    ang = np.arange(cap)[:, None] * (1e4 ** (-np.arange(0, D, 2) / D))[None, :]
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    kc = paddle.to_tensor(rng.standard_normal((num_slots * KV * cap, D)).astype(np.float16))
    vc = paddle.to_tensor(rng.standard_normal((num_slots * KV * cap, D)).astype(np.float16))
    got = _attention(qkv, cos, sin, pos, slots, kc, vc, H, KV, cap)
    kh, vh = kc.numpy(), vc.numpy()  # float16, written in place
    x = qkv.reshape(n, H + 2 * KV, D).astype(np.float64)
    half = D // 2
    c, s = cos[pos][:, None, :].astype(np.float64), sin[pos][:, None, :].astype(np.float64)
    rot = np.concatenate([x[..., :half] * c - x[..., half:] * s, x[..., half:] * c + x[..., :half] * s],
                         axis=-1)
    out = np.zeros((n, H, D))
    for t in range(n):
        for h in range(KV):
            row = (slots[t] * KV + h) * cap + pos[t]
            assert np.array_equal(vh[row].view(np.uint16), qkv.reshape(n, H + 2 * KV, D)[t, H + KV + h]
                                  .astype(np.float16).view(np.uint16))
            # within half a unit in the last place of a half (plus float32 RoPE rounding)
            assert np.all(np.abs(kh[row] - rot[t, H + h]) <= np.abs(rot[t, H + h]) * 2.0 ** -11 + 1e-6)
        for h in range(H):
            base = (slots[t] * KV + h // (H // KV)) * cap
            keys = kh[base: base + pos[t] + 1].astype(np.float64)
            sc = keys @ (rot[t, h] / np.sqrt(D))
            p = np.exp(sc - sc.max())
            out[t, h] = (p / p.sum()) @ vh[base: base + pos[t] + 1].astype(np.float64)
    assert np.abs(got - out.reshape(n, H * D)).max() <= 2e-5


@needs_kernels
def test_half_cache_rounds_like_numpy_at_the_edges():
    """Ties to even, subnormal halves, underflow to zero, the largest half, overflow to inf,
    signed zero, NaN."""
    H, KV, D, cap = 2, 1, 32, 4
    edge = np.array([0.0, -0.0, 1e-8, 2.0 ** -25, 3 * 2.0 ** -25, 2.0 ** -24, 6e-5, 2.0 ** -14,
                     1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, 2049.0, 2051.0, 65504.0, 65519.99, 65520.0, 1e9,
                     -1e9, np.inf, -np.inf, np.nan, -3.14159, 1e-5, -6.1e-5, 0.1, 1 / 3, 7.0e4, 5.96e-8,
                     2.98e-8, 2.99e-8, 1e4, -2.5e-7, 12345.678], np.float32)
    rng = np.random.default_rng(0)
    values = np.concatenate([edge,
                             (rng.standard_normal(96) * 10.0 ** rng.integers(-9, 6, 96)).astype(np.float32)])
    got = []
    for chunk in values.reshape(-1, D):
        qkv = np.zeros((1, (H + 2 * KV) * D), np.float32)
        qkv[0, (H + KV) * D:] = chunk
        kc = paddle.zeros([KV * cap, D], dtype="float16")
        vc = paddle.zeros([KV * cap, D], dtype="float16")
        ang = np.zeros((cap, D // 2), np.float32)
        _attention(qkv, np.cos(ang), np.sin(ang), np.array([0]), np.array([0]), kc, vc, H, KV, cap)
        got.append(vc.numpy()[0])
    got = np.concatenate(got)
    with np.errstate(over="ignore"):
        want = values.astype(np.float16)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint16), want[~nan].view(np.uint16))


@needs_kernels
def test_engine_with_half_cache_is_exact_across_speculation_batching_and_prefix_sharing():
    """Tiny float32 model, half cache: ngram and plain decoding agree token for token at batch 1 and 4, greedy
    and sampled, and a shared prefix (cascade attention over a half prefix cache) changes nothing."""
    lm = load_model(TINY / "llama", dtype="float32")
    rng = np.random.default_rng(3)
    shared = rng.integers(3, 250, 24).tolist()
    # repetitive: n-gram drafts hit
    prompts = [shared + rng.integers(3, 60, 5 + 3 * i).tolist() for i in range(6)]
    params = [SamplingParams(max_tokens=20 + i, temperature=0.8 if i % 2 else 0.0, seed=i) for i in range(6)]

    def run(bs, method="none", prefix="off"):
        engine = EngineConfig(batch_size=bs, kv_cache_dtype="float16", shared_prefix=prefix,
                              min_shared_prefix=16)
        eng = make_engine(lm, engine, SpecConfig(method=method, num_speculative_tokens=3, adaptive=False))
        outs = sorted(eng.run([Request(id=str(i), index=i, prompt_ids=tuple(p), params=params[i])
                               for i, p in enumerate(prompts)]), key=lambda o: o.index)
        assert eng.cache.k[0].dtype == paddle.float16
        assert (eng.cache.prefix is not None) == (prefix == "auto")
        return [o.token_ids for o in outs], sum(o.stats.num_draft_tokens for o in outs)

    want, _ = run(4)
    assert run(1)[0] == want
    got, drafted = run(4, "ngram")
    assert got == want and drafted > 0
    assert run(6, "ngram", "auto")[0] == want
    assert run(6, "none", "auto")[0] == want


def test_half_cache_config_is_checked():
    with pytest.raises(ConfigError, match="kv_cache_dtype must be"):
        EngineConfig(kv_cache_dtype="bfloat16")
    with pytest.raises(ConfigError, match="needs dtype float32"):
        EngineConfig(dtype="float64", kv_cache_dtype="float16")
    lm = load_model(TINY / "llama", dtype="float32", backend="reference")  # keeps the model's dtype
    with pytest.raises(ConfigError, match="needs a float32 model on the fused backend"):
        generate([[5, 6, 7]], model=lm, engine=EngineConfig(kv_cache_dtype="float16"))


@needs_kernels
def test_half_cache_halves_the_memory_report():
    lm = load_model(TINY / "llama", dtype="float32")
    sizes = {}
    for kv in ("auto", "float16"):
        eng = make_engine(lm, EngineConfig(batch_size=2, kv_cache_dtype=kv), SpecConfig())
        list(eng.run([]))
        sizes[kv] = eng.cache.nbytes()
        assert eng.cache.k[0].dtype == (paddle.float16 if kv == "float16" else paddle.float32)
    assert sizes["float16"] * 2 == sizes["auto"]


@needs_kernels
def test_uninitialized_cache_rows_are_never_read(tiny_model, tmp_path, monkeypatch):
    """On the fused kernels the KV caches (the model's and the MTP head's) start, and grow, uninitialized
    (KVCache(zeroed=False): no memset of the allocation). Filled with NaN instead, every output is still the
    one a zero-filled cache gives: prefill, ngram and MTP verify blocks, batching, growth mid-decode."""
    from specgen.drafters.mtp import random_mtp_weights, save_mtp
    from specgen.runtime import kv_cache

    save_mtp(tmp_path / "head", random_mtp_weights(tiny_model.config, std=0.3))
    rng = np.random.default_rng(3)
    motif = rng.integers(3, 250, 12).tolist()
    prompts = [motif * 8 + [7], rng.integers(3, 250, 9).tolist(), motif * 3]
    # the 97-token prompt grows the cache to 128 positions, then to 256 while it decodes: the grown storage
    # holds the old rows copied, and NaN past them
    monkeypatch.setattr(kv_cache, "INITIAL_CAPACITY", 64)
    sp = SamplingParams(max_tokens=40, ignore_eos=True)
    methods = [SpecConfig(), SpecConfig(method="ngram", num_speculative_tokens=3, adaptive=False),
               SpecConfig(method="mtp", num_speculative_tokens=2, adaptive=False,
                          mtp=MtpConfig(model=str(tmp_path / "head")))]

    def run():
        return [[o.token_ids for o in generate(prompts, model=tiny_model, sampling=sp,
                                               engine=EngineConfig(batch_size=bs), speculative=spec)]
                for spec in methods for bs in (1, 3)]

    clean = run()
    poisoned = []

    def nan_empty(shape, dtype=None):
        poisoned.append(shape)
        return paddle.full(shape, float("nan"), dtype=dtype)

    monkeypatch.setattr(kv_cache.paddle, "empty", nan_empty)
    assert run() == clean  # each request's whole room taken at admission (KVCache.admit)
    assert len(poisoned) > 2 * tiny_model.config.num_layers * 6  # every engine's caches, the grown ones too
    monkeypatch.setattr(kv_cache, "_physical_memory", lambda: 0)  # admission takes the prompt's room only,
    assert run() == clean  # so the main cache also grows while the first prompt decodes
    assert clean[0::2] == clean[1::2]  # batch 1 = batch 3, for each method
    assert clean[0] == clean[2] == clean[4]  # speculation changes nothing


@needs_kernels
def test_a_job_whose_requests_fit_never_copies_the_cache(tiny_model, monkeypatch):
    """Every request's room is taken when it is placed (KVCache.admit), so a batch decoding past the initial
    capacity grows without copying written positions; with admission limited to the prompt (no memory for
    more) the same job copies them mid-decode, and generates the same tokens."""
    from specgen.runtime import kv_cache

    copies = []
    copy_into = kv_cache._copy_into
    monkeypatch.setattr(kv_cache, "_copy_into", lambda *a: (copies.append(a[2]), copy_into(*a)))
    monkeypatch.setattr(kv_cache, "INITIAL_CAPACITY", 64)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 250, n).tolist() for n in (40, 9, 25)]
    sp = SamplingParams(max_tokens=60, ignore_eos=True)  # 40 + 60 positions: past 64

    def run():
        copies.clear()
        return [o.token_ids for o in generate(prompts, model=tiny_model, sampling=sp,
                                              engine=EngineConfig(batch_size=3))]

    ahead = run()
    assert copies == []
    monkeypatch.setattr(kv_cache, "_physical_memory", lambda: 0)
    assert run() == ahead
    assert copies and max(copies) >= 64  # grown mid-decode, with every written position copied
