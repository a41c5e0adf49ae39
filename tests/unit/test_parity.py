"""Logits and greedy tokens equal HF transformers' on tiny random checkpoints of every architecture."""
import numpy as np
import pytest

from conftest import TINY, TINY_ARCHS
from specgen import EngineConfig, SamplingParams, generate, load_model
from specgen.engine.types import build_forward_batch


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_logits_and_greedy_match_transformers(arch):
    ref = np.load(TINY / arch / "parity.npz")
    lm = load_model(TINY / arch)
    prompts = [ref[f"prompt_{i}"].astype(np.int64) for i in range(3)]
    lens = np.array([len(p) for p in prompts])
    batch = build_forward_batch(np.arange(3), np.zeros(3, np.int64), lens, np.concatenate(prompts), np.ones(3, bool))
    logits, _ = lm.model.forward(batch, lm.model.new_cache(3, 256))
    logits = logits.numpy()
    cu = np.concatenate([[0], np.cumsum(lens)])
    for i in range(3):
        assert np.abs(logits[cu[i] : cu[i + 1]] - ref[f"logits_{i}"]).max() <= 1e-4
    outs = generate([p.tolist() for p in prompts], model=lm,
                    sampling=SamplingParams(max_tokens=12, ignore_eos=True), engine=EngineConfig(batch_size=2))
    for i, out in enumerate(outs):
        assert out.token_ids == ref[f"greedy_{i}"].tolist()
        assert out.finish_reason == "length"
