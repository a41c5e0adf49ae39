"""SmolLM2-135M-Instruct (the default model): equal to transformers, and invariant to batching."""
import json

import numpy as np
import pytest
from conftest import FIXTURES

from specgen import EngineConfig, SamplingParams, generate
from specgen.runtime.batch import build_forward_batch

pytestmark = pytest.mark.realmodel

REF = json.loads((FIXTURES / "smollm2_greedy.json").read_text())


def test_greedy_equals_transformers_and_knows_paris(real_model):
    items = REF["prompts"]
    assert ([list(real_model.tokenizer.encode_chat(it["messages"])) for it in items]
            == [it["prompt_ids"] for it in items])
    outs = generate([it["messages"] for it in items], model=real_model,
                    sampling=SamplingParams(max_tokens=32), engine=EngineConfig(batch_size=5))
    for it, out in zip(items, outs):
        assert out.token_ids == it["output_ids"]
    paris = [o for it, o in zip(items, outs) if "capital of France" in it["messages"][-1]["content"]][0]
    assert "Paris" in paris.text


def test_tokenizer_matches_transformers(real_model):
    for case in REF["tokenizer_cases"]:
        assert real_model.tokenizer.encode(case["text"], add_special_tokens=False) == case["ids"]


def chat_prompts(real_model, spec_bench, n):
    return [list(real_model.tokenizer.encode_chat([{"role": "user", "content": q["turns"][0][:600]}]))
            for q in spec_bench[::480 // n][:n]]


def test_float64_batch_invariance(real_model64, spec_bench):
    prompts = chat_prompts(real_model64, spec_bench, 8)
    params = [SamplingParams(max_tokens=12 + i, temperature=0.8 if i % 2 else 0.0, top_p=0.9, seed=i)
              for i in range(8)]
    runs = [generate(prompts, model=real_model64, sampling=params,
                     engine=EngineConfig(batch_size=bs, dtype="float64"))
            for bs in (8, 3, 1)]
    for run in runs[1:]:
        assert [o.token_ids for o in run] == [o.token_ids for o in runs[0]]


def top2_gap(model, ids):
    """Probability gap between the two most likely next tokens after `ids`, from a one-sequence forward."""
    batch = build_forward_batch(np.array([0]), np.array([0]), np.array([len(ids)]), np.array(ids),
                                np.array([False]))
    logits = model.model.forward(batch, model.model.new_cache(1, 2048)).logits.numpy()[0].astype(np.float64)
    p = np.exp(logits - logits.max())
    p /= p.sum()
    top = np.sort(p)[-2:]
    return top[1] - top[0]


def test_float32_divergences_sit_at_near_ties(real_model, spec_bench):
    prompts = chat_prompts(real_model, spec_bench, 16)
    sp = SamplingParams(max_tokens=24)
    batched = generate(prompts, model=real_model, sampling=sp, engine=EngineConfig(batch_size=16))
    single = generate(prompts, model=real_model, sampling=sp, engine=EngineConfig(batch_size=1))
    for p, a, b in zip(prompts, batched, single):
        if a.token_ids != b.token_ids:
            j = next(i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y)
            assert top2_gap(real_model, p + b.token_ids[:j]) < 1e-4


def test_float32_packed_weights_are_exact_across_batching_and_speculation(real_model, spec_bench):
    """With packed float32 weights every row of every op is computed on its own in a fixed order, so float32
    outputs do not change with batch size or with speculation: not even at near-ties."""
    if real_model.model.backend.name != "fused":
        pytest.skip("packed linear needs the fused kernels and AVX2 (with FMA and F16C) or AVX-512")
    from specgen import SpecConfig

    prompts = chat_prompts(real_model, spec_bench, 16)
    params = [SamplingParams(max_tokens=24 + i, temperature=0.8 if i % 2 else 0.0, top_p=0.9, seed=i)
              for i in range(16)]
    plain = generate(prompts, model=real_model, sampling=params, engine=EngineConfig(batch_size=16))
    for bs, spec in [(1, SpecConfig(method="none")),
                     (5, SpecConfig(method="ngram", num_speculative_tokens=5)),
                     (16, SpecConfig(method="ngram", num_speculative_tokens=3)),
                     (7, SpecConfig(method="mtp", num_speculative_tokens=2))]:  # the shipped head
        run = generate(prompts, model=real_model, sampling=params, engine=EngineConfig(batch_size=bs),
                       speculative=spec)
        assert [o.token_ids for o in run] == [o.token_ids for o in plain], (bs, spec.method)


def _screen_on_and_off(real_model, prompts, jobs) -> dict[bool, list]:
    """{screen on: each job's tokens} for jobs [(sampling, batch size, SpecConfig)], run with the fused
    backend's LM-head screen and without it (every step then computes the logits)."""
    m = real_model.model.backend
    if getattr(m, "screen", None) is None:
        pytest.skip("the screen needs the fused kernels, a Q8_0 / Q4_0 / Q6_K LM head and VNNI")
    runs = {}
    screen = m.screen
    try:
        for on in (True, False):
            m.screen = screen if on else None
            runs[on] = [[o.token_ids for o in generate(prompts, model=real_model, sampling=sp,
                                                       engine=EngineConfig(batch_size=bs), speculative=spec)]
                        for sp, bs, spec in jobs]
    finally:
        m.screen = screen
    return runs


def test_greedy_steps_without_logits_give_the_same_tokens(real_model, spec_bench):
    """Greedy steps skip the LM head's logits (the fused backend's screen: integer products screen the
    columns, float32 decides among the few left): the tokens of whole greedy jobs, plain and speculative, are
    those of the logits' argmax."""
    from specgen import SpecConfig

    sp = SamplingParams(max_tokens=40)
    runs = _screen_on_and_off(real_model, chat_prompts(real_model, spec_bench, 16),
                              [(sp, 16, SpecConfig(method="none")),
                               (sp, 5, SpecConfig(method="ngram", num_speculative_tokens=5))])
    assert runs[True] == runs[False]
    assert runs[True][0] == runs[True][1]


def test_sampled_steps_without_logits_give_the_same_tokens(real_model, spec_bench):
    """Sampled rows with no filter are drawn in the forward from the screen's bounds (only the logits whose
    key could win are computed): whole sampled jobs, plain and speculative, at several temperatures, give the
    tokens the sampler gives over every logit (the screen off), and a job whose requests ask for top-p (every
    step then computes logits) the same tokens either way."""
    from specgen import SpecConfig

    params = [SamplingParams(max_tokens=32, temperature=(0.3, 0.8, 1.5)[i % 3], seed=i) for i in range(12)]
    top_p = [SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=i) for i in range(12)]
    runs = _screen_on_and_off(real_model, chat_prompts(real_model, spec_bench, 12),
                              [(params, 12, SpecConfig(method="none")),
                               (params, 5, SpecConfig("ngram", num_speculative_tokens=4)),
                               (top_p, 4, SpecConfig(method="none"))])
    assert runs[True] == runs[False]
    assert runs[True][0] == runs[True][1]


def test_float16_kv_cache_is_exact_across_batching_and_speculation(real_model, spec_bench):
    """A half KV cache rounds keys and values once, where they are written; every later read widens them
    exactly, so with packed weights (each row computed on its own) outputs still do not change with batch size
    or with speculation, greedy or sampled. On MKL's products (no AVX2) keys and values differ by ~1e-7
    between shapes before they are rounded, and a rounding to half can turn that into a half's step, so there
    the float16 cache keeps only the float32 guarantee of divergences at near-ties (tested above without
    it)."""
    if real_model.model.backend.name != "fused":
        pytest.skip("batch-exact float16 KV caches need packed weights (the fused kernels and AVX2 or "
                    "AVX-512)")
    from specgen import SpecConfig

    prompts = chat_prompts(real_model, spec_bench, 12)
    params = [SamplingParams(max_tokens=24 + i, temperature=0.8 if i % 2 else 0.0, top_p=0.9, seed=i)
              for i in range(12)]
    plain = generate(prompts, model=real_model, sampling=params,
                     engine=EngineConfig(batch_size=12, kv_cache_dtype="float16"))
    for bs, spec in [(1, SpecConfig(method="none")),
                     (5, SpecConfig(method="ngram", num_speculative_tokens=5)),
                     (7, SpecConfig(method="mtp", num_speculative_tokens=2))]:  # the shipped head
        run = generate(prompts, model=real_model, sampling=params,
                       engine=EngineConfig(batch_size=bs, kv_cache_dtype="float16"), speculative=spec)
        assert [o.token_ids for o in run] == [o.token_ids for o in plain], (bs, spec.method)


@pytest.fixture(scope="module")
def real_model_int8():
    from specgen import load_model
    from specgen.kernels import has_vnni, ops

    if ops() is None or not has_vnni():
        pytest.skip("integer products need the fused kernels and AVX-512 VNNI")
    return load_model(None, matmul="int8")


def test_int8_matmul_is_exact_across_batching_and_speculation(real_model_int8, spec_bench):
    """--matmul int8 quantizes each row's inputs on their own and sums integer products exactly, so its
    outputs do not change with batch size or with speculation either, greedy or sampled."""
    from specgen import SpecConfig

    prompts = chat_prompts(real_model_int8, spec_bench, 12)
    params = [SamplingParams(max_tokens=24 + i, temperature=0.8 if i % 2 else 0.0, top_p=0.9, seed=i)
              for i in range(12)]
    engine = {"matmul": "int8"}
    plain = generate(prompts, model=real_model_int8, sampling=params,
                     engine=EngineConfig(batch_size=12, **engine))
    for bs, spec in [(1, SpecConfig(method="none")),
                     (5, SpecConfig(method="ngram", num_speculative_tokens=5)),
                     (7, SpecConfig(method="mtp", num_speculative_tokens=2))]:  # the shipped head
        run = generate(prompts, model=real_model_int8, sampling=params,
                       engine=EngineConfig(batch_size=bs, **engine), speculative=spec)
        assert [o.token_ids for o in run] == [o.token_ids for o in plain], (bs, spec.method)


def test_int8_matmul_stays_close_to_float32(real_model, real_model_int8):
    """The integer products round each input to 8 bits per block of 32 (the weights were already rounded to
    4): teacher-forced on float32's greedy outputs, the int8 model picks the same next token almost
    everywhere.
    (Where float32 itself is nearly tied it need not: "The" 25.33 against "L" 25.24 opens the answer to the
    capital of France, and int8 starts with "L".)"""
    items = REF["prompts"]
    f32 = generate([it["messages"] for it in items], model=real_model, sampling=SamplingParams(max_tokens=32),
                   engine=EngineConfig(batch_size=5))
    m = real_model_int8.model
    same = total = 0
    for it, out in zip(items, f32):
        ids = np.array(it["prompt_ids"] + out.token_ids, np.int64)
        batch = build_forward_batch(np.array([0]), np.array([0]), np.array([len(ids)]), ids, np.array([True]))
        picks = m.forward(batch, m.new_cache(1, len(ids) + 1)).greedy[len(it["prompt_ids"]) - 1:-1]
        same += int((picks == np.array(out.token_ids)).sum())
        total += len(out.token_ids)
    assert 0.9 <= same / total < 1.0, same / total
