"""`specgen train-head --kind K`: one command over train-mtp's data and loop; `train-mtp` is `--kind mtp`."""
import json

from conftest import TINY
from test_mtp_train import write_prompts
from typer.testing import CliRunner

from specgen.cli import app
from specgen.train.kinds import KINDS

ARGS = ["--model", str(TINY / "llama"), "--steps", "4", "--batch-size", "4", "--seq-len", "16",
        "--gen-max-tokens", "12", "--eval-every", "2", "--threads", "1"]


def test_train_mtp_is_train_head_kind_mtp(tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", n=8)
    a = CliRunner().invoke(app, ["train-mtp", "--data", str(prompts), "-o", str(tmp_path / "a"), *ARGS, "-q"])
    assert a.exit_code == 0, a.output
    b = CliRunner().invoke(app, ["train-head", "--kind", "mtp", "--data", str(prompts),
                                 "-o", str(tmp_path / "b"),
                                 "--data-dir", str(tmp_path / "a" / "data"), *ARGS])
    assert b.exit_code == 0, b.output
    assert "held-out acceptance per draft position" in b.output and "--method mtp" in b.output
    assert not (tmp_path / "b" / "data").exists()  # the shared cache was used, nothing generated again
    assert ((tmp_path / "a" / "model.safetensors").read_bytes()
            == (tmp_path / "b" / "model.safetensors").read_bytes())
    ta, tb = (json.loads((tmp_path / n / "config.json").read_text())["specgen_training"] for n in "ab")
    assert ta["eval_acc"] == tb["eval_acc"]


def test_unknown_kind_lists_the_kinds(tmp_path):
    prompts = write_prompts(tmp_path / "p.jsonl", n=2)
    r = CliRunner().invoke(app, ["train-head", "--kind", "nope", "--data", str(prompts),
                                 "-o", str(tmp_path / "o")])
    assert r.exit_code == 2 and "unknown head kind 'nope'" in r.output
    assert all(k in r.output for k in KINDS)
    help_text = " ".join(CliRunner().invoke(app, ["train-mtp", "--help"]).output.split())
    assert "--kind <" not in help_text and "--heads" not in help_text and "--data-dir" in help_text
