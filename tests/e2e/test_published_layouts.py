"""Drafter checkpoints as their projects publish them (issue 60): SafeAILab's EAGLE pytorch_model.bin (with
its copy of the embedding), Medusa's medusa_lm_head.pt and bfloat16 safetensors, vLLM's converted Medusa
heads (blocks.*, lm_heads.*, a token_map), Hydra's hydra_lm_head.pt (with input_embed_fn.weight) and
bfloat16 safetensors. Each is the same random drafter as a canonical safetensors checkpoint (values exact in
bfloat16): on a tiny float64 main model, with every draft verified, its tokens are plain decoding's and its
drafts and acceptances are the canonical checkpoint's, token for token."""
import json
import shutil

import numpy as np
import pytest
from conftest import TINY
from heads import random_eagle, random_hydra, random_medusa
from torch_files import save_torch

from specgen import EngineConfig, SamplingParams, SpecConfig, generate, load_model
from specgen.config import EagleConfig, MedusaConfig
from specgen.drafters.eagle import save_eagle
from specgen.drafters.hydra import save_hydra
from specgen.drafters.medusa import save_medusa
from specgen.models.checkpoint import write_safetensors
from specgen.models.hf_loader import read_safetensors


def _bf16(a: np.ndarray) -> np.ndarray:
    """float32 values exact in bfloat16 (the top half of each one's bits)."""
    return (np.asarray(a, np.float32).view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)


def _save_bf16(path, tensors):
    write_safetensors(path, {n: ("BF16", a.shape) for n, a in tensors.items()},
                      lambda n: (tensors[n].view(np.uint32) >> 16).astype(np.uint16))


def _canonical(method, model, d):
    """The drafter written in specgen's layout at d (values exact in bfloat16): (weights file, tensors)."""
    cfg = model.config
    if method == "eagle":
        save_eagle(d, random_eagle(cfg, 1), cfg)
        name = "model.safetensors"
    elif method == "medusa":
        lm = model.model.weights.lm_head.dense().numpy().T
        save_medusa(d, *random_medusa(cfg, 3, 1, lm))
        name = "medusa_lm_head.safetensors"
    else:
        save_hydra(d, *random_hydra(cfg, 3, 5))
        name = "hydra_lm_head.safetensors"
    tensors = {n: _bf16(a) for n, a in read_safetensors([d / name]).items()}
    (d / name).unlink()
    write_safetensors(d / name, {n: ("F32", a.shape) for n, a in tensors.items()}, tensors.__getitem__)
    return name, tensors


def _published(layout, model, canonical, tensors, d):
    """The same drafter at d in a published layout."""
    shutil.copytree(canonical, d)
    for f in d.glob("*.safetensors"):
        f.unlink()
    embed = np.asarray(model.model.weights.embed.numpy(), np.float32)
    if layout == "eagle-bin":  # SafeAILab's: a torch state dict holding the embedding too
        save_torch(d / "pytorch_model.bin", {**tensors, "embed_tokens.weight": embed}, views=True)
    elif layout == "eagle-bin-bf16":
        save_torch(d / "pytorch_model.bin", {**tensors, "embed_tokens.weight": _bf16(embed)}, bf16=True)
    elif layout == "medusa-pt":
        save_torch(d / "medusa_lm_head.pt", tensors)
    elif layout == "medusa-bf16":
        _save_bf16(d / "medusa_lm_head.safetensors", tensors)
    elif layout == "medusa-vllm":  # vLLM's names, its heads' vocabulary truncated to a token_map
        vocab = model.config.vocab_size
        token_map = np.sort(np.random.default_rng(4).permutation(vocab)[: vocab * 3 // 4])
        np.save(canonical / "draft_vocab.npy", token_map)  # the same restriction, in specgen's layout
        conv = {"token_map": token_map.astype(np.int64)}
        for h in range(3):
            conv[f"blocks.{h}.layers.0.weight"] = tensors[f"{h}.0.linear.weight"]
            conv[f"blocks.{h}.layers.0.bias"] = tensors[f"{h}.0.linear.bias"]
            conv[f"lm_heads.{h}.weight"] = tensors[f"{h}.1.weight"][token_map]
        write_safetensors(d / "model.safetensors",
                          {n: ("I64" if a.dtype == np.int64 else "F32", a.shape) for n, a in conv.items()},
                          conv.__getitem__)
        (d / "config.json").write_text(json.dumps({"num_heads": 3, "num_hidden_layers": 1,
                                                   "vocab_size": vocab, "medusa_fc_bias": True,
                                                   "truncated_vocab_size": len(token_map)}))
    elif layout == "hydra-pt":  # the repository's hydra_head.state_dict(), the embedding a submodule
        save_torch(d / "hydra_lm_head.pt", {**tensors, "input_embed_fn.weight": embed})
    elif layout == "hydra-bf16":
        _save_bf16(d / "hydra_lm_head.safetensors", tensors)


def _spec(method, path):
    if method == "eagle":
        return SpecConfig(method="eagle", draft_model=str(path), adaptive=False, num_speculative_tokens=3,
                          eagle=EagleConfig(topk=3, nodes=8, copy=0))
    return SpecConfig(method=method, draft_model=str(path), adaptive=False,
                      medusa=MedusaConfig(topk=2, tree_choices=("0,0,0", "1", "0,1", "1,0")))


@pytest.fixture(scope="module")
def model():
    return load_model(TINY / "llama", dtype="float64")


@pytest.mark.parametrize("layout", ["eagle-bin", "eagle-bin-bf16", "medusa-pt", "medusa-bf16", "medusa-vllm",
                                    "hydra-pt", "hydra-bf16"])
def test_published_layout_drafts_as_the_canonical_one(layout, model, tmp_path):
    method = layout.split("-")[0]
    name, tensors = _canonical(method, model, tmp_path / "canonical")
    _published(layout, model, tmp_path / "canonical", tensors, tmp_path / "published")
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 250, int(n)).tolist() for n in rng.integers(4, 30, 5)]
    sp = [SamplingParams(max_tokens=12, seed=i, temperature=0.8 * (i % 2)) for i in range(len(prompts))]
    engine = EngineConfig(batch_size=3, dtype="float64")
    plain = generate(prompts, model=model, sampling=sp, engine=engine)
    runs = {which: generate(prompts, model=model, sampling=sp, engine=engine,
                            speculative=_spec(method, tmp_path / which))
            for which in ("canonical", "published")}
    for out in runs.values():
        assert [o.token_ids for o in out] == [o.token_ids for o in plain]
    stats = {which: [(o.stats.num_draft_tokens, o.stats.num_accepted_tokens) for o in out]
             for which, out in runs.items()}
    assert stats["published"] == stats["canonical"]
    assert sum(n for n, _ in stats["published"]) > 0


def _widest_offer(monkeypatch):
    """Records the most nodes any slot was offered in one step (tree.offer, as the engine calls it)."""
    import specgen.engine.engine as engine_module

    seen = [0]
    offer = engine_module.offer

    def recording(drafts, max_depth, rows_left):
        out = offer(drafts, max_depth, rows_left)
        seen[0] = max(seen[0], int(out[1].max(initial=0)))
        return out

    monkeypatch.setattr(engine_module, "offer", recording)
    return seen


@pytest.mark.parametrize("backend", ["fused", "reference"])
def test_trees_of_64_nodes_top_10(backend, tmp_path, monkeypatch):
    """EAGLE-2's tree sizes (60 nodes, top-10): dynamic EAGLE trees of 64 nodes and static Medusa trees of 64
    nodes, every node verified, give plain decoding's tokens on both backends."""
    model = load_model(TINY / "llama", dtype="float64", backend=backend)
    cfg = model.config
    save_eagle(tmp_path / "eagle", random_eagle(cfg, 1), cfg)
    lm = model.model.weights.lm_head.dense().numpy().T
    save_medusa(tmp_path / "medusa", *random_medusa(cfg, 3, 1, lm))
    # 10 + 30 + 24 = 64 nodes (paths of sibling ranks): every top-10 guess at depth 1, 3 children under each,
    # 8 under each of (0, 0), (1, 0) and (2, 0)
    choices = [f"{a}" for a in range(10)] + [f"{a},{b}" for a in range(10) for b in range(3)] + \
        [f"{a},{b},{c}" for a in range(3) for b in range(1) for c in range(8)]
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, 250, int(n)).tolist() for n in rng.integers(4, 30, 4)]
    sp = [SamplingParams(max_tokens=10, seed=i, temperature=0.8 * (i % 2)) for i in range(len(prompts))]
    engine = EngineConfig(batch_size=2, dtype="float64", max_model_len=128)
    plain = generate(prompts, model=model, sampling=sp, engine=engine)
    specs = [SpecConfig(method="eagle", draft_model=str(tmp_path / "eagle"), adaptive=False,
                        num_speculative_tokens=5, eagle=EagleConfig(topk=10, nodes=64, copy=0)),
             SpecConfig(method="medusa", draft_model=str(tmp_path / "medusa"), adaptive=False,
                        num_speculative_tokens=3,
                        medusa=MedusaConfig(topk=10, tree_choices=tuple(choices)))]
    for spec in specs:
        seen = _widest_offer(monkeypatch)
        out = generate(prompts, model=model, sampling=sp, engine=engine, speculative=spec)
        assert [o.token_ids for o in out] == [o.token_ids for o in plain], spec.method
        assert seen[0] > 32, (spec.method, seen[0])


@pytest.mark.parametrize("method", ["medusa", "hydra"])
def test_num_speculative_tokens_is_the_tree_depth(method, model, tmp_path):
    from specgen.engine.proposers import build_proposer

    if method == "medusa":
        save_medusa(tmp_path, *random_medusa(model.config, 4, 1))
    else:
        save_hydra(tmp_path, *random_hydra(model.config, 4, 5))
    for k, depth in ((1, 1), (2, 2), (5, 4)):  # 4 heads: at most 4 deep
        spec = SpecConfig(method=method, draft_model=str(tmp_path), num_speculative_tokens=k,
                          medusa=MedusaConfig(tree_choices=("0,0,0,0,0", "1", "0,1")))
        p = build_proposer(spec, model.model)
        assert int(p.head.max()) + 1 == depth and len(p.head) == depth + 2 - (k == 1), (k, p.head)


def test_hydra_lm_heads_with_biases(model, tmp_path):
    """Hydra's own LM heads keep their biases (hydra_lm_head.{d}.bias), with a draft vocabulary too."""
    from specgen.drafters.hydra import load_hydra

    cfg = model.config
    lm = model.model.weights.lm_head.dense().numpy().T
    blocks, lms = random_hydra(cfg, 2, 5, lm=lm)
    save_hydra(tmp_path, blocks, lms)
    bias = np.random.default_rng(1).normal(0, 1, cfg.vocab_size).astype(np.float32)
    tensors = read_safetensors([tmp_path / "hydra_lm_head.safetensors"])
    tensors = {**{n: tensors[n] for n in tensors}, **{f"hydra_lm_head.{d}.bias": bias for d in range(2)}}
    specs = {n: ("F32", a.shape) for n, a in tensors.items()}
    write_safetensors(tmp_path / "hydra_lm_head.safetensors", specs, tensors.__getitem__)
    np.save(tmp_path / "draft_vocab.npy", np.arange(0, cfg.vocab_size, 3))
    heads = load_hydra(tmp_path, cfg.hidden_size, cfg.vocab_size, "float64")
    assert heads.lm_bias is not None and not heads.lm_draft_columns
    np.testing.assert_array_equal(heads.lm_bias[1].numpy(), bias)
    spec = SpecConfig(method="hydra", draft_model=str(tmp_path), adaptive=False,
                      medusa=MedusaConfig(topk=2, tree_choices=("0,0", "1")))
    sp = SamplingParams(max_tokens=8)
    plain = generate([[5, 6, 7, 8, 9]], model=model, sampling=sp)
    out = generate([[5, 6, 7, 8, 9]], model=model, sampling=sp, speculative=spec)
    assert out[0].token_ids == plain[0].token_ids and out[0].stats.num_draft_tokens > 0
