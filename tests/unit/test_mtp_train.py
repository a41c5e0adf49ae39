"""`specgen train-mtp`: what is trained is what the engine runs; data, checkpoints and saves are exact."""
import dataclasses
import json
import shutil

import numpy as np
import paddle
import pytest
from conftest import TINY

from specgen import MtpConfig, SamplingParams, SpecConfig, generate, load_model
from specgen.drafters.mtp import MtpHeadWeights, load_mtp_weights, save_mtp
from specgen.runtime.batch import build_forward_batch
from specgen.train.config import TrainConfig
from specgen.train.data import generate_data, load_data, read_requests
from specgen.train.head import TrainableHead, block_arrays, export_weights, initial_weights
from specgen.train.trainer import Trainer, noisy_hidden
from specgen.train.windows import make_batch, make_windows

SMALL = {"gen_max_tokens": 24, "gen_batch_size": 8, "steps": 12, "batch_size": 4, "seq_len": 16, "lr": 3e-3,
         "warmup_steps": 2, "log_every": 2, "eval_every": 4, "checkpoint_every": 4, "chain_weight": 0.5}


def write_prompts(path, n=16, seed=0):
    rng = np.random.default_rng(seed)
    path.write_text("".join(json.dumps({"id": f"p{i}",
                                        "input_ids": [int(x) for x in rng.integers(3, 290, 3 + i % 9)]})
                            + "\n" for i in range(n)))
    return path


@pytest.fixture(scope="module")
def lm():
    return load_model(TINY / "llama", threads=1)


@pytest.fixture(scope="module")
def data_dir(lm, tmp_path_factory):
    """A generated data cache, shared (copied) by the training tests."""
    d = tmp_path_factory.mktemp("mtp")
    cfg = TrainConfig(**SMALL)
    generate_data(lm, read_requests(write_prompts(d / "p.jsonl"), "jsonl", lm, cfg), d / "data", cfg)
    return d


def fresh_run(data_dir, tmp_path, name):
    out = tmp_path / name
    shutil.copytree(data_dir / "data", out / "data")
    return out


def reference_head(m, weights, vocab=None):
    """The head on the reference backend (its `_pass` gives block outputs and drafts) and a one-slot cache."""
    head = m.backend.prepare_drafter(m, MtpHeadWeights.read(weights, "exported", m, vocab), quantize=False)
    return head, m.backend.new_cache(m, 1, m.max_len, "auto", num_layers=1)


def perturbed_head(lm, arch_model, seed):
    """A trainable head whose every weight is moved off its initial value,
    so that no term is trivially zero."""
    w = initial_weights(arch_model, "random", seed)
    rng = np.random.default_rng(seed)
    w = {k: (v + rng.standard_normal(v.shape).astype(np.float32) * (0.3 if v.ndim == 1 else 0.1))
         for k, v in w.items()}
    return TrainableHead(arch_model, w)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "ernie4_5"])
def test_training_forward_equals_engine_drafts(arch):
    """Block outputs, logits and argmax of the training forward (both drafts) equal the engine's head pass
    (the reference backend's; test_mtp.py holds the fused one to it) for every prefix of a sequence: the
    exported head, loaded by the engine with float32 projections, computes what was trained."""
    lm = load_model(TINY / arch, threads=1, backend="reference")
    m = lm.model
    head = perturbed_head(lm, m, seed=3)
    seq = [5, 9, 31, 7, 5, 9, 44, 12, 100, 3, 77, 200]
    n = len(seq) - 1
    batch = build_forward_batch(np.array([0]), np.array([0]), np.array([n]), np.array(seq[:-1]),
                                np.array([True]))
    hidden = m.forward(batch, m.new_cache(1, 64)).hidden  # [n, hidden] what the engine hands the head
    ref_x, ref_d, ref_x2, ref_d2 = [], [], [], []
    for j in range(1, n + 1):  # the engine's head over positions [0, j), then one chained step at position j
        engine_head, cache = reference_head(m, export_weights(head))
        x, d, _ = engine_head._pass(cache, np.array([0]), np.array([0]), np.array([j]),
                                    np.array(seq[1:j + 1]), hidden[:j])
        x2, d2, _ = engine_head._pass(cache, np.array([0]), np.array([j]), np.array([1]), d, x)
        (ref_x.append(x.numpy()[0]), ref_d.append(int(d[0])), ref_x2.append(x2.numpy()[0]),
         ref_d2.append(int(d2[0])))
    pos = paddle.to_tensor(np.arange(n)[None])
    x1, kv = head(hidden.unsqueeze(0), paddle.to_tensor(np.array(seq[1:])[None]), pos)
    rows = paddle.to_tensor(np.arange(n))
    logits = head.logits(x1, rows, m.weights.lm_head.dense()).numpy()
    np.testing.assert_allclose(x1.numpy()[0], np.array(ref_x), rtol=1e-4, atol=1e-4)
    assert logits.argmax(-1).tolist() == ref_d
    # the engine chains on its own drafts
    x2 = head.chain(x1, kv, paddle.to_tensor(np.array(ref_d)[None]), pos)
    np.testing.assert_allclose(x2.numpy()[0], np.array(ref_x2), rtol=1e-4, atol=1e-4)
    assert head.logits(x2, rows, m.weights.lm_head.dense()).numpy().argmax(-1).tolist() == ref_d2


def test_draft_vocabulary_restricts_the_drafts():
    """With draft_vocab.npy the engine drafts the argmax over those tokens only;
    a bad one is a CheckpointError."""
    from specgen.errors import CheckpointError

    lm = load_model(TINY / "llama", threads=1, backend="reference")
    m = lm.model
    head = perturbed_head(lm, m, seed=4)
    vocab = np.arange(1, 300, 3)
    seq = [5, 9, 31, 7, 5, 9, 44, 12, 100, 3]
    n = len(seq) - 1
    batch = build_forward_batch(np.array([0]), np.array([0]), np.array([n]), np.array(seq[:-1]),
                                np.array([True]))
    hidden = m.forward(batch, m.new_cache(1, 64)).hidden
    drafts = []
    for j in range(1, n + 1):
        short, cache = reference_head(m, export_weights(head), vocab)
        drafts.append(int(short._pass(cache, np.array([0]), np.array([0]), np.array([j]),
                                      np.array(seq[1:j + 1]), hidden[:j])[1][0]))
    x1, _ = head(hidden.unsqueeze(0), paddle.to_tensor(np.array(seq[1:])[None]),
                 paddle.to_tensor(np.arange(n)[None]))
    logits = head.logits(x1, paddle.to_tensor(np.arange(n)), m.weights.lm_head.dense()).numpy()
    assert drafts == vocab[logits[:, vocab].argmax(-1)].tolist()
    for bad in (np.array([0, 300]), np.array([[1, 2]]), np.array([0.5])):
        with pytest.raises(CheckpointError, match="draft vocabulary"):
            MtpHeadWeights.read(export_weights(head), "bad", m, bad)


def test_saved_draft_vocabulary_is_the_most_frequent_training_labels(lm, data_dir, tmp_path):
    """--draft-vocab N saves the N most frequent training labels (sorted by id) as draft_vocab.npy, without
    changing the training; 0 saves the whole training vocabulary."""
    from specgen.train.trainer import training_set
    from specgen.train.windows import label_counts

    base = TrainConfig(**{**SMALL, "steps": 2, "eval_every": 2, "checkpoint_every": 2})
    full = training_set(data_dir / "data", lm.config.vocab_size, base)
    n = len(full.vocab_ids) // 3
    assert n >= 10
    outs = {}
    for size in (0, n):
        outs[size] = fresh_run(data_dir, tmp_path, f"v{size}")
        Trainer(lm, outs[size], dataclasses.replace(base, draft_vocab=size)).run()
    assert np.array_equal(np.load(outs[0] / "draft_vocab.npy"), full.vocab_ids)
    saved = np.load(outs[n] / "draft_vocab.npy")
    counts = label_counts(full.data, full.train, lm.config.vocab_size)
    left_out = np.setdiff1d(full.vocab_ids, saved)
    assert len(saved) == n and np.all(np.diff(saved) > 0) and np.isin(saved, full.vocab_ids).all()
    assert counts[saved].min() >= counts[left_out].max()
    meta = json.loads((outs[n] / "config.json").read_text())["specgen_training"]
    assert meta["draft_vocab_size"] == n and meta["draft_vocab"] == n
    assert meta["draft_coverage"] == pytest.approx(counts[saved].sum() / counts.sum())
    assert (outs[0] / "model.safetensors").read_bytes() == (outs[n] / "model.safetensors").read_bytes()


def test_recorded_data_is_what_the_engine_computes(lm, data_dir):
    """The cached rows equal a teacher-forced forward of prompt + continuation (up to float16 rounding), the
    continuations are the plain greedy outputs, and every target is the model's greedy choice at its
    position."""
    data = load_data(data_dir / "data")
    m = lm.model
    for s in range(3):
        first, n = int(data.first_pos[s]), int(data.num_rows[s])
        toks = data.tokens[data.tok_start[s]: data.tok_start[s] + n + 1]
        targets = data.targets[data.tok_start[s]: data.tok_start[s] + n + 1]
        prompt = json.loads((data_dir / "p.jsonl").read_text()
                            .splitlines()[int(data.ids[s][1:])])["input_ids"]
        assert first == 0 and data.prompt_len[s] == len(prompt)
        plain = generate([prompt], model=lm, sampling=SamplingParams(max_tokens=SMALL["gen_max_tokens"]))[0]
        assert toks.tolist() == prompt + plain.token_ids
        batch = build_forward_batch(np.array([0]), np.array([0]), np.array([n]), toks[:-1], np.array([True]))
        out = m.forward(batch, m.new_cache(1, 64))
        logits, hidden = out.logits, out.hidden
        rows = np.asarray(data.hidden[data.row_start[s]: data.row_start[s] + n], np.float32)
        np.testing.assert_allclose(rows, hidden.numpy(), rtol=2e-3, atol=2e-3)
        assert targets[1:].tolist() == logits.numpy().argmax(-1).tolist()  # greedy choice at positions 1..T-1


def test_sampled_continuations_are_labelled_with_greedy_choices(lm, tmp_path):
    """gen_samples = 2: each prompt gets a sampled sibling whose every target is the model's greedy choice
    (not the sampled token), and the held-out split keeps a prompt's continuations on one side, holding out
    only greedy ones."""
    from specgen.train.data import prompt_groups
    from specgen.train.trainer import training_set

    cfg = TrainConfig(**{**SMALL, "gen_samples": 2, "gen_temperature": 1.0, "eval_fraction": 0.25})
    path = write_prompts(tmp_path / "p.jsonl", n=8)
    generate_data(lm, read_requests(path, "jsonl", lm, cfg), tmp_path / "data", cfg)
    data = load_data(tmp_path / "data")
    assert sorted(data.ids) == sorted([f"p{i}" for i in range(8)] + [f"p{i}#sample1" for i in range(8)])
    m = lm.model
    differs = 0
    for s in range(len(data.ids)):
        if "#sample" not in data.ids[s]:
            continue
        n = int(data.num_rows[s])
        toks = data.tokens[data.tok_start[s]: data.tok_start[s] + n + 1]
        targets = data.targets[data.tok_start[s]: data.tok_start[s] + n + 1]
        batch = build_forward_batch(np.array([0]), np.array([0]), np.array([n]), toks[:-1], np.array([True]))
        logits = m.forward(batch, m.new_cache(1, 64)).logits
        assert targets[1:].tolist() == logits.numpy().argmax(-1).tolist()
        differs += targets[1:].tolist() != toks[1:].tolist()
    assert differs > 0  # sampling left the greedy path somewhere
    groups, greedy = prompt_groups(data.ids)
    assert greedy.tolist() == ['#sample' not in i for i in data.ids]
    assert len(set(groups.tolist())) == 8
    tset = training_set(tmp_path / "data", lm.config.vocab_size, cfg)
    train_groups = set(groups[np.unique(tset.train.seq)].tolist())
    held_seqs = np.unique(tset.held_out.seq)
    assert len(held_seqs) and all("#sample" not in data.ids[i] for i in held_seqs)
    assert not train_groups & set(groups[held_seqs].tolist())


def test_chunked_prefill_and_shared_prefix_record_the_same_data(lm, tmp_path):
    """Prompt chunks and a shared prompt prefix (computed once by the engine)
    leave the recorded data unchanged."""
    from specgen.config import EngineConfig

    rng = np.random.default_rng(1)
    common = [int(x) for x in rng.integers(3, 290, 6)]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"input_ids": common + [int(x) for x in rng.integers(3, 290, 2 + i)]})
                            + "\n" for i in range(6)))
    cfg = TrainConfig(**SMALL)
    reqs = read_requests(path, "jsonl", lm, cfg)
    plain = EngineConfig(batch_size=4, shared_prefix="off")
    packed = EngineConfig(batch_size=4, prefill_chunk=3, shared_prefix="auto", min_shared_prefix=2)
    generate_data(lm, reqs, tmp_path / "a", cfg, engine_config=plain)
    generate_data(lm, reqs, tmp_path / "b", cfg, engine_config=packed)
    a, b = load_data(tmp_path / "a"), load_data(tmp_path / "b")
    order = [b.ids.index(i) for i in a.ids]
    assert np.array_equal(a.tokens,
                          np.concatenate([b.tokens[b.tok_start[s]: b.tok_start[s] + b.num_rows[s] + 1]
                                          for s in order]))
    assert np.array_equal(a.targets,
                          np.concatenate([b.targets[b.tok_start[s]: b.tok_start[s] + b.num_rows[s] + 1]
                                          for s in order]))
    rows_b = np.concatenate([b.hidden[b.row_start[s]: b.row_start[s] + b.num_rows[s]] for s in order])
    np.testing.assert_allclose(np.asarray(a.hidden, np.float32), rows_b.astype(np.float32), atol=1e-2)


def test_windows_cover_each_example_once(lm, data_dir):
    data = load_data(data_dir / "data")
    for prompt_examples in (True, False):
        for from_end in (False, True):
            w = make_windows(data, seq_len=8, overlap=2, prompt_examples=prompt_examples, from_end=from_end)
            assert (w.length <= 8).all() and (w.loss_from >= w.start).all()
            for s in range(len(data.ids)):
                mine = np.nonzero(w.seq == s)[0]
                loss = [p for i in mine for p in range(w.loss_from[i], w.start[i] + w.length[i])]
                end = data.first_pos[s] + data.num_rows[s] - 1  # position i + 2 exists for i < end
                assert loss == list(range(0 if prompt_examples else data.prompt_len[s] - 1, end))
                # a window's loss starts past `overlap` context positions, unless it starts at the
                # sequence's start
                assert all(w.loss_from[i] - w.start[i] >= 2 or w.start[i] == data.first_pos[s]
                           for i in mine[1:])
                # the last window ends at the sequence's end and is as long as it can be
                if from_end and len(mine):
                    assert w.start[mine[-1]] + w.length[mine[-1]] == end
                    assert w.length[mine[-1]] == min(8, end - data.first_pos[s])


def test_data_generation_resumes(lm, data_dir, tmp_path):
    cfg = TrainConfig(**SMALL)
    reqs = read_requests(data_dir / "p.jsonl", "jsonl", lm, cfg)
    out = tmp_path / "data"

    def stop_after_5(done, total, tokens):
        if done == 5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        generate_data(lm, reqs, out, cfg, stop_after_5)
    with open(out / "hidden.f16", "ab") as f:  # a row written before a kill, and a half-written line
        f.write(b"\0" * 2 * lm.config.hidden_size)
    with open(out / "sequences.jsonl", "a") as f:
        f.write('{"id": "p9", "prom')
    generate_data(lm, reqs, out, cfg)
    a, b = load_data(out), load_data(data_dir / "data")
    assert sorted(a.ids) == sorted(b.ids) and len(a.ids) == len(set(a.ids)) == 16
    for s, sid in enumerate(a.ids):
        t = b.ids.index(sid)
        seq_a = a.tokens[a.tok_start[s]: a.tok_start[s] + a.num_rows[s] + 1]
        assert seq_a.tolist() == b.tokens[b.tok_start[t]: b.tok_start[t] + b.num_rows[t] + 1].tolist()
        np.testing.assert_allclose(
            np.asarray(a.hidden[a.row_start[s]: a.row_start[s] + a.num_rows[s]], np.float32),
            np.asarray(b.hidden[b.row_start[t]: b.row_start[t] + b.num_rows[t]], np.float32), atol=1e-2)


def test_teacher_rows_hold_the_state_each_label_was_chosen_from(lm, data_dir):
    """A batch's teacher rows (position i + 1, and i + 2 for the second draft) are the cached hidden states
    whose LM-head argmax is the label at i + 2 (i + 3): the distribution the soft-target loss distils."""
    data = load_data(data_dir / "data")
    w = make_windows(data, seq_len=16, overlap=4, prompt_examples=True)
    b = make_batch(data, w, np.arange(len(w)), 16, np.arange(lm.config.vocab_size))
    lm_head = lm.model.weights.lm_head.dense().numpy()  # [hidden, vocab]
    for rows, labels in ((b.teacher_rows, b.label_ids), (b.chain_teacher_rows, b.chain_ids)):
        assert len(rows) == len(labels) > 50
        chosen = (np.asarray(data.hidden[rows], np.float32) @ lm_head).argmax(-1)
        assert (chosen == labels).mean() > 0.97  # float16 rows: a near-tie may flip


def test_distill_loss_mixes_the_label_and_the_main_models_distribution(lm, data_dir, tmp_path):
    """(1 - d) cross-entropy on the greedy label + d cross-entropy against softmax(teacher row @ LM head) over
    the training vocabulary, computed here in float64 numpy."""
    d = 0.3
    trainer = Trainer(lm, fresh_run(data_dir, tmp_path, "run"), TrainConfig(**{**SMALL, "distill": d}))
    s = trainer.set
    b = make_batch(s.data, s.train, np.arange(min(4, len(s.train))), SMALL["seq_len"], s.vocab_index)
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((len(b.label_ids), len(s.vocab_ids))).astype(np.float32)
    got = float(trainer._loss(paddle.to_tensor(logits), paddle.to_tensor(b.label_ids), b.teacher_rows))
    lm_train = lm.model.weights.lm_head.dense().numpy()[:, s.vocab_ids].astype(np.float64)
    t = np.asarray(s.data.hidden[b.teacher_rows], np.float64) @ lm_train
    p = np.exp(t - t.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    z = logits.astype(np.float64)
    logp = z - z.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    hard = -logp[np.arange(len(z)), b.label_ids].mean()
    soft = -(p * logp).sum(-1).mean()
    assert abs(soft - hard) > 0.01  # the two terms differ, so the mix is tested
    assert got == pytest.approx((1 - d) * hard + d * soft, rel=1e-4)


@pytest.mark.parametrize("distill", [0.0, 0.5])
def test_training_lowers_the_loss(lm, data_dir, tmp_path, distill):
    out = fresh_run(data_dir, tmp_path, "run")
    cfg = TrainConfig(**{**SMALL, "steps": 30, "log_every": 5, "eval_every": 30, "distill": distill})
    trainer = Trainer(lm, out, cfg)
    rows = []
    trainer.run(lambda step, total, row: row and rows.append(row))
    train = [r["loss"] for r in rows if r["loss"] is not None]
    assert train[-1] < 0.8 * train[0]
    assert rows[-1]["eval_loss"] < rows[0]["eval_loss"]  # held-out, full vocabulary: step 0 vs the end
    assert ((out / "loss.png").stat().st_size > 1000
            and (out / "loss.csv").read_text().count("\n") == len(rows) + 1)


def test_multi_layer_head_trains_each_module_and_runs_exactly(lm, data_dir, tmp_path):
    """--num-layers 3: the modules learn (the tiny random model's text is memorised: training loss and module
    1's training accuracy rise; held-out accuracy stays ~0 on random text), the head saves as three
    DeepSeek-V3 modules, and drafting with it keeps the outputs of plain decoding at k below, at and above the
    modules."""
    out = fresh_run(data_dir, tmp_path, "multi")
    cfg = TrainConfig(**{**SMALL, "steps": 40, "log_every": 10, "eval_every": 20, "num_layers": 3})
    rows = []
    Trainer(lm, out, cfg).run(lambda step, total, row: row and rows.append(row))
    train = [r for r in rows if r["loss"] is not None]
    assert train[-1]["loss"] < 0.8 * train[0]["loss"] and train[-1]["acc2"] > train[0]["acc2"] + 0.1
    last = rows[-1]
    assert last["eval_acc"] >= last["eval_acc2"] >= last["eval_acc3"] >= 0  # all drafts right, nested
    assert {k.split(".")[0] for k in final_weights(out) if "." in k} == {"m1", "m2"}
    meta = json.loads((out / "config.json").read_text())
    assert meta["num_nextn_predict_layers"] == 3 and meta["specgen_training"]["eval_acc3"] is not None
    modules = MtpHeadWeights.read_modules(load_mtp_weights(out), "saved", lm.model)
    assert len(modules) == 3 and not np.array_equal(modules[1].eh_proj.weight.numpy(),
                                                    modules[2].eh_proj.weight.numpy())
    prompts = [[5, 6, 7, 8, 9, 10, 5, 6], [11, 12, 13], [40, 41, 42, 43, 44]]
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    plain = generate(prompts, model=lm, sampling=sp)
    for k in (2, 3, 5):
        spec = generate(prompts, model=lm, sampling=sp, speculative=SpecConfig(
            method="mtp", num_speculative_tokens=k, adaptive=False, mtp=MtpConfig(model=str(out))))
        assert [o.token_ids for o in plain] == [o.token_ids for o in spec]
        assert all(o.stats.num_draft_tokens > 0 for o in spec)


def final_weights(out):
    return dict(np.load(out / "checkpoint" / "weights.npz"))


def csv_rows(out):
    return [line.rsplit(",", 1)[0] for line in (out / "loss.csv").read_text().splitlines()]  # without seconds


def test_hidden_noise_is_relative_to_each_row_and_seeded():
    rng = np.random.default_rng(3)
    hidden = (rng.standard_normal((64, 2048)).astype(np.float32)
              * np.geomspace(0.01, 100, 64, dtype=np.float32)[:, None])
    rms = np.sqrt((hidden.astype(np.float64) ** 2).mean(-1))
    noisy = noisy_hidden(hidden, 0.1, seed=0, step=7)
    assert noisy.dtype == np.float32 and noisy.shape == hidden.shape
    ratio = (noisy - hidden).std(-1) / rms  # per row: the noise's std over the row's RMS
    np.testing.assert_allclose(ratio, 0.1, rtol=0.06)
    assert np.array_equal(noisy, noisy_hidden(hidden, 0.1, seed=0, step=7))  # a resumed run draws the same
    assert not np.array_equal(noisy, noisy_hidden(hidden, 0.1, seed=0, step=8))
    assert not np.array_equal(noisy, noisy_hidden(hidden, 0.1, seed=1, step=7))


def test_training_is_reproducible_and_resumes_exactly(lm, data_dir, tmp_path):
    cfg = TrainConfig(**SMALL)
    a = fresh_run(data_dir, tmp_path, "a")
    Trainer(lm, a, cfg).run()
    b = fresh_run(data_dir, tmp_path, "b")
    Trainer(lm, b, cfg).run()
    wa, wb = final_weights(a), final_weights(b)
    assert all(np.array_equal(wa[k], wb[k]) for k in wa)

    c = fresh_run(data_dir, tmp_path, "c")

    def kill_at_6(step, total, row):
        if step == 6:  # after the checkpoint of step 4
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        Trainer(lm, c, cfg).run(kill_at_6)
    assert json.loads((c / "checkpoint" / "state.json").read_text())["step"] == 4
    Trainer(lm, c, cfg).run()
    wc = final_weights(c)
    assert all(np.array_equal(wa[k], wc[k]) for k in wa)
    assert csv_rows(a) == csv_rows(c)
    assert (a / "model.safetensors").read_bytes() == (c / "model.safetensors").read_bytes()

    d = fresh_run(data_dir, tmp_path, "d")
    Trainer(lm, d, TrainConfig(**{**SMALL, "seed": 1})).run()
    assert not np.array_equal(final_weights(d)["w_qkv"], wa["w_qkv"])


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_saved_head_reloads_bit_identically(lm, tmp_path, dtype):
    head = perturbed_head(lm, lm.model, seed=5)
    weights = export_weights(head, dtype)
    save_mtp(tmp_path, weights)
    loaded = load_mtp_weights(tmp_path)
    assert sorted(loaded) == sorted(weights)
    assert all(loaded[k].dtype == np.float32 and np.array_equal(loaded[k], weights[k].astype(np.float32))
               for k in weights)
    if dtype == "float32":  # and the engine's copy of every tensor is the trained parameter itself
        eh = MtpHeadWeights.read(loaded, "saved", lm.model)
        params = dict(head.named_parameters())
        assert np.array_equal(eh.eh_proj.weight.numpy(), params["eh_proj"].numpy())
        block = block_arrays(eh.block)
        assert block and all(np.array_equal(v, params[k].numpy()) for k, v in block.items())
        assert np.array_equal(eh.final_norm.numpy(), params["final_norm"].numpy())


def test_cli_train_then_run_with_the_head(tmp_path):
    from typer.testing import CliRunner

    from specgen.cli import app

    prompts = write_prompts(tmp_path / "p.jsonl", n=10)
    out = tmp_path / "head"
    args = ["train-mtp", "--model", str(TINY / "llama"), "--data", str(prompts), "-o", str(out),
            "--steps", "6", "--batch-size", "4", "--seq-len", "16", "--gen-max-tokens", "16",
            "--hidden-noise", "0.05", "--threads", "1", "--quiet"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    meta = json.loads((out / "config.json").read_text())
    assert meta["specgen_training"]["steps"] == 6 and meta["torch_dtype"] == "float16"
    assert meta["specgen_training"]["hidden_noise"] == 0.05
    assert CliRunner().invoke(app, args).exit_code == 0  # rerun: everything is there, nothing is redone
    src = [json.loads(x)["input_ids"] for x in prompts.read_text().splitlines()]
    sp = SamplingParams(max_tokens=12)
    tiny = load_model(TINY / "llama", threads=1)
    plain = generate(src, model=tiny, sampling=sp)
    spec = generate(src, model=tiny, sampling=sp,
                    speculative=SpecConfig(method="mtp", num_speculative_tokens=2,
                                           mtp=MtpConfig(model=str(out))))
    assert [o.token_ids for o in plain] == [o.token_ids for o in spec]

    help_text = " ".join(CliRunner().invoke(app, ["train-mtp", "--help"]).output.split())
    for option in ("--data", "--output", "--model", "--steps", "--batch-size", "--lr", "--seq-len",
                   "--threads", "--gen-max-tokens", "--shortlist", "--draft-vocab", "--chain-weight",
                   "--distill", "--hidden-noise", "--save-dtype"):
        assert option in help_text, option
    assert f"[default: {TrainConfig.steps}]" in help_text
    bad = CliRunner().invoke(app, ["train-mtp", "--data", str(tmp_path / "none.jsonl"), "-o", str(out)])
    assert bad.exit_code == 2 and "not found" in bad.output
    bad = CliRunner().invoke(app, args[:-1] + ["--steps", "0"])
    assert bad.exit_code == 2 and "steps must be >= 1" in bad.output
    bad = CliRunner().invoke(app, args + ["--seq-len", "32"])  # other settings than the checkpoint's
    assert bad.exit_code == 2 and "seq_len" in bad.output



def test_method_mtp_finds_the_shipped_head_for_the_default_model(lm, tmp_path, monkeypatch):
    """Without --mtp-model, the default model (its GGUF file name) gets the head shipped in the package; any
    other model, or a package without a head, gets the error naming --mtp-model."""
    from specgen.drafters import mtp as mtp_head
    from specgen.engine.proposers import mtp
    from specgen.errors import CheckpointError
    from specgen.models.default_model import DEFAULT_GGUF

    monkeypatch.setattr(mtp_head, "SHIPPED_HEAD", tmp_path / "head")
    source = lm.model.source
    spec = SpecConfig(method="mtp", num_speculative_tokens=2, adaptive=False)
    sp = SamplingParams(max_tokens=8, ignore_eos=True)
    plain = generate([[5, 6, 7]], model=lm, sampling=sp)[0].token_ids
    with monkeypatch.context() as as_default:
        as_default.setattr(lm.model, "source", f"/somewhere/{DEFAULT_GGUF}")
        with pytest.raises(CheckpointError, match="needs an MTP head"):
            generate([[5, 6, 7]], model=lm, speculative=spec)
        save_mtp(tmp_path / "head", export_weights(perturbed_head(lm, lm.model, seed=7), "float16"))
        assert mtp.shipped_head(lm.model.source) == tmp_path / "head" and mtp.shipped_head(source) is None
        out = generate([[5, 6, 7]], model=lm, sampling=sp, speculative=spec)[0]
        assert out.stats.num_draft_tokens > 0
        assert out.token_ids == plain
    with pytest.raises(CheckpointError, match="needs an MTP head"):
        generate([[5, 6, 7]], model=lm, speculative=spec)
