"""The MTP head: incremental drafts equal a from-scratch reference; both weight layouts load alike."""
import numpy as np
import pytest

from specgen import EngineConfig, SamplingParams, SpecConfig, generate
from specgen.engine.proposers.base import SlotView
from specgen.engine.proposers.mtp import MtpHead, MtpProposer, random_mtp_weights, save_mtp
from specgen.engine.runner import Engine
from specgen.engine.types import Request, build_forward_batch
from specgen.errors import CheckpointError


class Recording(MtpProposer):
    """Records every proposal with the sequence it was made for. With an oracle (the plain run's outputs) it
    offers the true continuation instead, so every draft is accepted and each catch-up spans k + 1 positions."""

    def __init__(self, *a, oracle=None, copy_min=0, prompt_window=0):
        super().__init__(*a, copy_min=copy_min, prompt_window=prompt_window)
        self.log, self.oracle, self.copied = [], oracle, 0

    def propose(self, view):
        d = super().propose(view)
        if self.cache is not None:
            for i, s in enumerate(view.slots):
                if d.source is not None and d.source[i]:  # a copy: the head drafted nothing for this step
                    self.copied += 1
                    continue
                self.log.append((view.tokens[s, : view.seq_lens[i]].copy(), self.drafts[s].copy()))
        if self.oracle is None:
            return d
        draft = np.zeros((len(view.slots), self.k), np.int64)
        for i, s in enumerate(view.slots):
            seq = view.tokens[s, : view.seq_lens[i]].tolist()
            full = next(f for f in self.oracle if f[: len(seq)] == seq)
            nxt = full[len(seq): len(seq) + self.k]
            draft[i, : len(nxt)] = nxt
        return type(d)(draft, np.minimum(self.k, view.max_draft))


def reference_drafts(lm, head, seq, k, shift=0):
    """Recompute everything for one sequence: main prefill of seq[:-1], head over positions [shift, n) (as head
    positions [0, n - shift)), then chain."""
    m = lm.model
    n = len(seq) - 1
    batch = build_forward_batch(np.array([0]), np.array([0]), np.array([n]), np.array(seq[:-1]), np.array([True]))
    _, hidden = m.forward(batch, m.new_cache(1, 256))
    fresh = MtpProposer(m, head, k)
    fresh._ensure(1)
    x, d = fresh._run(np.array([0]), np.array([0]), np.array([n - shift]), np.array(seq[shift + 1:]), hidden[shift:])
    out = [int(d[0])]
    for i in range(1, k):
        x, d = fresh._run(np.array([0]), np.array([n - 1 - shift + i]), np.array([1]), d, x)
        out.append(int(d[0]))
    return out


@pytest.mark.parametrize("dtype,k,oracle,vocab,copy,batch,window", [
    ("float64", 1, False, False, 0, 4, 0), ("float64", 3, False, False, 0, 4, 0), ("float64", 3, True, False, 0, 4, 0),
    ("float32", 1, False, False, 0, 4, 0), ("float32", 3, False, True, 0, 4, 0), ("float32", 3, True, False, 0, 4, 0),
    ("float64", 2, False, False, 2, 4, 0), ("float32", 3, False, True, 2, 4, 0), ("float32", 2, False, False, 1, 4, 0),
    ("float32", 2, False, False, 2, 1, 0),  # one slot: a step that copies runs the fused pass with no drafts at all
    ("float64", 3, False, False, 0, 4, 6), ("float32", 3, False, False, 2, 4, 6), ("float32", 3, True, True, 0, 4, 6)])
def test_incremental_drafts_equal_reference(tiny_model64, tiny_model, dtype, k, oracle, vocab, copy, batch, window):
    """float32 runs the step's head pass as one fused op (specgen_mtp_draft), the reference `_run`'s op-by-op
    path: their drafts must agree bit for bit, with and without a draft vocabulary. With copies (copy_min > 0)
    the fused pass only catches the head's cache up for slots that will copy: the head's drafts offered in the
    steps after are still the reference's. With a prompt window (prompt_window = 6; 0 here: the whole prompt),
    the head's cache holds only a prompt's last 6 positions, stored from its position 0 (prompts prefilled in
    chunks of 4, so some chunks lie wholly before the window): the reference runs the head over those alone."""
    lm = tiny_model64 if dtype == "float64" else tiny_model
    ids = np.arange(0, lm.config.vocab_size, 3) if vocab else None  # a draft vocabulary of every third token
    head = MtpHead(random_mtp_weights(lm.config, seed=1, std=0.3), "random", lm.model, ids)
    rng = np.random.default_rng(0)
    reqs = [Request(str(i), i, tuple(int(x) for x in rng.integers(3, 300, int(rng.integers(2, 20)))),
                    SamplingParams(max_tokens=64, ignore_eos=True)) for i in range(10)]
    full = None
    if oracle:
        plain = Engine(lm.model, None, EngineConfig(batch_size=4, dtype=dtype))
        full = [list(r.prompt_ids) + o.token_ids for r, o in zip(reqs, sorted(plain.run(reqs), key=lambda o: o.index))]
    prop = Recording(lm.model, head, k, oracle=full, copy_min=copy, prompt_window=window)
    assert prop.fused == (dtype == "float32" and lm.model.fused_layer)
    # with a window, prompts are prefilled in chunks of 4: a chunk wholly before the window gets no head pass
    eng = Engine(lm.model, None, EngineConfig(batch_size=batch, dtype=dtype, prefill_chunk=4 if window else 0), prop)
    outs = sorted(eng.run(reqs), key=lambda o: o.index)
    assert len(outs) == 10
    if copy:
        assert prop.copied >= 10 and len(prop.log) >= 100  # both kinds of steps, many times
    else:
        assert len(prop.log) >= (10 * 64 // (k + 1) if oracle else 10 * 63)
    if oracle:
        assert [list(r.prompt_ids) + o.token_ids for r, o in zip(reqs, outs)] == full
        assert sum(o.stats.num_accepted_tokens for o in outs) >= 10 * 64 * k // (k + 1) - 10 * k
    if vocab:
        assert all(np.isin(d, ids).all() for _, d in prop.log)
    prompt_len = {r.prompt_ids: len(r.prompt_ids) for r in reqs}

    def shift(seq):  # the head's window: a prompt's last `window` positions (prompts are unique prefixes here)
        n = next(v for p, v in prompt_len.items() if tuple(seq[:v]) == p)
        return max(0, n - window) if window else 0

    if window:
        assert sum(shift(seq) > 0 for seq, _ in prop.log) >= 50  # many drafts made from a window of the prompt
    mismatches = [(len(seq), list(d), reference_drafts(lm, head, seq, k, shift(seq)))
                  for seq, d in prop.log if list(d) != reference_drafts(lm, head, seq, k, shift(seq))]
    assert mismatches == []


def test_prompt_window_follows_the_heads_training(tmp_path):
    """A head trained by `specgen train-mtp` on windows of seq_len positions sees a prompt's last 2 x seq_len
    positions (the shipped head: 256); a head trained elsewhere sees the whole prompt."""
    import json

    from specgen.engine.proposers import mtp

    for name, config, window in [("trained", {"specgen_training": {"seq_len": 64}}, 128),
                                 ("external", {"architectures": ["DeepseekV3MTP"]}, 0),
                                 ("broken", {"specgen_training": {"seq_len": "long"}}, 0)]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        assert mtp.prompt_window(tmp_path / name) == window, name
    assert mtp.prompt_window(tmp_path / "missing") == 0
    assert mtp.prompt_window(mtp.SHIPPED_HEAD) == 256


def test_ernie_layout_gives_the_same_drafts(tiny_model64, tmp_path):
    cfg = tiny_model64.config
    ds = random_mtp_weights(cfg, seed=2, std=0.3)
    p = f"model.layers.{cfg.num_layers}."
    ernie = {}
    for name, w in ds.items():
        rest = name[len(p):]
        if rest == "enorm.weight":
            ernie["model.mtp_emb_norm.0.weight"] = w
        elif rest == "hnorm.weight":
            ernie["model.mtp_hidden_norm.0.weight"] = w
        elif rest == "eh_proj.weight":
            ernie["model.mtp_linear_proj.0.weight"] = w
        elif not rest.startswith("shared_head"):
            ernie["model.mtp_block.0." + rest] = w
    seq = [5, 9, 31, 7, 5, 9, 44, 12]
    a = reference_drafts(tiny_model64, MtpHead(ds, "ds", tiny_model64.model), seq, 2)
    b = reference_drafts(tiny_model64, MtpHead(ernie, "ernie", tiny_model64.model), seq, 2)
    assert a == b


def test_mtp_through_the_api_and_missing_head(tiny_model64, tmp_path):
    save_mtp(tmp_path / "head", random_mtp_weights(tiny_model64.config, std=0.3))
    prompts = [[5, 6, 7, 8], [9, 10]]
    sp = SamplingParams(max_tokens=10, ignore_eos=True)
    plain = generate(prompts, model=tiny_model64, sampling=sp, engine=EngineConfig(dtype="float64"))
    spec = generate(prompts, model=tiny_model64, sampling=sp, engine=EngineConfig(dtype="float64"),
                    speculative=SpecConfig(method="mtp", num_speculative_tokens=2, mtp_model=str(tmp_path / "head"),
                                           adaptive=False))
    assert [o.token_ids for o in plain] == [o.token_ids for o in spec]
    assert all(o.stats.num_draft_tokens > 0 for o in spec)
    # adaptive, copies judged apart from the head's drafts (DraftTokens.source), through the engine's controller
    sp = SamplingParams(max_tokens=40, ignore_eos=True)
    plain = generate(prompts, model=tiny_model64, sampling=sp, engine=EngineConfig(dtype="float64"))
    for copy in (0, 2):
        spec = generate(prompts, model=tiny_model64, sampling=sp, engine=EngineConfig(dtype="float64"),
                        speculative=SpecConfig(method="mtp", num_speculative_tokens=3, mtp_copy=copy,
                                               mtp_model=str(tmp_path / "head")))
        assert [o.token_ids for o in plain] == [o.token_ids for o in spec]
    with pytest.raises(CheckpointError, match="needs an MTP head"):
        generate(prompts, model=tiny_model64, speculative=SpecConfig(method="mtp"))
    with pytest.raises(CheckpointError, match="no MTP weights"):
        MtpHead({}, "empty", tiny_model64.model)


@pytest.mark.parametrize("native", [True, False])
def test_copied_drafts_replace_the_heads_where_the_tail_repeats(tiny_model64, native):
    """With copy_min 2 a slot whose last 2..COPY_MAX tokens occurred before drafts what followed them there
    (longest, then latest match, as ngram.py); every other slot keeps the head's drafts; max_draft still bounds
    both."""
    head = MtpHead(random_mtp_weights(tiny_model64.config, seed=1), "random", tiny_model64.model)
    p = MtpProposer(tiny_model64.model, head, 3, copy_min=2)
    if not native:
        p._lib = None  # ngram.py's numpy reference
    p._ensure(5)
    p.drafts[:] = [[90, 91, 92], [93, 94, 95], [96, 97, 98], [99, 100, 101], [102, 103, 104]]  # the head's
    p.num_drafts[:] = [3, 2, 3, 3, 3]
    rows = [[1, 2, 3, 4, 5, 1, 2, 0, 0, 0, 0, 0, 0, 0],  # tail (1, 2) at 0: copy 3 4 5
            [7, 8, 9, 10, 11, 0, 0, 0, 0, 0, 0, 0, 0, 0],  # nothing repeats: the head's two drafts
            [4, 1, 2, 3, 6, 4, 1, 2, 3, 0, 0, 0, 0, 0],  # tail (1, 2, 3) wins over (2, 3): copy 6 4 1
            [5, 6, 7, 6, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],  # only a 1-token tail repeats: the head's
            [1, 2, 3, 4, 7, 8, 9, 2, 3, 4, 5, 1, 2, 3, 4]]  # (1..4) at 0 wins over the later (2, 3, 4): 7 8 9
    rows = [r + [0] * (15 - len(r)) for r in rows]
    view = SlotView(slots=np.array([0, 1, 2, 3, 4]), tokens=np.array(rows, np.int64),
                    seq_lens=np.array([7, 5, 9, 4, 15]), max_draft=np.array([3, 3, 2, 3, 3]))
    d = p.propose(view)
    assert d.draft_ids.tolist() == [[3, 4, 5], [93, 94, 95], [6, 4, 1], [99, 100, 101], [7, 8, 9]]
    assert d.num_draft.tolist() == [3, 2, 2, 3, 3]
    off = MtpProposer(tiny_model64.model, head, 3)  # copy_min 0: the head's drafts everywhere
    off._ensure(5)
    off.drafts[:], off.num_drafts[:] = p.drafts, p.num_drafts
    assert off.propose(view).draft_ids.tolist() == p.drafts.tolist()


def test_head_projections_are_q8_0_blocks_beside_a_quantized_main_model(tiny_model, monkeypatch):
    """A float32 main model whose weights are packed as blocks packs the head's projections as Q8_0 (gguf.quants'
    rounding: within half a step of each 32-weight block's scale); SPECGEN_QUANTIZED_HEAD=0 keeps float32."""
    from specgen.engine.model import LINEAR_KEYS

    m = tiny_model.model
    if not m.packs:
        pytest.skip("Q8_0 head projections need packed weights (the fused kernels and AVX2 or AVX-512)")
    weights = random_mtp_weights(tiny_model.config, seed=4, std=0.3)
    heads = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("SPECGEN_QUANTIZED_HEAD", flag)
        heads[flag] = MtpHead(weights, "random", m)
    assert m.keeps_quantized
    for key in LINEAR_KEYS + ("eh_proj",):
        q, f = (h.eh_proj if key == "eh_proj" else h.block[key] for h in (heads["1"], heads["0"]))
        assert (q.kind, f.kind) == ("Q8_0", "F32")
        wq, wf = q.numpy(), f.numpy()  # [in, out]
        step = np.abs(wf).reshape(-1, 32, wf.shape[1]).max(axis=1) / 127  # [in / 32, out] each block's scale
        # half a step, plus 127 times the scale's own rounding to float16 (2^-11 relative)
        assert np.all(np.abs(wq - wf).reshape(-1, 32, wf.shape[1]) <= step[:, None, :] * (0.5 + 127 * 2.0 ** -11))
        assert not np.array_equal(wq, wf)


def test_head_products_are_integer_on_vnni(tiny_model, monkeypatch):
    """On a CPU with AVX-512 VNNI the head's Q8_0 blocks (and its draft vocabulary's LM-head rows) are packed for
    integer products, from the same blocks; SPECGEN_INT8_HEAD=0 keeps float32 products. Drafts then differ
    little: on 10 random prompts most of the fused op's first drafts are the float32 products' drafts."""
    from specgen import kernels
    from specgen.engine.model import LINEAR_KEYS

    m = tiny_model.model
    weights = random_mtp_weights(tiny_model.config, seed=4, std=0.3)
    ids = np.arange(0, tiny_model.config.vocab_size, 2)
    heads = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("SPECGEN_INT8_HEAD", flag)
        heads[flag] = MtpHead(weights, "random", m, ids)
    if not kernels.has_vnni():
        assert not heads["1"].int8_product
        pytest.skip("no AVX-512 VNNI: the head keeps float32 products")
    assert heads["1"].int8_product and not heads["0"].int8_product
    # the LM head's rows are repacked only from GGUF blocks of the main model's (this one's is float32)
    assert heads["1"].lm_head.int8_product == (m.w.lm_head_quant is not None)
    for key in LINEAR_KEYS + ("eh_proj",):
        a, b = (h.eh_proj if key == "eh_proj" else h.block[key] for h in (heads["1"], heads["0"]))
        assert (a.int8_product, b.int8_product) == (True, False), key
        np.testing.assert_array_equal(a.numpy(), b.numpy())  # the same weights, only their products differ
    rng = np.random.default_rng(3)
    same = total = 0
    for _ in range(10):
        seq = [int(x) for x in rng.integers(3, 300, 12)]
        d8, d32 = (reference_drafts(tiny_model, heads[f], seq, 1)[0] for f in ("1", "0"))
        same += d8 == d32
        total += 1
    assert same >= 7, f"{same} of {total} first drafts agree"
