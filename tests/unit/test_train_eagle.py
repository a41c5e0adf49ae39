"""`specgen train-head --kind eagle`: what is trained is what the engine runs (the saved layer, loaded in
EAGLE's layout, gives the training forward's first and chained drafts), the loss falls, and the trained layer
drafts exactly."""

import numpy as np
import paddle
import pytest
from conftest import TINY
from test_mtp_train import SMALL, write_prompts

from specgen import EngineConfig, SamplingParams, SpecConfig, generate, load_model
from specgen.config import EagleConfig
from specgen.drafters.eagle import load_eagle
from specgen.drafters.eagle_pass import EaglePass
from specgen.train.config import TrainConfig
from specgen.train.data import generate_data, read_requests
from specgen.train.eagle import EagleTrainer
from specgen.train.trainer import _tensors
from specgen.train.windows import make_batch


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    lm = load_model(TINY / "llama", threads=1)
    d = tmp_path_factory.mktemp("eagle")
    cfg = TrainConfig(**{**SMALL, "save_dtype": "float32", "shortlist": 0})
    generate_data(lm, read_requests(write_prompts(d / "p.jsonl"), "jsonl", lm, cfg), d / "data", cfg)
    (d / "out").mkdir()
    trainer = EagleTrainer(lm, d / "out", cfg, d / "data")
    trainer.run()
    return lm, trainer, d / "out"


def test_training_lowers_the_loss_and_saves_the_layout(trained):
    lm, trainer, out = trained
    losses = [r["loss"] for r in trainer.rows if r.get("loss") is not None]
    assert losses[-1] < losses[0]
    w = load_eagle(out, lm.model)
    assert w.block.attn_norm is not None and w.norm is not None and w.fc.bias is not None
    assert (out / "loss.csv").is_file() and (out / "draft_vocab.npy").is_file()


def test_engine_pass_equals_the_training_forward(trained):
    """A window's first drafts (the layer on the cached hidden states) and chained drafts (on its own
    features) as the engine's pass computes them from the saved layer: the same log-probabilities."""
    lm, trainer, out = trained
    s = trainer.set
    b = make_batch(s.data, s.held_out, np.arange(1), trainer.cfg.seq_len, trainer.identity, modules=2)
    hidden, next_ids, positions = _tensors(b)
    x1, kv = trainer.head(hidden, next_ids, positions)
    n = int((b.next_ids[0] > 0).sum())  # the window's positions (padding has token 0)
    rows = paddle.to_tensor(np.arange(n))
    train1 = paddle.nn.functional.log_softmax(trainer.head.logits(x1, rows, trainer.lm_full), axis=-1).numpy()
    x2 = trainer.head.chain(x1, kv, paddle.to_tensor(b.after_ids), positions)
    train2 = paddle.nn.functional.log_softmax(trainer.head.logits(x2, rows, trainer.lm_full), axis=-1).numpy()
    w = load_eagle(out, lm.model)
    w.draft_vocab = None  # the full vocabulary, as the training forward's
    runner = EaglePass(lm.model, w)
    cache = runner.new_cache(1)
    pos0 = int(b.positions[0, 0])
    feat, vals, ids = runner.run(cache, np.zeros(1, np.int64), np.array([pos0]), np.array([n]),
                                 b.next_ids[0, :n], hidden.reshape([-1, hidden.shape[-1]]), np.arange(n),
                                 np.arange(n), 5)
    np.testing.assert_allclose(vals, np.take_along_axis(train1, ids, axis=1), atol=2e-4)
    j = n - 3  # a chained draft from position j: its token j + 2 on the feature at j, at position j + 1
    _, vals2, ids2 = runner.run(cache, np.zeros(1, np.int64), np.array([pos0 + n]), np.ones(1, np.int64),
                                b.after_ids[0, j:j + 1], feat, np.array([j]), np.zeros(1, np.int64), 5,
                                np.array([pos0 + j + 1]), np.array([-1 ^ ((1 << (n - j)) - 2)]))
    np.testing.assert_allclose(vals2[0], train2[j][ids2[0]], atol=2e-4)


def test_trained_layer_drafts_exactly(trained):
    lm, _, out = trained
    prompts = [[5, 9, 13, 5, 9, 13, 5, 9], [40, 41, 42, 43]]
    sp = SamplingParams(max_tokens=12)
    plain = generate(prompts, model=lm, sampling=sp, engine=EngineConfig(batch_size=2))
    spec = SpecConfig(method="eagle", draft_model=str(out), adaptive=False,
                      eagle=EagleConfig(topk=2, nodes=6))
    got = generate(prompts, model=lm, sampling=sp, engine=EngineConfig(batch_size=2), speculative=spec)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain]
    assert sum(o.stats.num_draft_tokens for o in got) > 0
