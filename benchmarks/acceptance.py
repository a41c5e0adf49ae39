"""Acceptance per draft position of learned drafters, every draft verified: MTP heads (chained or multi-layer,
or a multi-layer head's first N modules) and draft models (cut from the main model, or distilled), on the
Spec-Bench categories and MBPP rewriting (the evaluation slices, disjoint from the training prompts).

    python benchmarks/acceptance.py --mtp shipped runs/mtp1 runs/mtp3:2 runs/mtp3 --draft cut:2 runs/draft2 \
        --k 3

`--mtp DIR[:N]`: a head (N: only its first N modules; `shipped`: the package's head); `--mtp-copy 0`: the
head's own drafts only (no n-gram copies: "head alone"). `--draft DIR` or `cut:L` (the main model's first L
layers, untrained). Greedy, the default model, adaptive off (k drafts every step), batch --batch-size.
Acceptance at position i is accepted / verified there: every step verifies all k drafts, so it is the share of
steps whose drafts 1..i were all right; tok/step = emitted tokens per decoding step. Timings are not reported:
acceptance does not depend on the machine's load.
"""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
from common import load_sets, machine, print_table


def truncated_head(path: Path, n: int, work: Path) -> Path:
    """A copy of the head at `path` with its first n modules only."""
    from safetensors.numpy import save_file

    from specgen.drafters.mtp import load_mtp_weights

    weights = load_mtp_weights(path)
    layers = sorted({int(k.split(".")[2]) for k in weights if k.endswith("eh_proj.weight")})
    keep = {f"model.layers.{i}." for i in layers[:n]}
    out = work / f"{path.name}-{n}"
    out.mkdir(parents=True)
    save_file({k: v for k, v in weights.items() if k.startswith(tuple(keep))}, str(out / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": n}))
    if (path / "draft_vocab.npy").is_file():
        shutil.copy(path / "draft_vocab.npy", out / "draft_vocab.npy")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mtp", nargs="*", default=["shipped"])
    ap.add_argument("--draft", nargs="*", default=[])
    ap.add_argument("--sets", nargs="+", default=["summarization", "rag", "translation", "math_reasoning",
                                                  "qa", "writing", "code_rewrite"])
    ap.add_argument("--per-category", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--mtp-copy", type=int, default=None,
                    help="MtpConfig.copy (0: the head alone) [default: 2]")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    from specgen import EngineConfig, Method, MtpConfig, SamplingParams, SpecConfig, generate, load_model
    from specgen.drafters.mtp import SHIPPED_HEAD
    from specgen.models import load_checkpoint
    from specgen.models.export import first_layers, save_hf

    print(machine())
    lm = load_model(None)
    work = Path(tempfile.mkdtemp(prefix="specgen-acceptance-"))
    arms: dict[str, SpecConfig] = {}
    for spec in args.mtp:
        path, _, n = spec.partition(":")
        head = SHIPPED_HEAD if path == "shipped" else Path(path)
        if n:
            head = truncated_head(head, int(n), work)
        mtp = MtpConfig() if args.mtp_copy is None else MtpConfig(copy=args.mtp_copy)
        arms[f"mtp {spec}"] = SpecConfig(method=Method.MTP, draft_model=str(head),
                                         num_speculative_tokens=args.k, adaptive=False, mtp=mtp)
    for spec in args.draft:
        path = Path(spec)
        if spec.startswith("cut:"):
            path = work / spec.replace(":", "")
            save_hf(first_layers(load_checkpoint(None), int(spec[4:])), path)
        arms[f"draft {spec}"] = SpecConfig(method=Method.DRAFT_MODEL, draft_model=str(path),
                                           num_speculative_tokens=args.k, adaptive=False)
    sets = load_sets(args.per_category, args.per_category)
    sp = SamplingParams(max_tokens=args.max_tokens)
    engine = EngineConfig(batch_size=args.batch_size)
    out, rows = [], []
    for name in args.sets:
        prompts = [list(lm.tokenizer.encode_chat(m)) for m in sets[name]]
        for arm, spec in arms.items():
            outs = generate(prompts, model=lm, sampling=sp, engine=engine, speculative=spec)
            drafted = np.sum([o.stats.drafted_per_position or [0] * args.k for o in outs], axis=0)[:args.k]
            accepted = np.sum([o.stats.accepted_per_position or [0] * args.k for o in outs], axis=0)[:args.k]
            pos = [float(a / d) if d else None for a, d in zip(accepted, drafted)]
            tokens = sum(len(o.token_ids) for o in outs)
            per_step = (tokens - len(outs)) / max(1, sum(o.stats.num_steps for o in outs) - len(outs))
            out.append({"set": name, "arm": arm, "per_position": pos, "tok_per_step": per_step})
            rows.append([name, arm] + pos + [per_step])
        print_table(["set", "drafter"] + [f"pos {i + 1}" for i in range(args.k)] + ["tok/step"],
                    rows[-len(arms):])
        print(flush=True)
    mean = {arm: np.mean([[p or 0.0 for p in r["per_position"]] for r in out if r["arm"] == arm], axis=0)
            for arm in arms}
    print("mean over the sets")
    print_table(["drafter"] + [f"pos {i + 1}" for i in range(args.k)],
                [[a] + list(m) for a, m in mean.items()])
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
