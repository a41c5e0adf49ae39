"""Batch and slot invariance: the same tokens in one batch, in batches of 7, and one at a time."""
import numpy as np
import pytest

from specgen import EngineConfig, SamplingParams, generate


def mixed_prompts(n, vocab, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, int(rng.integers(1, 60))).tolist() for _ in range(n)]


def per_request_params(n, temperature):
    return [SamplingParams(max_tokens=int(8 + i % 17), temperature=temperature,
                           top_p=0.9 if temperature else 1.0, top_k=40 if i % 3 == 0 and temperature else 0,
                           seed=100 + i, ignore_eos=i % 2 == 0)
            for i in range(n)]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_tiny_model_float64_batch_and_slot_invariance(tiny_model64, temperature):
    prompts = mixed_prompts(64, 300)
    params = per_request_params(64, temperature)
    runs = [generate(prompts, model=tiny_model64, sampling=params,
                     engine=EngineConfig(batch_size=bs, dtype="float64"))
            for bs in (64, 7, 1)]
    ref = [o.token_ids for o in runs[0]]
    assert all(len(r) >= 1 for r in ref)
    for run in runs[1:]:
        assert [o.token_ids for o in run] == ref
    # slots are refilled as requests finish: placement differs between batch sizes, outputs do not
    assert [o.finish_reason for o in runs[1]] == [o.finish_reason for o in runs[0]]


def test_sampled_outputs_depend_on_seed_not_on_batch(tiny_model):
    prompts = mixed_prompts(6, 300, seed=1)
    a = generate(prompts, model=tiny_model, sampling=SamplingParams(max_tokens=10, temperature=1.0, seed=1))
    b = generate(prompts, model=tiny_model, sampling=SamplingParams(max_tokens=10, temperature=1.0, seed=2),
                 engine=EngineConfig(batch_size=2))
    assert [o.token_ids for o in a] != [o.token_ids for o in b]


def test_context_length_stops_with_length(tiny_model):
    out = generate([[5] * 250], model=tiny_model, sampling=SamplingParams(max_tokens=50, ignore_eos=True))[0]
    assert len(out.token_ids) == 6 and out.finish_reason == "length"  # max_position_embeddings is 256


def test_rejected_prompts_become_error_outputs(tiny_model):
    outs = generate([[], [5] * 300, [5, 999], [5, 6]], model=tiny_model,
                    sampling=SamplingParams(max_tokens=3))
    assert "empty prompt" in outs[0].error
    assert "context is 256" in outs[1].error
    assert "token id 999" in outs[2].error
    assert outs[3].error is None and len(outs[3].token_ids) >= 1
