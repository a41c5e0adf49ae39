"""`specgen train-head --kind eagle3`: the data keeps the main model's features after each hidden state, what
is trained (with the training-time test) is what the engine runs (the saved layer in EAGLE-3's layout gives
the training forward's first and chained drafts), the loss falls, and the trained layer drafts exactly."""

import json

import numpy as np
import paddle
import pytest
from conftest import TINY
from test_mtp_train import SMALL, write_prompts

from specgen import EngineConfig, SamplingParams, SpecConfig, generate, load_model
from specgen.config import EagleConfig
from specgen.drafters.eagle import load_eagle
from specgen.drafters.eagle3 import default_features
from specgen.runtime.batch import build_forward_batch
from specgen.train.config import TrainConfig
from specgen.train.data import generate_data, load_data, read_requests
from specgen.train.eagle3 import Eagle3Trainer
from specgen.train.trainer import _tensors
from specgen.train.windows import make_batch


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    lm = load_model(TINY / "llama", threads=1)
    d = tmp_path_factory.mktemp("eagle3")
    cfg = TrainConfig(**{**SMALL, "save_dtype": "float32", "shortlist": 0, "draft_vocab": 200})
    features = default_features(lm.config.num_layers)
    generate_data(lm, read_requests(write_prompts(d / "p.jsonl"), "jsonl", lm, cfg), d / "data", cfg,
                  features=features)
    (d / "out").mkdir()
    trainer = Eagle3Trainer(lm, d / "out", cfg, d / "data")
    trainer.run()
    return lm, trainer, d / "out", d / "data"


def test_data_rows_hold_the_hidden_state_and_the_features(trained):
    lm, _, _, data_dir = trained
    data = load_data(data_dir)
    m, h = lm.model, lm.config.hidden_size
    features = default_features(lm.config.num_layers)
    assert data.hidden.shape[1] == 4 * h
    assert json.loads((data_dir / "meta.json").read_text())["features"] == list(features)
    s = 0
    n = int(data.num_rows[s])
    toks = data.tokens[data.tok_start[s]: data.tok_start[s] + n]
    batch = build_forward_batch(np.array([0]), np.array([0]), np.array([n]), toks, np.array([True]))
    out = m.forward(batch, m.new_cache(1, 128), features=features)
    rows = np.asarray(data.hidden[data.row_start[s]: data.row_start[s] + n], np.float32)
    np.testing.assert_allclose(rows[:, :h], out.hidden.numpy(), atol=2e-3, rtol=2e-3)  # float16 rows
    np.testing.assert_allclose(rows[:, h:], out.features.numpy(), atol=2e-3, rtol=2e-3)


def test_training_lowers_the_loss_and_saves_the_layout(trained):
    lm, trainer, out, _ = trained
    losses = [r["loss"] for r in trainer.rows if r.get("loss") is not None]
    assert losses[-1] < losses[0]
    w = load_eagle(out, lm.model)
    assert w.features == default_features(lm.config.num_layers)
    assert np.array_equal(w.draft_vocab, trainer.set.draft_ids) and len(w.draft_vocab) <= 200
    assert json.loads((out / "config.json").read_text())["specgen_training"]["ttt_steps"] == 3


def test_engine_pass_equals_the_training_forward(trained):
    """A window's first drafts (the layer on the cached features) and chained drafts (on its own output
    features) as the engine's pass computes them from the saved layer: the same log-probabilities over the
    draft vocabulary."""
    lm, trainer, out, _ = trained
    s = trainer.set
    b = make_batch(s.data, s.held_out, np.arange(1), trainer.cfg.seq_len, trainer.identity, modules=2)
    hidden, next_ids, positions = _tensors(b)
    x1, kv = trainer.head(hidden, next_ids, positions)
    n = int((b.next_ids[0] > 0).sum())
    rows = paddle.to_tensor(np.arange(n))
    w = load_eagle(out, lm.model)
    lm_draft = paddle.gather(trainer.lm_full, paddle.to_tensor(w.draft_vocab), axis=1)
    train1 = paddle.nn.functional.log_softmax(trainer.head.logits(x1, rows, lm_draft), axis=-1).numpy()
    x2 = trainer.head.unroll(x1, kv, [paddle.to_tensor(b.after_ids)], positions)[0]
    train2 = paddle.nn.functional.log_softmax(trainer.head.logits(x2, rows, lm_draft), axis=-1).numpy()
    runner = lm.model.backend.prepare_drafter(lm.model, w, True)
    cache = runner.new_cache(1)
    pos0 = int(b.positions[0, 0])
    h = lm.config.hidden_size
    feats = hidden.reshape([-1, hidden.shape[-1]])[:, h:]  # the features after the hidden state
    feat, vals, ids = runner.run(cache, np.zeros(1, np.int64), np.array([pos0]), np.array([n]),
                                 b.next_ids[0, :n], feats, np.arange(n), np.arange(n), 5)
    cols = np.searchsorted(w.draft_vocab, ids) if np.all(np.diff(w.draft_vocab) > 0) else \
        np.array([[list(w.draft_vocab).index(t) for t in row] for row in ids])
    np.testing.assert_allclose(vals, np.take_along_axis(train1, cols, axis=1), atol=2e-4)
    j = n - 3  # a chained draft from position j: its token j + 2 on the feature at j, at position j + 1
    _, vals2, ids2 = runner.run(cache, np.zeros(1, np.int64), np.array([pos0 + n]), np.ones(1, np.int64),
                                b.after_ids[0, j:j + 1], feat, np.array([j]), np.zeros(1, np.int64), 5,
                                np.array([pos0 + j + 1]), np.array([-1 ^ ((1 << (n - j)) - 2)]))
    cols2 = [list(w.draft_vocab).index(t) for t in ids2[0]]
    np.testing.assert_allclose(vals2[0], train2[j][cols2], atol=2e-4)


def test_trained_layer_drafts_exactly(trained):
    lm, _, out, _ = trained
    prompts = [[5, 9, 13, 5, 9, 13, 5, 9], [40, 41, 42, 43]]
    sp = SamplingParams(max_tokens=12)
    plain = generate(prompts, model=lm, sampling=sp, engine=EngineConfig(batch_size=2))
    spec = SpecConfig(method="eagle3", draft_model=str(out), adaptive=False,
                      eagle=EagleConfig(topk=2, nodes=6))
    got = generate(prompts, model=lm, sampling=sp, engine=EngineConfig(batch_size=2), speculative=spec)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain]
    assert sum(o.stats.num_draft_tokens for o in got) > 0
