"""Log-probabilities (SamplingParams.logprobs / top_logprobs): the raw log-softmax of the row each token was
chosen from, equal to the teacher-forced model's and transformers', and unchanged by speculation (chains and
trees), batch size and backend."""
import numpy as np
import pytest
from conftest import TINY
from test_tree_exact import _run, speculated

from specgen import EngineConfig, SamplingParams, generate, load_model
from specgen.runtime.batch import build_forward_batch


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _teacher_forced(lm, ids: list[int]) -> np.ndarray:
    """log-softmax of the logits at every position of `ids`, one forward: [len(ids), vocab]."""
    n = len(ids)
    batch = build_forward_batch(np.zeros(1, np.int64), np.zeros(1, np.int64), np.array([n]),
                                np.array(ids, np.int64), np.ones(1, bool))
    return _log_softmax(lm.model.forward(batch, lm.model.new_cache(1, 256)).logits.numpy())


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(3)
    return [[3 + i] + rng.integers(3, 250, int(n)).tolist() * 2 for i, n in enumerate(rng.integers(3, 20, 9))]


def _params(n, mode, top=4):
    return [SamplingParams(max_tokens=4 + (i * 3) % 9, temperature=0.8 if mode == "sampled" else 0.0,
                           seed=i, logprobs=True, top_logprobs=top - i % 2, ignore_eos=True)
            for i in range(n)]


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_logprobs_are_the_teacher_forced_log_softmax(tiny_models, prompts, mode):
    """float64, fused and reference: each entry's logprob and top tokens equal the log-softmax of the logits
    a teacher-forced forward over prompt + output gives (1e-9), top tokens most likely first."""
    ref = tiny_models["reference64"]
    for name in ("fused64", "reference64"):
        outs = generate(prompts, model=tiny_models[name], sampling=_params(len(prompts), mode),
                        engine=EngineConfig(batch_size=4, dtype="float64", backend=name[:-2]))
        for p, o, sp in zip(prompts, outs, _params(len(prompts), mode)):
            assert len(o.logprobs) == len(o.token_ids) == sp.max_tokens
            lsm = _teacher_forced(ref, p + o.token_ids)[len(p) - 1: -1]  # the row each token came from
            for j, (e, tok) in enumerate(zip(o.logprobs, o.token_ids)):
                assert e["token_id"] == tok
                assert abs(e["logprob"] - lsm[j, tok]) < 1e-9
                order = np.lexsort((np.arange(lsm.shape[1]), -lsm[j]))[: sp.top_logprobs]
                assert [t["token_id"] for t in e["top_logprobs"]] == order.tolist()
                assert np.allclose([t["logprob"] for t in e["top_logprobs"]], lsm[j, order], atol=1e-9,
                                   rtol=0)
                assert all(isinstance(t["token"], str) for t in e["top_logprobs"])
            if mode == "greedy":  # the chosen token is the most likely one
                assert all(e["top_logprobs"][0]["token_id"] == e["token_id"] for e in o.logprobs)


@pytest.mark.parametrize("backend", ["fused", "reference"])
def test_first_logprobs_equal_transformers(backend):
    """The first output token's log-probabilities against transformers' logits recorded for the prompts
    (float32, tests/fixtures/tiny/llama/parity.npz)."""
    fixture = np.load(TINY / "llama" / "parity.npz")
    lm = load_model(TINY / "llama", backend=backend)
    prompts = [fixture[f"prompt_{i}"].tolist() for i in range(3)]
    outs = generate(prompts, model=lm, sampling=SamplingParams(max_tokens=1, logprobs=True, top_logprobs=5),
                    engine=EngineConfig(batch_size=3, backend=backend))
    for i, o in enumerate(outs):
        lsm = _log_softmax(fixture[f"logits_{i}"][-1])
        first = o.logprobs[0]
        assert first["token_id"] == int(fixture[f"greedy_{i}"][0])
        assert abs(first["logprob"] - lsm[first["token_id"]]) < 1e-4
        for t in first["top_logprobs"]:
            assert abs(t["logprob"] - lsm[t["token_id"]]) < 1e-4
        assert np.sort(lsm)[::-1][4] <= first["top_logprobs"][-1]["logprob"] + 1e-4


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_speculation_keeps_logprobs(prompts, mode, dtype):
    """n-gram chains and token trees at batch 1 and 4: the same tokens and the same log-probabilities as plain
    decoding (float64, and float32 bit for bit on the fused backend)."""
    lm = load_model(TINY / "llama", dtype=dtype)
    sp = _params(len(prompts), mode)
    plain = _run(lm, prompts, sp, EngineConfig(batch_size=4, dtype=dtype))
    for _, tree, chain in speculated(lm, prompts, sp, plain, dtype):
        for out in (tree, chain):
            assert [o.token_ids for o in out] == [o.token_ids for o in plain]
            assert [o.logprobs for o in out] == [o.logprobs for o in plain]
        assert sum(o.stats.num_accepted_tokens for o in tree) > 0


def test_logprobs_off_and_mixed(tiny_model64, prompts):
    """Requests without logprobs get None beside requests with them; top_logprobs 0 gives empty lists; the
    tokens are the same as a run without any."""
    sp = [SamplingParams(max_tokens=5, logprobs=i % 3 > 0, top_logprobs=2 if i % 3 == 2 else 0)
          for i in range(len(prompts))]
    engine = EngineConfig(batch_size=4, dtype="float64")
    outs = generate(prompts, model=tiny_model64, sampling=sp, engine=engine)
    none = generate(prompts, model=tiny_model64, sampling=SamplingParams(max_tokens=5), engine=engine)
    assert [o.token_ids for o in outs] == [o.token_ids for o in none]
    for i, o in enumerate(outs):
        if i % 3 == 0:
            assert o.logprobs is None
        else:
            assert len(o.logprobs) == len(o.token_ids)
            assert all(len(e["top_logprobs"]) == (2 if i % 3 == 2 else 0) for e in o.logprobs)


def _sampled_from(logits: np.ndarray, t: float, k: int, p: float, min_p: float) -> np.ndarray:
    """The log-probabilities of the distribution a row is sampled from (layers/sampling.py's rule, written
    again here from its description): logits / t; the k largest kept (ties at the k-th kept); softmax; the
    most likely tokens kept until their mass reaches p (ties at the threshold kept); then those at least min_p
    as likely as the most likely one; renormalized. Filtered tokens at -inf."""
    z = logits.astype(np.float64) / t
    if k:
        z = np.where(z >= np.sort(z)[-k], z, -np.inf)
    q = np.exp(z - z.max())
    q /= q.sum()
    order = np.sort(q)[::-1]
    mass_before = np.cumsum(order) - order
    threshold = order[max(1, int((mass_before < p).sum())) - 1]
    q = np.where(q >= threshold, q, 0.0)
    q = np.where(q >= q.max() * min_p, q, 0.0)
    with np.errstate(divide="ignore"):
        return np.log(q / q.sum())


@pytest.mark.parametrize("backend", ["fused", "reference"])
def test_processed_logprobs_are_of_the_sampled_distribution(tiny_models, prompts, backend):
    """--logprobs-mode processed, sampled with temperature, top-k, top-p and min-p: each token's logprob and
    the top tokens are those of the filtered distribution it was drawn from (1e-9); tokens the filters left
    out are not listed; the tokens are raw mode's."""
    ref = tiny_models["reference64"]
    lm = tiny_models[f"{backend}64"]
    filters = dict(temperature=0.8, top_k=30, top_p=0.9, min_p=0.02)
    sp = [SamplingParams(max_tokens=6, seed=i, logprobs=True, top_logprobs=20, logprobs_mode="processed",
                         **filters) for i in range(len(prompts))]
    engine = EngineConfig(batch_size=4, dtype="float64", backend=backend)
    outs = generate(prompts, model=lm, sampling=sp, engine=engine)
    raw = generate(prompts, model=lm, sampling=[SamplingParams(**{**s.__dict__, "logprobs_mode": "raw"})
                                                for s in sp], engine=engine)
    assert [o.token_ids for o in outs] == [o.token_ids for o in raw]
    short = 0
    for p, o in zip(prompts, outs):
        ids = p + o.token_ids
        n = len(ids)
        batch = build_forward_batch(np.zeros(1, np.int64), np.zeros(1, np.int64), np.array([n]),
                                    np.array(ids, np.int64), np.ones(1, bool))
        logits = ref.model.forward(batch, ref.model.new_cache(1, 256)).logits.numpy()[len(p) - 1: -1]
        for j, (e, tok) in enumerate(zip(o.logprobs, o.token_ids)):
            want = _sampled_from(logits[j], filters["temperature"], filters["top_k"], filters["top_p"],
                                 filters["min_p"])
            assert np.isfinite(e["logprob"]) and abs(e["logprob"] - want[tok]) < 1e-9
            kept = np.lexsort((np.arange(len(want)), -want))[: np.isfinite(want).sum()][:20]
            assert [t["token_id"] for t in e["top_logprobs"]] == kept.tolist()
            assert np.allclose([t["logprob"] for t in e["top_logprobs"]], want[kept], atol=1e-9, rtol=0)
            short += len(e["top_logprobs"]) < 20
    assert short > 0  # the filters left fewer than 20 tokens somewhere


def test_processed_logprobs_under_speculation_and_penalties(prompts):
    """Processed log-probabilities (greedy with a repetition penalty: the penalized row's log-softmax; sampled
    with filters) are plain decoding's with n-gram chains and token trees, batch 1 and 4, float64."""
    lm = load_model(TINY / "llama", dtype="float64")
    for mode in ("greedy", "sampled"):
        sp = [SamplingParams(max_tokens=4 + (i * 3) % 9, seed=i, logprobs=True, top_logprobs=3,
                             logprobs_mode="processed", ignore_eos=True, repetition_penalty=1.3,
                             **(dict(temperature=0.8, top_p=0.9) if mode == "sampled" else {}))
              for i in range(len(prompts))]
        plain = _run(lm, prompts, sp, EngineConfig(batch_size=4, dtype="float64"))
        if mode == "greedy":  # the chosen token is the most likely one of the penalized row
            assert all(e["top_logprobs"][0]["token_id"] == e["token_id"] for o in plain for e in o.logprobs)
        for batch, tree, chain in speculated(lm, prompts, sp, plain):
            for out in (tree, chain):
                assert [o.token_ids for o in out] == [o.token_ids for o in plain], (mode, batch)
                assert [o.logprobs for o in out] == [o.logprobs for o in plain], (mode, batch)
