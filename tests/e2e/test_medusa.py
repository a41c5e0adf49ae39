"""Medusa heads (issue 44): the public layout loads (and a wrong one is refused), the tree template follows
Medusa's choices, and trees from random heads give plain decoding's tokens on both backends (float64, greedy
and sampled, batch 1 and 7, with the controller and without)."""
import dataclasses

import numpy as np
import pytest
from conftest import TINY
from heads import random_hydra, random_medusa

from specgen import EngineConfig, SamplingParams, SpecConfig, generate, load_model
from specgen.config import MedusaConfig
from specgen.drafters.medusa import load_medusa, save_medusa
from specgen.engine.proposers.medusa import tree_template
from specgen.errors import CheckpointError


def test_tree_template_follows_the_choices():
    head, rank, parents = tree_template(((0, 0, 1), (1,), (0, 3), (2, 0)), num_heads=2, topk=3)
    # nodes: (0,) (1,) (2,) (0,0) (2,0); (0,0,1) is too deep for 2 heads, (0,3) past topk
    assert head.tolist() == [0, 0, 0, 1, 1] and rank.tolist() == [0, 1, 2, 0, 0]
    assert parents.tolist() == [0, 0, 0, 1, 3]


def test_load_checks_the_layout(tiny_model64, tmp_path):
    cfg = tiny_model64.config
    save_medusa(tmp_path / "ok", *random_medusa(cfg, 3, 0))
    heads = load_medusa(tmp_path / "ok", cfg.hidden_size, cfg.vocab_size, "float64")
    assert heads.num_heads == 3 and heads.lm_heads[0].shape == [cfg.hidden_size, cfg.vocab_size]
    with pytest.raises(CheckpointError, match="no Medusa heads"):
        load_medusa(tmp_path, cfg.hidden_size, cfg.vocab_size, "float64")
    blocks, lms = random_medusa(cfg, 2, 0)
    save_medusa(tmp_path / "bad", blocks, [lm[:, :-1] for lm in lms])
    with pytest.raises(CheckpointError, match="should be"):
        load_medusa(tmp_path / "bad", cfg.hidden_size, cfg.vocab_size, "float64")


@pytest.mark.parametrize("backend", ["fused", "reference"])
def test_medusa_equals_plain(backend, tmp_path):
    model = load_model(TINY / "llama", dtype="float64", backend=backend)
    cfg = model.config
    # head 0 reuses the model's own LM head: its guesses are often the model's next-but-one token on this tiny
    # model's repetitive text, so some trees are accepted
    lm = model.model.weights.lm_head.dense().numpy().T
    save_medusa(tmp_path, *random_medusa(cfg, 3, 1, lm))
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 250, int(n)).tolist() for n in rng.integers(4, 40, 14)]
    for mode in ("greedy", "sampled"):
        sp = [SamplingParams(max_tokens=4 + i % 11, temperature=0.8 if mode == "sampled" else 0.0, seed=i)
              for i in range(len(prompts))]
        plain = generate(prompts, model=model, sampling=sp,
                         engine=EngineConfig(batch_size=7, dtype="float64"))
        for batch, adaptive in ((1, False), (7, False), (7, True)):
            spec = SpecConfig(method="medusa", draft_model=str(tmp_path), adaptive=adaptive,
                              medusa=MedusaConfig(topk=2, tree_choices=("0,0,0", "1", "0,1", "1,0")))
            picked = range(0, len(prompts), 3) if batch == 1 else range(len(prompts))
            out = generate([prompts[i] for i in picked], model=model, sampling=[sp[i] for i in picked],
                           ids=list(picked), engine=EngineConfig(batch_size=batch, dtype="float64"),
                           speculative=spec)
            assert [o.token_ids for o in out] == [plain[i].token_ids for i in picked], (mode, batch, adaptive)
            if not adaptive:
                assert sum(o.stats.num_draft_tokens for o in out) > 0


@pytest.mark.parametrize("method", ["medusa", "hydra"])
def test_detached_slots_stop_drafting(method, tmp_path, monkeypatch):
    """A slot the controller detached (its drafts stopped paying for the heads' time) gets no more head
    passes: with every slot detached from the start the heads draft no row (without a controller, one a step),
    and the tokens stay plain decoding's."""
    from specgen.drafters.hydra import save_hydra
    from specgen.engine.adaptive import Controller
    from specgen.engine.proposers.hydra import HydraProposer
    from specgen.engine.proposers.medusa import MedusaProposer

    model = load_model(TINY / "llama", dtype="float64")
    if method == "medusa":
        save_medusa(tmp_path, *random_medusa(model.config, 3, 5))
    else:
        save_hydra(tmp_path, *random_hydra(model.config, 3, 5))
    kind = MedusaProposer if method == "medusa" else HydraProposer
    draft, rows = kind.draft, []
    monkeypatch.setattr(kind, "draft",
                        lambda self, x0, root: rows.append(x0.shape[0]) or draft(self, x0, root))
    sp = SamplingParams(max_tokens=60, ignore_eos=True)
    prompt = [[5, 17, 33, 8, 91, 12, 40]]
    spec = SpecConfig(method=method, draft_model=str(tmp_path))
    plain = generate(prompt, model=model, sampling=sp)[0].token_ids
    always = dataclasses.replace(spec, adaptive=False)  # no controller: never detached
    assert generate(prompt, model=model, sampling=sp, speculative=always)[0].token_ids == plain
    assert sum(rows) >= 50  # a row a step
    rows.clear()
    monkeypatch.setattr(Controller, "detached", lambda self, slots: np.ones(len(slots), bool))
    out = generate(prompt, model=model, sampling=sp, speculative=spec)[0]
    assert out.token_ids == plain and sum(rows) == 0 and out.stats.num_draft_tokens == 0
