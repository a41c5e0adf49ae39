"""Hydra heads (issue 44) and trained Medusa / Hydra heads: the public Hydra layout loads (a wrong one is
refused), the tree is built head by head as a per-node reference computes it, and random and trained heads
give plain decoding's tokens (float64, greedy and sampled, batch 1 / 7 / 32, chunked prefill and a shared
prefix on and off, both backends)."""
import json

import numpy as np
import paddle
import pytest
from conftest import TINY
from heads import random_hydra
from typer.testing import CliRunner

from specgen import EngineConfig, SamplingParams, SpecConfig, generate, load_model
from specgen.config import MedusaConfig
from specgen.drafters.hydra import load_hydra, save_hydra
from specgen.engine.proposers.hydra import HydraProposer
from specgen.engine.proposers.medusa import tree_template
from specgen.errors import CheckpointError


def write_prompts(path, n):
    rng = np.random.default_rng(0)
    path.write_text("".join(json.dumps({"id": f"p{i}",
                                        "input_ids": [int(x) for x in rng.integers(3, 290, 3 + i % 9)]})
                            + "\n" for i in range(n)))
    return path


CHOICES = ("0,0,0", "1", "0,1", "1,0", "2", "0,0,1")


def test_load_checks_the_layout(tiny_model64, tmp_path):
    cfg = tiny_model64.config
    save_hydra(tmp_path / "ok", *random_hydra(cfg, 3, 0, layers=2))
    heads = load_hydra(tmp_path / "ok", cfg.hidden_size, cfg.vocab_size, "float64")
    assert heads.num_heads == 3 and len(heads.blocks[2]) == 2 and heads.lm_heads is None
    assert (heads.blocks[2][0].w.shape == [4 * cfg.hidden_size, cfg.hidden_size]
            and heads.blocks[2][1].rw is None)
    with pytest.raises(CheckpointError, match="no readable Hydra config"):
        load_hydra(tmp_path, cfg.hidden_size, cfg.vocab_size, "float64")
    blocks, _ = random_hydra(cfg, 2, 0)
    blocks[1][0]["w"] = blocks[1][0]["w"][:, :-1]
    save_hydra(tmp_path / "bad", blocks, None)
    with pytest.raises(CheckpointError, match="should be"):
        load_hydra(tmp_path / "bad", cfg.hidden_size, cfg.vocab_size, "float64")
    conf = json.loads((tmp_path / "ok" / "config.json").read_text())
    (tmp_path / "ok" / "config.json").write_text(json.dumps({**conf, "hydra_head_arch": "prefix-mlp"}))
    with pytest.raises(CheckpointError, match="only Hydra's grounded"):
        load_hydra(tmp_path / "ok", cfg.hidden_size, cfg.vocab_size, "float64")


def test_tree_is_built_head_by_head(tiny_model64):
    """Each node's token is head d's top-r guess from [hidden; emb(root); emb(drafts on its path)], as a
    per-node loop computes it; 8 slots' trees in one call."""
    m = tiny_model64.model
    cfg = m.config
    lm = m.weights.lm_head.dense().numpy().T
    blocks, lms = random_hydra(cfg, 3, 4, layers=2, lm=lm)
    d = __import__("tempfile").mkdtemp()
    save_hydra(d, blocks, lms)
    heads = load_hydra(d, cfg.hidden_size, cfg.vocab_size, "float64")
    paths = tuple(tuple(int(r) for r in c.split(",")) for c in CHOICES)
    prop = HydraProposer(heads, 3, paths, m.weights.embed)
    rng = np.random.default_rng(5)
    x0 = paddle.to_tensor(rng.normal(0, 1, (8, cfg.hidden_size)))
    root = rng.integers(0, cfg.vocab_size, 8)
    got = prop.draft(x0, root)
    head, rank, parents = tree_template(paths, 3, 3)
    embed = m.weights.embed.numpy()
    for s in range(8):
        tokens = {0: int(root[s])}
        for i in range(len(head)):
            path, p = [], int(parents[i])
            while p:
                path.append(tokens[p])
                p = int(parents[p - 1])
            x = np.concatenate([x0.numpy()[s], embed[root[s]]] + [embed[t] for t in reversed(path)])
            for b in heads.blocks[head[i]]:
                x = b(paddle.to_tensor(x[None])).numpy()[0]
            logits = x @ heads.lm_heads[head[i]].numpy()
            tokens[i + 1] = int(np.argsort(-logits, kind="stable")[rank[i]])
            assert got[s, i] == tokens[i + 1], (s, i)


def _prompts(n=14, seed=2):
    rng = np.random.default_rng(seed)
    shared = rng.integers(3, 250, 12).tolist()  # a common prefix for the shared-prefix runs
    return [(shared if i % 2 else []) + rng.integers(3, 250, int(k)).tolist()
            for i, k in enumerate(rng.integers(4, 30, n))]


def _equals_plain(model, method, path, backend_note, batches=(1, 7, 32)):
    prompts = _prompts()
    for mode in ("greedy", "sampled"):
        sp = [SamplingParams(max_tokens=4 + i % 11, temperature=0.8 if mode == "sampled" else 0.0, seed=i)
              for i in range(len(prompts))]
        plain = generate(prompts, model=model, sampling=sp,
                         engine=EngineConfig(batch_size=7, dtype="float64", shared_prefix="off"))
        drafted = 0
        for batch in batches:
            for chunk, shared in ((0, "off"), (8, "auto")):
                spec = SpecConfig(method=method, draft_model=str(path), adaptive=batch == 7,
                                  medusa=MedusaConfig(topk=3, tree_choices=CHOICES))
                picked = range(0, len(prompts), 3) if batch == 1 else range(len(prompts))
                out = generate([prompts[i] for i in picked], model=model, sampling=[sp[i] for i in picked],
                               ids=list(picked), speculative=spec,
                               engine=EngineConfig(batch_size=batch, dtype="float64", prefill_chunk=chunk,
                                                   shared_prefix=shared))
                assert [o.token_ids for o in out] == [plain[i].token_ids for i in picked], \
                    (backend_note, mode, batch, chunk, shared)
                drafted += sum(o.stats.num_draft_tokens for o in out)
        assert drafted > 0


@pytest.mark.parametrize("backend", ["fused", "reference"])
def test_random_hydra_equals_plain(backend, tmp_path):
    model = load_model(TINY / "llama", dtype="float64", backend=backend)
    lm = model.model.weights.lm_head.dense().numpy().T
    save_hydra(tmp_path, *random_hydra(model.config, 3, 1, lm=lm))
    _equals_plain(model, "hydra", tmp_path, backend, batches=(1, 7, 32) if backend == "fused" else (7,))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Medusa and Hydra heads trained by `specgen train-head` on one shared data cache (a few steps,
    tiny model)."""
    from specgen.cli import app

    d = tmp_path_factory.mktemp("heads")
    prompts = write_prompts(d / "p.jsonl", n=10)
    for kind in ("medusa", "hydra"):
        r = CliRunner().invoke(app, ["train-head", "--kind", kind, "--model", str(TINY / "llama"), "--data",
                                     str(prompts), "-o", str(d / kind), "--data-dir", str(d / "data"),
                                     "--steps", "8", "--batch-size", "4", "--seq-len", "16",
                                     "--gen-max-tokens", "16", "--heads", "3",
                                     "--eval-every", "4", "--lr", "3e-3", "--threads", "1"])
        assert r.exit_code == 0, r.output
        assert f"--method {kind} --draft-model" in r.output
    return d


def test_trained_heads_save_the_public_layout(trained):
    med = json.loads((trained / "medusa" / "config.json").read_text())
    hyd = json.loads((trained / "hydra" / "config.json").read_text())
    assert med["medusa_num_heads"] == 3 and med["medusa_num_layers"] == 1
    assert hyd["hydra_num_heads"] == 3 and hyd["hydra_head_arch"] == "mlp" and hyd["grounded_heads"]
    for meta in (med, hyd):
        acc = meta["specgen_training"]["eval_acc_per_position"]
        assert len(acc) == 3 and acc[0] >= acc[1] >= acc[2] >= 0  # every head up to the position right
    rows = (trained / "hydra" / "loss.csv").read_text().splitlines()
    assert rows[0].split(",")[6:9] == ["eval_acc", "eval_acc2", "eval_acc3"] and len(rows) > 2
    assert (trained / "medusa" / "draft_vocab.npy").is_file() and (trained / "hydra" / "loss.png").is_file()


@pytest.mark.parametrize("kind", ["medusa", "hydra"])
def test_trained_heads_equal_plain(kind, trained):
    model = load_model(TINY / "llama", dtype="float64")
    _equals_plain(model, kind, trained / kind, "fused")


def test_training_resumes_exactly(trained, tmp_path):
    """An interrupted Hydra run resumed from its checkpoint ends with the uninterrupted run's heads."""
    from specgen.train.config import TrainConfig
    from specgen.train.tree_heads import HydraTrainer

    lm = load_model(TINY / "llama", threads=1)
    cfg = TrainConfig(steps=6, batch_size=4, seq_len=16, gen_max_tokens=16, heads=2, checkpoint_every=3,
                      eval_every=3, log_every=3)
    for name in "ab":
        (tmp_path / name).mkdir()
    HydraTrainer(lm, tmp_path / "a", cfg, trained / "data").run()

    def stop(step, total, row):  # called after step 3's checkpoint
        if step == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        HydraTrainer(lm, tmp_path / "b", cfg, trained / "data").run(stop)
    HydraTrainer(lm, tmp_path / "b", cfg, trained / "data").run()
    a = (tmp_path / "a" / "hydra_lm_head.safetensors").read_bytes()
    assert a == (tmp_path / "b" / "hydra_lm_head.safetensors").read_bytes()


def test_method_alone_finds_the_shipped_heads(tiny_model64, monkeypatch, trained):
    """Without --draft-model the default model gets the package's heads; any other model an error
    naming it."""
    from specgen.drafters import medusa
    from specgen.models.default_model import DEFAULT_GGUF

    for kind in ("medusa", "hydra"):
        monkeypatch.setattr(medusa, "ASSETS", trained / "assets")
        (trained / "assets" / kind).mkdir(parents=True, exist_ok=True)
        target = trained / "assets" / kind / "smollm2-135m-instruct"
        if not target.exists():
            target.symlink_to(trained / kind)
        assert medusa.shipped_heads(kind, f"/x/{DEFAULT_GGUF}") == target
        assert medusa.shipped_heads(kind, "/x/other.gguf") is None
        with pytest.raises(CheckpointError, match=f"--method {kind} needs --draft-model"):
            generate([[5, 6, 7]], model=tiny_model64, speculative=SpecConfig(method=kind))


@pytest.mark.parametrize("kind", ["medusa", "hydra"])
def test_shipped_heads_run_alone_on_the_default_model(kind, real_model):
    """`--method medusa` / `--method hydra` alone: the package's trained heads draft for the default model,
    and the output is plain decoding's."""
    from specgen.drafters.medusa import shipped_heads

    path = shipped_heads(kind, str(real_model.model.source))
    assert path is not None, f"no {kind} heads shipped for the default model"
    prompts = [real_model.tokenizer.encode_chat([{"role": "user", "content": q}])
               for q in ("What is 12 times 7? Explain step by step.", "Write a haiku about the sea.")]
    sp = SamplingParams(max_tokens=24)
    plain = generate(prompts, model=real_model, sampling=sp)
    out = generate(prompts, model=real_model, sampling=sp,
                   speculative=SpecConfig(method=kind, adaptive=False))
    assert [o.token_ids for o in out] == [o.token_ids for o in plain]
    steps = sum(o.stats.num_steps for o in out)
    assert sum(len(o.token_ids) for o in out) / steps > 1.2  # trained heads: drafts are accepted
