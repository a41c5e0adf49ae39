"""The MTP head's learning curve against training text (issue 44): heads trained on the first N sequences of
one self-distillation data directory, the steps in proportion to N (the same passes over the text), then their
first-draft acceptance alone on Spec-Bench's categories and MBPP rewriting (benchmarks/acceptance.py).

    python benchmarks/mtp_curve.py --data PROMPTS.jsonl --data-dir DATA --sizes 250 500 1000 2000 \
        --out runs/curve

DATA is a `specgen train-head` data directory made from PROMPTS (the model's own continuations and hidden
states, e.g. of `scripts/make_distill_prompts.py --t0 3200 --gsm8k 800`); its first N sequences are copied
into OUT/dataN with the prompts of exactly those ids, so that no sequence is generated again. Each head trains
--steps-per-sequence x N steps of 8 windows (0.3: ~1.1 passes over the text) with the recipe of the shipped
head's retraining (`--shortlist 4096 --warmup-steps 20`); its held-out acceptance (the data's own
distribution) is printed beside the Spec-Bench figures. Heads already in OUT/mtpN-STEPS are reused.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path


def subset(data: Path, prompts: Path, n: int, out: Path) -> tuple[Path, Path]:
    """OUT/dataN (the first n sequences and their rows) and OUT/promptsN.jsonl (their prompts)."""
    lines = (data / "sequences.jsonl").read_text().splitlines()[:n]
    if len(lines) < n:
        sys.exit(f"{data} holds {len(lines)} sequences, fewer than {n}")
    records = [json.loads(x) for x in lines]
    meta = json.loads((data / "meta.json").read_text())
    rows = records[-1]["row_start"] + len(records[-1]["tokens"]) - 1
    d = out / f"data{n}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "sequences.jsonl").write_text("\n".join(lines) + "\n")
    shutil.copy(data / "meta.json", d / "meta.json")
    with open(data / "hidden.f16", "rb") as f, open(d / "hidden.f16", "wb") as g:
        g.write(f.read(rows * meta["hidden_size"] * 2))
    ids = {r["id"] for r in records}
    chosen = [x for x in prompts.read_text().splitlines() if x.strip() and json.loads(x)["id"] in ids]
    p = out / f"prompts{n}.jsonl"
    p.write_text("\n".join(chosen) + "\n")
    return d, p


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, required=True, help="the prompts DATA was generated from")
    ap.add_argument("--data-dir", type=Path, required=True)
    ap.add_argument("--sizes", type=int, nargs="+", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps-per-sequence", type=float, default=0.3)
    ap.add_argument("--per-category", type=int, default=8)
    args = ap.parse_args()
    meta = json.loads((args.data_dir / "meta.json").read_text())
    heads = []
    for n in args.sizes:
        steps = max(1, round(args.steps_per_sequence * n))
        head = args.out / f"mtp{n}-{steps}"
        if not (head / "model.safetensors").is_file():
            d, p = subset(args.data_dir, args.data, n, args.out)
            subprocess.run([sys.executable, "-m", "specgen", "train-head", "--kind", "mtp", "--data", str(p),
                            "--data-dir", str(d), "-o", str(head),
                            "--gen-max-tokens", str(meta["gen_max_tokens"]),
                            "--gen-temperature", str(meta["gen_temperature"]), "--steps", str(steps),
                            "--batch-size", "8", "--shortlist", "4096", "--warmup-steps", "20",
                            "--eval-every", "100000", "--quiet"],
                           check=True)
            shutil.rmtree(d)
        t = json.loads((head / "config.json").read_text())["specgen_training"]
        print(f"{n} sequences ({t['num_generated_tokens']} generated tokens), {t['steps']} steps: held-out "
              f"acceptance {t['eval_acc']:.3f} / {t['eval_acc2']:.3f} (positions 1 / 2)", flush=True)
        heads.append(str(head))
    subprocess.run([sys.executable, str(Path(__file__).with_name("acceptance.py")), "--mtp", "shipped",
                    *heads, "--mtp-copy", "0", "--k", "1", "--per-category", str(args.per_category),
                    "--max-tokens", "96", "--batch-size", "8"], check=True)


if __name__ == "__main__":
    main()
