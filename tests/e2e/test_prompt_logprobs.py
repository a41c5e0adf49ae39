"""prompt_logprobs (vLLM's): each prompt token's raw log-softmax given the tokens before it, equal to a
teacher-forced forward's, whatever the batch, chunking, shared prefix, samples, method or backend; outputs
unchanged by asking."""
import dataclasses

import numpy as np
import pytest
from test_logprobs import _teacher_forced

from specgen import EngineConfig, SamplingParams, SpecConfig, generate
from specgen.errors import ConfigError


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(5)
    return [[3 + i] + rng.integers(3, 250, int(n)).tolist() for i, n in enumerate(rng.integers(1, 30, 7))]


def _check(ref, prompt, entries, top):
    """`entries` are the prompt's: None first, then each token's log-probability, its rank and the `top` most
    likely at its position, as the teacher-forced log-softmax gives them (1e-9)."""
    assert len(entries) == len(prompt) and entries[0] is None
    lsm = _teacher_forced(ref, prompt)[:-1]  # row j predicts prompt token j + 1
    for j, e in enumerate(entries[1:]):
        assert e["token_id"] == prompt[j + 1]
        assert abs(e["logprob"] - lsm[j, prompt[j + 1]]) < 1e-9
        assert e["rank"] == 1 + int((lsm[j] > lsm[j, prompt[j + 1]]).sum())  # (vLLM's rank)
        order = np.lexsort((np.arange(lsm.shape[1]), -lsm[j]))[:top]
        assert [t["token_id"] for t in e["top_logprobs"]] == order.tolist()
        assert np.allclose([t["logprob"] for t in e["top_logprobs"]], lsm[j, order], atol=1e-9, rtol=0)


@pytest.mark.parametrize("chunk", [0, 4])
def test_prompt_logprobs_are_the_teacher_forced_log_softmax(tiny_models, prompts, chunk):
    """float64, fused and reference backends, whole prompts and chunks of 4, batch 3: every prompt token's
    entry; requests without the field get None; the outputs are those of a run that asks nothing."""
    ref = tiny_models["reference64"]
    sp = [SamplingParams(max_tokens=3, prompt_logprobs=(None, 0, 2, 5)[i % 4], logprobs=i % 2 == 0)
          for i in range(len(prompts))]
    for name in ("fused64", "reference64"):
        engine = EngineConfig(batch_size=3, dtype="float64", backend=name[:-2], prefill_chunk=chunk,
                              max_prefill_tokens=8 if chunk else 4096)
        outs = generate(prompts, model=tiny_models[name], sampling=sp, engine=engine)
        plain = generate(prompts, model=tiny_models[name], sampling=SamplingParams(max_tokens=3),
                         engine=engine)
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
        for p, o, s in zip(prompts, outs, sp):
            if s.prompt_logprobs is None:
                assert o.prompt_logprobs is None
            else:
                _check(ref, p, o.prompt_logprobs, s.prompt_logprobs)
            assert (o.logprobs is None) == (not s.logprobs)


def test_prompt_logprobs_with_shared_prefix_samples_and_speculation(tiny_model64, tiny_ref64):
    """Prompts sharing a prefix (shared_prefix auto), those that ask too: their entries of the prefix's
    positions come from its hidden states (scored once), the first past it from its last row, one prompt that
    is the prefix itself; n = 3 samples (later samples copy sample 0's rows and its prompt entries); n-gram
    speculation: the same entries and tokens as plain decoding at batch 1."""
    rng = np.random.default_rng(9)
    prefix = rng.integers(3, 250, 70).tolist()
    prompts = [prefix + rng.integers(3, 250, 5 + i).tolist() for i in range(4)] + [prefix]
    sp = [SamplingParams(max_tokens=6, temperature=0.8, seed=1, n=3 if i == 1 else 1,
                         prompt_logprobs=3 if i % 2 or i == 4 else None) for i in range(5)]
    base = generate(prompts, model=tiny_model64, sampling=[dataclasses.replace(s, prompt_logprobs=None)
                                                          for s in sp],
                    engine=EngineConfig(batch_size=1, dtype="float64"))
    for engine, spec in ((EngineConfig(batch_size=6, dtype="float64"), None),
                         (EngineConfig(batch_size=4, dtype="float64"),
                          SpecConfig(method="ngram", num_speculative_tokens=3, adaptive=False))):
        outs = generate(prompts, model=tiny_model64, sampling=sp, engine=engine, speculative=spec)
        assert [(o.id, o.sample_index, o.token_ids) for o in outs] == \
            [(o.id, o.sample_index, o.token_ids) for o in base]
        by_prompt = {}
        for o in outs:
            i = int(o.index)
            assert (o.prompt_logprobs is None) == (sp[i].prompt_logprobs is None)
            if o.prompt_logprobs is not None:
                _check(tiny_ref64, prompts[i], o.prompt_logprobs, 3)
                by_prompt.setdefault(i, []).append(o)
            if spec is None and not o.sample_index:  # read from the prefix (all but one token of its own)
                assert o.stats.num_cached_prompt_tokens == min(70, len(prompts[i]) - 1), i
        assert len(by_prompt[1]) == 3 and {o.sample_index for o in by_prompt[1]} == {0, 1, 2}
        if spec is None:  # samples 1 and 2 copied the prompt's rows (and its entries)
            cached = sorted(o.stats.num_cached_prompt_tokens for o in by_prompt[1])
            assert cached == [70] + [len(prompts[1]) - 1] * 2


def test_prompt_logprobs_range():
    assert SamplingParams(prompt_logprobs=0).prompt_logprobs == 0
    for bad in (-1, 21):
        with pytest.raises(ConfigError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)


def test_prompt_logprobs_beside_an_eagle3_layer_and_a_shared_prefix(tiny_model64, tiny_ref64, tmp_path):
    """With EAGLE-3 the shared prefix keeps the layer's features, not the final hidden states: a prompt that
    asks prefills its whole prompt, and its entries are still the teacher-forced ones."""
    from conftest import TINY
    from heads import random_eagle3

    from specgen.config import EagleConfig
    from specgen.drafters.eagle3 import save_eagle3
    from specgen.models import load_checkpoint

    ckpt = load_checkpoint(TINY / "llama")
    lm = np.asarray(ckpt.weights["lm_head.weight"], np.float32)
    save_eagle3(tmp_path, random_eagle3(ckpt.config, 0, lm, np.arange(0, ckpt.config.vocab_size, 2)),
                ckpt.config, (0, 1, 2))
    rng = np.random.default_rng(4)
    prefix = rng.integers(3, 250, 70).tolist()
    prompts = [prefix + rng.integers(3, 250, 4 + i).tolist() for i in range(3)]
    sp = [SamplingParams(max_tokens=5, prompt_logprobs=2 if i == 1 else None) for i in range(3)]
    spec = SpecConfig(method="eagle3", draft_model=str(tmp_path), adaptive=False, num_speculative_tokens=3,
                      eagle=EagleConfig(topk=2, nodes=6, copy=0))
    outs = generate(prompts, model=tiny_model64, sampling=sp, speculative=spec,
                    engine=EngineConfig(batch_size=3, dtype="float64"))
    _check(tiny_ref64, prompts[1], outs[1].prompt_logprobs, 2)
    assert [o.stats.num_cached_prompt_tokens for o in outs] == [70, 0, 70]


def test_prompt_logprobs_past_a_one_token_prefix(tiny_model64, tiny_ref64):
    """A shared prefix of one token (min_shared_prefix 1): nothing of the prefix's own to score, the first
    entry from its only row."""
    prompts = [[7, 20, 31, 44], [7, 52, 60], [7, 99]]
    outs = generate(prompts, model=tiny_model64, sampling=SamplingParams(max_tokens=3, prompt_logprobs=1),
                    engine=EngineConfig(batch_size=3, dtype="float64", min_shared_prefix=1))
    for p, o in zip(prompts, outs):
        _check(tiny_ref64, p, o.prompt_logprobs, 1)
    assert [o.stats.num_cached_prompt_tokens for o in outs] == [1, 1, 1]
