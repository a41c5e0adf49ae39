"""The MTP head: incremental drafts equal a from-scratch recomputation on each backend; both weight layouts
load alike; its projections follow the main model's format."""
import numpy as np
import pytest

from specgen import EngineConfig, MtpConfig, SamplingParams, SpecConfig, generate
from specgen.backends.base import MtpPass
from specgen.drafters.mtp import MtpHeadWeights, random_mtp_weights, save_mtp
from specgen.engine.engine import Engine
from specgen.engine.proposers.base import SlotView
from specgen.engine.proposers.mtp import MtpProposer
from specgen.engine.types import Request
from specgen.errors import CheckpointError
from specgen.runtime.batch import build_forward_batch


def prepared(lm, weights, vocab=None, quantize=True):
    """A head read from `weights` and prepared for lm's backend."""
    head = MtpHeadWeights.read(weights, "random", lm.model, vocab)
    return lm.model.backend.prepare_drafter(lm.model, head, quantize)


class Recording(MtpProposer):
    """Records every proposal with the sequence it was made for. With an oracle (the plain run's outputs) it
    offers the true continuation instead, so every draft is accepted and each catch-up spans k + 1
    positions."""

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


def reference_drafts(lm, runner, seq, k, shift=0):
    """Recompute everything for one sequence: main prefill of seq[:-1], the head over positions [shift, n) (as
    head positions [0, n - shift)) into a fresh cache in one pass, then its chain. runner: one prepared head,
    or a list of modules (multi-layer MTP): module i runs over the same positions on module i - 1's outputs,
    fed token p + 1 + i where it is committed and the drafts of the modules before it past that; it drafts
    draft i + 1, the last module the rest by chaining itself."""
    m = lm.model
    n = len(seq) - 1
    batch = build_forward_batch(np.array([0]), np.array([0]), np.array([n]), np.array(seq[:-1]),
                                np.array([True]))
    hidden, rows = m.forward(batch, m.new_cache(1, 256)).hidden, np.arange(shift, n)
    modules = runner if isinstance(runner, list) else [runner]
    pos, drafts = np.arange(shift, n), []
    for i, r in enumerate(modules):
        ids = [seq[j] if j < len(seq) else drafts[j - len(seq)] for j in pos + 1 + i]
        cache = m.backend.new_cache(m, 1, m.max_len, "auto", num_layers=1)
        d, hidden = r.run(cache, MtpPass(
            token_slots=np.zeros(n - shift, np.int64), positions=pos - shift, token_ids=np.array(ids),
            rows=rows, hidden=hidden, seq_lens=np.array([n - shift]), last_rows=np.array([n - shift - 1]),
            depth=max(1, k - i) if i == len(modules) - 1 else 1))
        drafts += [int(x) for x in d[0]]
        rows = np.arange(n - shift)
        if len(drafts) >= k:
            break
    return drafts[:k]


def random_requests(lm, num, max_prompt, max_tokens, seed, oracle):
    """`num` requests of random prompts (2 .. max_prompt - 1 tokens), and with `oracle` each one's prompt and
    plain continuation (else None)."""
    rng = np.random.default_rng(seed)
    reqs = [Request(str(i), i, tuple(int(x) for x in rng.integers(3, 300, int(rng.integers(2, max_prompt)))),
                    SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for i in range(num)]
    if not oracle:
        return reqs, None
    plain = Engine(lm.model, None, EngineConfig(batch_size=4, dtype=lm.model.dtype))
    return reqs, [list(r.prompt_ids) + o.token_ids
                  for r, o in zip(reqs, sorted(plain.run(reqs), key=lambda o: o.index))]


@pytest.mark.parametrize("model,k,oracle,vocab,copy,batch,window", [
    ("fused64", 1, False, False, 0, 4, 0), ("fused64", 3, False, False, 0, 4, 0),
    ("fused64", 3, True, False, 0, 4, 0), ("fused32", 1, False, False, 0, 4, 0),
    ("fused32", 3, False, True, 0, 4, 0), ("fused32", 3, True, False, 0, 4, 0),
    ("fused64", 2, False, False, 2, 4, 0), ("fused32", 3, False, True, 2, 4, 0),
    ("fused32", 2, False, False, 1, 4, 0),
    ("fused32", 2, False, False, 2, 1, 0),  # one slot: a step that copies runs the pass with no drafts at all
    ("fused64", 3, False, False, 0, 4, 6), ("fused32", 3, False, False, 2, 4, 6),
    ("fused32", 3, True, True, 0, 4, 6), ("reference64", 3, False, True, 0, 4, 0),
    ("reference64", 2, False, False, 2, 4, 6), ("reference64", 3, True, False, 0, 4, 6)])
def test_incremental_drafts_equal_reference(tiny_models, model, k, oracle, vocab, copy, batch, window):
    """The head's pass of each step (catch-up of the committed positions, then chained drafts) gives the
    drafts a recomputation from scratch gives, bit for bit on the fused backend (every row computed on its
    own; float64 on the reference backend), with and without a draft vocabulary. With copies (copy_min > 0)
    the pass only catches the head's cache up for slots that will copy: the head's drafts offered in the steps
    after are still the reference's. With a prompt window (prompt_window = 6; 0 here: the whole prompt), the
    head's cache holds only a prompt's last 6 positions, stored from its position 0 (prompts prefilled in
    chunks of 4, so some chunks lie wholly before the window): the reference runs the head over those
    alone."""
    lm = tiny_models[model]
    dtype = lm.model.dtype
    ids = np.arange(0, lm.config.vocab_size, 3) if vocab else None  # a draft vocabulary of every third token
    head = prepared(lm, random_mtp_weights(lm.config, seed=1, std=0.3), ids)
    reqs, full = random_requests(lm, 10, 20, 64, 0, oracle)
    prop = Recording(lm.model, [head], k, oracle=full, copy_min=copy, prompt_window=window)
    # with a window, prompts are prefilled in chunks of 4: a chunk wholly before the window gets no head pass
    eng = Engine(lm.model, None,
                 EngineConfig(batch_size=batch, dtype=dtype, prefill_chunk=4 if window else 0), prop)
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

    # the head's window: a prompt's last `window` positions (prompts are unique prefixes here)
    def shift(seq):
        n = next(v for p, v in prompt_len.items() if tuple(seq[:v]) == p)
        return max(0, n - window) if window else 0

    if window:
        # many drafts made from a window of the prompt
        assert sum(shift(seq) > 0 for seq, _ in prop.log) >= 50
    mismatches = [(len(seq), list(d), reference_drafts(lm, head, seq, k, shift(seq)))
                  for seq, d in prop.log if list(d) != reference_drafts(lm, head, seq, k, shift(seq))]
    assert mismatches == []


@pytest.mark.parametrize("model,modules,k,oracle,copy,window,batch", [
    ("fused64", 2, 3, False, 0, 0, 4), ("fused64", 3, 3, True, 0, 6, 4), ("fused32", 3, 2, False, 2, 0, 4),
    ("fused64", 3, 4, False, 0, 6, 1), ("reference64", 2, 3, False, 0, 6, 4),
    ("reference64", 3, 2, True, 2, 0, 4)])
def test_multi_layer_drafts_equal_reference(tiny_models, model, modules, k, oracle, copy, window, batch):
    """Multi-layer MTP (N modules, module i drafting position i + 1; k > N chains the last module, k < N
    leaves the later modules catching up only): every step's drafts equal a from-scratch recomputation of
    every module, bit for bit on the fused backend, through prompts prefilled in chunks of 3 (a module's first
    positions lag module 0's by one per module across chunk ends), prompt windows, copies and every draft
    accepted (oracle)."""
    lm = tiny_models[model]
    dtype = lm.model.dtype
    weights = random_mtp_weights(lm.config, seed=3, std=0.3, num_modules=modules)
    heads = [lm.model.backend.prepare_drafter(lm.model, h, True)
             for h in MtpHeadWeights.read_modules(weights, "random", lm.model)]
    assert len(heads) == modules
    reqs, full = random_requests(lm, 7, 16, 24, 1, oracle)
    prop = Recording(lm.model, heads, k, oracle=full, copy_min=copy, prompt_window=window)
    eng = Engine(lm.model, None, EngineConfig(batch_size=batch, dtype=dtype, prefill_chunk=3), prop)
    outs = sorted(eng.run(reqs), key=lambda o: o.index)
    if oracle:
        assert [list(r.prompt_ids) + o.token_ids for r, o in zip(reqs, outs)] == full
    assert len(prop.log) >= 40
    prompt_len = {r.prompt_ids: len(r.prompt_ids) for r in reqs}

    def shift(seq):
        n = next(v for p, v in prompt_len.items() if tuple(seq[:v]) == p)
        return max(0, n - window) if window else 0

    mismatches = [(len(seq), list(d), reference_drafts(lm, heads, seq, k, shift(seq)))
                  for seq, d in prop.log if list(d) != reference_drafts(lm, heads, seq, k, shift(seq))]
    assert mismatches == []


def test_prompt_window_follows_the_heads_training(tmp_path):
    """A head trained by `specgen train-mtp` on windows of seq_len positions sees a prompt's last 2 x seq_len
    positions (the shipped head: 256); a head trained elsewhere sees the whole prompt."""
    import json

    from specgen.drafters import mtp

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
    a = reference_drafts(tiny_model64, prepared(tiny_model64, ds), seq, 2)
    b = reference_drafts(tiny_model64, prepared(tiny_model64, ernie), seq, 2)
    assert a == b


def _paddle_layout(ernie: dict) -> dict:
    """ERNIE-4.5 HF-layout MTP weights as Paddle checkpoints store them: `ernie.` names, [in, out], q/k/v and
    gate/up fused."""
    out = {}
    for name, w in ernie.items():
        n = "ernie." + name[len("model."):]
        if ".self_attn.k_proj." in n or ".self_attn.v_proj." in n or ".mlp.up_proj." in n:
            continue
        if ".self_attn.q_proj." in n:
            parts = [ernie[name.replace("q_proj", p)] for p in ("q_proj", "k_proj", "v_proj")]
            out[n.replace("q_proj", "qkv_proj")] = np.concatenate([p.T for p in parts], axis=1)
        elif ".mlp.gate_proj." in n:
            parts = [ernie[name.replace("gate_proj", p)] for p in ("gate_proj", "up_proj")]
            out[n.replace("gate_proj", "up_gate_proj")] = np.concatenate([p.T for p in parts], axis=1)
        else:
            out[n] = w.T.copy() if w.ndim == 2 else w
    return out


def test_ernie_paddle_naming_gives_the_same_drafts(tiny_model64, tmp_path):
    """FastDeploy's Paddle checkpoints (ernie.mtp_*, [in, out], fused qkv and up_gate), read through a
    directory with the main model's tensors beside them."""
    cfg = tiny_model64.config
    ds = random_mtp_weights(cfg, seed=2, std=0.3)
    p = f"model.layers.{cfg.num_layers}."
    names = {"enorm.weight": "model.mtp_emb_norm.0.weight", "hnorm.weight": "model.mtp_hidden_norm.0.weight",
             "eh_proj.weight": "model.mtp_linear_proj.0.weight"}
    ernie = {names.get(n[len(p):], "model.mtp_block.0." + n[len(p):]): w for n, w in ds.items()
             if not n[len(p):].startswith("shared_head")}
    paddle_names = _paddle_layout(ernie)
    assert "ernie.mtp_block.0.self_attn.qkv_proj.weight" in paddle_names
    paddle_names["ernie.layers.0.self_attn.qkv_proj.weight"] = np.zeros((cfg.hidden_size, 8), np.float32)
    save_mtp(tmp_path / "paddle", paddle_names)
    from specgen.drafters.mtp import load_mtp_weights

    weights = load_mtp_weights(tmp_path / "paddle")
    seq = [5, 9, 31, 7, 5, 9, 44, 12]
    a = reference_drafts(tiny_model64, prepared(tiny_model64, ds), seq, 2)
    b = reference_drafts(tiny_model64, prepared(tiny_model64, weights), seq, 2)
    assert a == b


def test_mtp_through_the_api_and_missing_head(tiny_model64, tmp_path):
    save_mtp(tmp_path / "head", random_mtp_weights(tiny_model64.config, std=0.3))
    prompts = [[5, 6, 7, 8], [9, 10]]
    sp = SamplingParams(max_tokens=10, ignore_eos=True)
    plain = generate(prompts, model=tiny_model64, sampling=sp, engine=EngineConfig(dtype="float64"))
    spec = generate(prompts, model=tiny_model64, sampling=sp, engine=EngineConfig(dtype="float64"),
                    speculative=SpecConfig(method="mtp", num_speculative_tokens=2, adaptive=False,
                                           mtp=MtpConfig(model=str(tmp_path / "head"))))
    assert [o.token_ids for o in plain] == [o.token_ids for o in spec]
    assert all(o.stats.num_draft_tokens > 0 for o in spec)
    # adaptive, copies judged apart from the head's drafts (DraftTokens.source), through the engine's
    # controller
    sp = SamplingParams(max_tokens=40, ignore_eos=True)
    plain = generate(prompts, model=tiny_model64, sampling=sp, engine=EngineConfig(dtype="float64"))
    for copy in (0, 2):
        spec = generate(prompts, model=tiny_model64, sampling=sp, engine=EngineConfig(dtype="float64"),
                        speculative=SpecConfig(method="mtp", num_speculative_tokens=3,
                                               mtp=MtpConfig(model=str(tmp_path / "head"), copy=copy)))
        assert [o.token_ids for o in plain] == [o.token_ids for o in spec]
    with pytest.raises(CheckpointError, match="needs an MTP head"):
        generate(prompts, model=tiny_model64, speculative=SpecConfig(method="mtp"))
    with pytest.raises(CheckpointError, match="no MTP weights"):
        MtpHeadWeights.read({}, "empty", tiny_model64.model)


@pytest.mark.parametrize("native", [True, False])
def test_copied_drafts_replace_the_heads_where_the_tail_repeats(tiny_model64, native):
    """With copy_min 2 a slot whose last 2..COPY_MAX tokens occurred before drafts what followed them there
    (longest, then latest match, as ngram.py); every other slot keeps the head's drafts; max_draft still
    bounds both."""
    from specgen.kernels import host_lib

    head = prepared(tiny_model64, random_mtp_weights(tiny_model64.config, seed=1))
    # else: numpy's
    p = MtpProposer(tiny_model64.model, [head], 3, copy_min=2, lib=host_lib() if native else None)
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
    p.drafts_at[:] = view.seq_lens  # the head's drafts were made for the committed text
    d = p.propose(view)
    assert d.draft_ids.tolist() == [[3, 4, 5], [93, 94, 95], [6, 4, 1], [99, 100, 101], [7, 8, 9]]
    assert d.num_draft.tolist() == [3, 2, 2, 3, 3]
    off = MtpProposer(tiny_model64.model, [head], 3)  # copy_min 0: the head's drafts everywhere
    off._ensure(5)
    off.drafts[:], off.num_drafts[:], off.drafts_at[:] = p.drafts, p.num_drafts, p.drafts_at
    assert off.propose(view).draft_ids.tolist() == p.drafts.tolist()
    # drafts made for another length (steps the proposer was not told of) are not offered; copies still are
    p.drafts_at[[1, 3]] -= 2
    assert p.propose(view).num_draft.tolist() == [3, 0, 2, 0, 3]
    off.drafts_at[:] = -1
    assert off.propose(view).num_draft.tolist() == [0, 0, 0, 0, 0]


def test_head_projections_are_q8_0_blocks_beside_a_quantized_main_model(real_model):
    """Beside a main model kept in GGUF blocks (the default model) the head's projections are packed as Q8_0
    (gguf.quants' rounding: within half a step of each 32-weight block's scale), with integer products on a
    CPU with AVX-512 VNNI; with quantize off they stay float32. Drafts then differ little: on 10 random
    prompts most first drafts agree."""
    from specgen import kernels
    from specgen.backends.fused import FusedBackend

    m = real_model.model
    if not isinstance(m.backend, FusedBackend):
        pytest.skip("Q8_0 head projections need the fused backend")
    weights = random_mtp_weights(real_model.config, seed=4, std=0.02)
    heads = {}
    for quantize in (True, False):
        head = MtpHeadWeights.read(weights, "random", m)
        heads[quantize] = (head, m.backend.prepare_drafter(m, head, quantize))
    (q_head, q_run), (f_head, f_run) = heads[True], heads[False]
    assert q_run.int8_product == kernels.has_vnni() and not f_run.int8_product
    for q, f in zip(q_head.linears(), f_head.linears()):
        assert (q.weight.kind, f.weight.kind) == ("Q8_0", "F32")
        wq, wf = q.weight.numpy(), f.weight.numpy()  # [in, out]
        step = np.abs(wf).reshape(-1, 32, wf.shape[1]).max(axis=1) / 127  # [in / 32, out] each block's scale
        # half a step, plus 127 times the scale's own rounding to float16 (2^-11 relative)
        assert np.all(np.abs(wq - wf).reshape(-1, 32, wf.shape[1])
                      <= step[:, None, :] * (0.5 + 127 * 2.0 ** -11))
        assert not np.array_equal(wq, wf)
    rng = np.random.default_rng(3)
    same = 0
    for _ in range(10):
        seq = [int(x) for x in rng.integers(3, 3000, 12)]
        same += reference_drafts(real_model, q_run, seq, 1) == reference_drafts(real_model, f_run, seq, 1)
    assert same >= 7, f"{same} of 10 first drafts agree"


def test_head_beside_a_float_model_stays_float(tiny_model):
    """A main model without GGUF blocks: the head's projections are packed from its float weights."""
    from specgen.backends.fused import FusedBackend

    m = tiny_model.model
    if not isinstance(m.backend, FusedBackend):
        pytest.skip("packed head projections need the fused backend")
    head = MtpHeadWeights.read(random_mtp_weights(tiny_model.config, seed=4, std=0.3), "random", m)
    m.backend.prepare_drafter(m, head, True)
    assert {lin.weight.kind for lin in head.linears()} == {"F32"}


def test_sampled_drafts_are_drawn_with_the_noise_of_the_position_verification_samples():
    """MtpPass.draw for a step's sequences: a greedy one's 1 / temperature is 0 (its drafts the argmax); a
    sampled one's carries its request key exactly (two 32-bit halves in float64) and, as its first draft's
    output position, the one the next step's first verification row samples (the row at model position
    seq_len - 1: position seq_len - prompt_len, as the engine's _row_sampling)."""
    import dataclasses

    from specgen.engine.proposers.mtp import _draw
    from specgen.engine.types import SlotSampling, StepUpdate

    keys = np.array([0xFEDCBA9876543210, 0x0123456789ABCDEF, 7], np.uint64)
    seq_lens, prompt_lens = np.array([10, 12, 30]), np.array([4, 5, 9])
    update = StepUpdate(
        slots=np.arange(3), block_start=np.zeros(3, np.int64), first_pos=np.zeros(3, np.int64),
        num_valid=np.ones(3, np.int64), finished=np.zeros(3, bool), tokens=np.zeros((3, 32), np.int64),
        hidden=None, seq_lens=seq_lens, prompt_lens=prompt_lens,
        sampling=SlotSampling(np.array([0.0, 0.5, 1.25]), np.zeros(3, np.int64), np.ones(3), keys))
    draw = _draw(update, np.array([0, 1, 2]), seq_lens)
    assert draw.shape == (4, 3) and draw[0].tolist() == [0.0, 2.0, 0.8]
    rebuilt = (draw[1].astype(np.uint64) << np.uint64(32)) | draw[2].astype(np.uint64)
    assert rebuilt.tolist() == keys.tolist()
    model_position = seq_lens - 1  # the next step's first verification row of each sequence
    assert draw[3].tolist() == (model_position + 1 - prompt_lens).tolist()
    assert _draw(update, np.array([1]), seq_lens[1:2])[3].tolist() == [7.0]  # a subset of the sequences
    greedy = dataclasses.replace(update, sampling=SlotSampling(np.zeros(3), np.zeros(3, np.int64), np.ones(3),
                                                               keys))
    assert _draw(greedy, np.arange(3), seq_lens) is None  # none samples: argmax drafts
