"""--method draft_model: exact whatever the draft, the vocabulary checked, make-draft's checkpoint loads."""
from __future__ import annotations

import json
import shutil

import pytest
from cli_support import invoke, read_output, write_jsonl
from conftest import TINY

from specgen import EngineConfig, Method, SamplingParams, SpecConfig, generate, load_model
from specgen.engine.proposers.draft_model import check_vocabulary
from specgen.errors import CheckpointError, ConfigError
from specgen.models import load_checkpoint
from specgen.models.export import first_layers, save_hf

PROMPTS = [[3, 4, 5, 6, 7, 3, 4, 5], [9, 8, 7, 9, 8, 7, 9, 8], [11, 12, 13],
           [20, 21, 20, 21, 20, 21, 20, 21, 20]]


@pytest.fixture(scope="module")
def cut(tmp_path_factory):
    """A 1-layer draft cut from the tiny llama (a poor drafter: drafts are often wrong)."""
    path = tmp_path_factory.mktemp("draft") / "cut"
    save_hf(first_layers(load_checkpoint(TINY / "llama"), 1), path)
    return path


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("draft", ["self", "cut"])
def test_draft_model_outputs_equal_plain_decoding(tiny_model, tiny_model64, cut, draft, dtype):
    lm = tiny_model if dtype == "float32" else tiny_model64
    path = str(TINY / "llama") if draft == "self" else str(cut)
    for temperature in (0.0, 0.9):
        sp = SamplingParams(max_tokens=24, ignore_eos=True, temperature=temperature, seed=11)
        ref = [o.token_ids for o in generate(PROMPTS, model=lm, sampling=sp)]
        for batch, adaptive in ((1, False), (3, False), (4, True)):
            spec = SpecConfig(method=Method.DRAFT_MODEL, draft_model=path, adaptive=adaptive,
                              num_speculative_tokens=4)
            outs = generate(PROMPTS, model=lm, sampling=sp,
                            engine=EngineConfig(batch_size=batch, dtype=dtype), speculative=spec)
            assert [o.token_ids for o in outs] == ref, (draft, temperature, batch)
            # the model drafting for itself: every draft right, sampled ones too (drafts are sampled with the
            # noise verification uses)
            if draft == "self" and not adaptive:
                assert all(o.stats.num_accepted_tokens == o.stats.num_draft_tokens > 0 for o in outs)


def test_vocabulary_must_match(tmp_path):
    other = tmp_path / "other"
    shutil.copytree(TINY / "llama", other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    name = next(n for n, i in vocab.items() if i == 7)
    vocab[name + "_x"] = vocab.pop(name)
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(CheckpointError, match="token 7 differs"):
        generate([[1, 2]], model=load_model(TINY / "llama"), sampling=SamplingParams(max_tokens=2),
                 speculative=SpecConfig(method=Method.DRAFT_MODEL, draft_model=str(other)))
    with pytest.raises(CheckpointError, match="vocabulary has 100 tokens, the main model's 300"):
        check_vocabulary(None, None, 300, 100, "d")


def test_draft_model_needs_a_checkpoint():
    with pytest.raises(ConfigError, match="needs --draft-model PATH"):
        SpecConfig(method=Method.DRAFT_MODEL)


def test_make_draft_and_run_from_the_cli(tmp_path):
    draft = tmp_path / "draft"
    result = invoke("make-draft", "-o", draft, "--layers", "1", "--model", TINY / "llama")
    assert result.exit_code == 0, result.output
    assert json.loads((draft / "config.json").read_text())["num_hidden_layers"] == 1
    assert invoke("make-draft", "-o", tmp_path / "d2", "--layers", "2", "--model",
                  TINY / "llama").exit_code == 2
    inp = write_jsonl(tmp_path / "in.jsonl", [{"input_ids": p} for p in PROMPTS])
    args = ["--max-tokens", "12", "--ignore-eos", "-q"]
    assert invoke("run", inp, "-o", tmp_path / "plain.jsonl", *args).exit_code == 0
    spec = json.dumps({"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2})
    result = invoke("run", inp, "-o", tmp_path / "draft.jsonl", *args, "--speculative-config", spec)
    assert result.exit_code == 0, result.output
    by = {r["id"]: r["token_ids"] for r in read_output(tmp_path / "plain.jsonl")}
    got = read_output(tmp_path / "draft.jsonl")
    assert all(r["token_ids"] == by[r["id"]] for r in got) and len(got) == len(PROMPTS)
    bad = invoke("run", inp, "-o", tmp_path / "x.jsonl", *args, "--method", "ngram", "--draft-model",
                 str(draft))
    assert bad.exit_code == 2 and "draft_model needs method draft_model or mtp" in bad.output


def test_untrained_draft_exports_the_cut_itself(tiny_model):
    """The trainable draft starts as the cut: its layers and final norm written back under their HF names are
    the main model's first layers' own weights."""
    from specgen.train.draft import TrainableDraft

    cut = first_layers(load_checkpoint(TINY / "llama"), 1)
    w = TrainableDraft(tiny_model.model, 1).hf_weights()
    assert sorted(w) == sorted(n for n in cut.weights if n.startswith(("model.layers.", "model.norm")))
    for name, a in w.items():
        assert a.shape == cut.weights[name].shape and float(abs(a - cut.weights[name]).max()) < 1e-6, name


def test_make_draft_distills_and_the_draft_stays_exact(tmp_path):
    """make-draft --data: the draft learns the model's own continuations (on its training prompts, more of its
    drafts are accepted than the cut's), the training state stays beside the checkpoint, rerunning refuses to
    overwrite, and outputs with it equal plain decoding."""
    prompts = [[int(x) for x in range(3 + i, 3 + i + 4 + i % 5)] for i in range(12)]
    data = write_jsonl(tmp_path / "train.jsonl",
                       [{"id": f"t{i}", "input_ids": p} for i, p in enumerate(prompts)])
    draft = tmp_path / "distilled"
    args = ["make-draft", "-o", draft, "--layers", "1", "--model", TINY / "llama", "--data", data,
            "--steps", "40", "--batch-size", "4", "--seq-len", "16", "--gen-max-tokens", "24", "--lr", "3e-3",
            "--threads", "1", "-q"]
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    info = json.loads((draft / "config.json").read_text())["specgen_draft"]
    assert (info["layers"] == 1 and info["training"]["steps"] == 40
            and (draft / "training" / "loss.csv").is_file())
    assert invoke(*args).exit_code == 2  # a checkpoint is there already
    lm = load_model(TINY / "llama")
    sp = SamplingParams(max_tokens=24)
    ref = [o.token_ids for o in generate(prompts, model=lm, sampling=sp)]
    accepted = {}
    for name, path in (("cut", tmp_path / "cut"), ("distilled", draft)):
        if name == "cut":
            save_hf(first_layers(load_checkpoint(TINY / "llama"), 1), path)
        outs = generate(prompts, model=lm, sampling=sp, speculative=SpecConfig(
            method=Method.DRAFT_MODEL, draft_model=str(path), adaptive=False, num_speculative_tokens=2))
        assert [o.token_ids for o in outs] == ref
        accepted[name] = (sum(o.stats.num_accepted_tokens for o in outs)
                          / sum(o.stats.num_draft_tokens for o in outs))
    assert accepted["distilled"] > accepted["cut"] + 0.1, accepted


def test_draft_shares_the_shared_prefix(tiny_model64, cut):
    """With a shared prompt prefix the draft computes its KV once too (its cache's shared prefix): each slot's
    own draft rows hold only its tail and output, and outputs are those of plain decoding."""
    import numpy as np

    from specgen.api import make_engine
    from specgen.engine.types import Request

    rng = np.random.default_rng(2)
    prefix = rng.integers(3, 250, 80).tolist()
    prompts = [prefix + rng.integers(3, 250, int(n)).tolist() for n in (3, 9, 17, 5)]
    reqs = [Request(str(i), i, tuple(p), SamplingParams(max_tokens=12, ignore_eos=True))
            for i, p in enumerate(prompts)]
    spec = SpecConfig(method=Method.DRAFT_MODEL, draft_model=str(cut), adaptive=False,
                      num_speculative_tokens=3)
    outs = {}
    for shared in ("auto", "off"):
        eng = make_engine(tiny_model64, EngineConfig(batch_size=4, dtype="float64", shared_prefix=shared,
                                                     min_shared_prefix=64), spec)
        outs[shared] = sorted((o.id, o.token_ids) for o in eng.run(reqs))
        draft_cache = eng.proposer.cache
        if shared == "auto":
            assert draft_cache.prefix is not None and list(eng.proposer.prefix_ids) == prefix
            assert draft_cache.peak_own <= 17 + 12 + 3 + 1  # the longest tail, its outputs, the draft chain
        else:
            assert draft_cache.prefix is None and draft_cache.peak_own >= 80
    assert outs["auto"] == outs["off"]


def test_draft_with_a_shorter_context_stops_drafting_past_it(tiny_model, tmp_path):
    """A draft whose context is 24 positions drafts for slots below it and none past it (those decode
    plainly); prompts prefilled in chunks catch the draft up chunk by chunk; outputs equal plain
    decoding's."""
    ckpt = load_checkpoint(TINY / "llama")
    short = first_layers(ckpt, 1)
    short = type(short)(**{**short.__dict__, "config": type(short.config)(
        **{**short.config.__dict__, "max_position_embeddings": 24})})
    save_hf(short, tmp_path / "short")
    prompts = [list(range(3, 3 + n)) for n in (4, 10, 30)]
    sp = SamplingParams(max_tokens=30, ignore_eos=True)
    ref = [o.token_ids for o in generate(prompts, model=tiny_model, sampling=sp)]
    for chunk in (0, 4):
        outs = generate(prompts, model=tiny_model, sampling=sp,
                        engine=EngineConfig(batch_size=3, prefill_chunk=chunk),
                        speculative=SpecConfig(method=Method.DRAFT_MODEL, draft_model=str(tmp_path / "short"),
                                               adaptive=False, num_speculative_tokens=2))
        assert [o.token_ids for o in outs] == ref
        drafted = [o.stats.num_draft_tokens for o in outs]
        assert drafted[0] > 0 and drafted[2] == 0  # the 30-token prompt is past the draft's context at once
        assert drafted[0] <= 2 * (24 - 4)  # drafts only while the slot is inside the draft's context


def test_draft_quantizes_to_8_bit_blocks_beside_a_block_quantized_main_model(tiny_model, real_model):
    """Under auto a (float) draft beside the default model's Q4_1 blocks is quantized to Q8_0, not rounded to
    4 bits; beside a float main model it stays as stored; an explicit mode is the main model's."""
    from specgen.engine.proposers.draft_model import draft_quantization

    assert draft_quantization(real_model.model, "auto") == "wint8"
    assert draft_quantization(tiny_model.model, "auto") == "auto"
    assert draft_quantization(real_model.model, "wint4") == "wint4"


def test_prompt_window_bounds_the_drafts_catch_up(tiny_model64, cut):
    """With a prompt window of 8 the draft reads each prompt's last 8 positions only (its own positions start
    there): its cache holds those and the outputs, not the prompts; outputs equal plain decoding, with and
    without chunked prefill and a shared prefix, greedy and sampled."""
    import numpy as np

    from specgen.api import make_engine
    from specgen.config import DraftConfig
    from specgen.engine.types import Request

    rng = np.random.default_rng(5)
    prefix = rng.integers(3, 250, 70).tolist()
    prompts = [prefix + rng.integers(3, 250, n).tolist() for n in (2, 11, 30)] + [[5, 6, 7]]
    reqs = [Request(str(i), i, tuple(p), SamplingParams(max_tokens=16, ignore_eos=True,
                                                        temperature=0.7 * (i % 2), seed=3))
            for i, p in enumerate(prompts)]
    plain = make_engine(tiny_model64, EngineConfig(batch_size=4, dtype="float64"), SpecConfig())
    ref = sorted((o.id, o.token_ids) for o in plain.run(reqs))
    for chunk, shared in ((0, "off"), (4, "auto")):
        spec = SpecConfig(method=Method.DRAFT_MODEL, draft_model=str(cut), adaptive=False,
                          num_speculative_tokens=3, draft=DraftConfig(prompt_window=8))
        eng = make_engine(tiny_model64, EngineConfig(batch_size=4, dtype="float64", prefill_chunk=chunk,
                                                     shared_prefix=shared, min_shared_prefix=64), spec)
        outs = list(eng.run(reqs))
        assert sorted((o.id, o.token_ids) for o in outs) == ref
        assert all(o.stats.num_draft_tokens > 0 for o in outs)
        assert eng.proposer.cache.peak_own <= 8 + 16 + 3 + 1  # the window, the outputs, the draft chain
