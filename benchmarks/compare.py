"""This checkout against another (before / after a change): whole jobs, each in a fresh process of each
checkout in turn, --repeats times, so that both are timed under the same load.

    git worktree add /tmp/before <commit>
    python benchmarks/compare.py --other /tmp/before --jobs none:1 none:32 ngram:1 --set code_rewrite

A job is method:batch_size over the first --prompts prompts of --set (common.load_sets), greedy. Each process
loads the default model and runs a short warm-up job at that batch size and method first (kernel builds and
the job's start-up are not timed), then the job. Only the public API is used (load_model, generate,
EngineConfig, SpecConfig(method, num_speculative_tokens), SamplingParams), so any checkout of specgen can be
compared. Printed per job: each checkout's median tok/s, the median of the per-repeat ratios (this / other),
and whether all runs gave the same tokens.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from common import load_sets, machine, print_table, timed

ROOT = Path(__file__).resolve().parents[1]


def child(args) -> None:
    """One job in this process, `specgen` from PYTHONPATH (the checkout under test); prints a RESULT line."""
    import specgen
    from specgen import EngineConfig, SamplingParams, SpecConfig, generate, load_model

    prompts = json.loads(Path(args.child).read_text())
    model = load_model(None, threads=args.threads)
    method, bs = args.job.split(":")
    spec = SpecConfig(method=method, num_speculative_tokens=args.k) if method != "none" else SpecConfig()
    engine = EngineConfig(batch_size=int(bs))
    generate(prompts[:2], model=model, sampling=SamplingParams(max_tokens=4), engine=engine, speculative=spec)
    outs, wall = timed(lambda: generate(prompts, model=model,
                                        sampling=SamplingParams(max_tokens=args.max_tokens),
                                        engine=engine, speculative=spec))
    tokens = [o.token_ids for o in outs]
    digest = hashlib.sha256(json.dumps(tokens).encode()).hexdigest()
    print("RESULT " + json.dumps({"tok_s": sum(map(len, tokens)) / wall, "digest": digest,
                                  "specgen": str(Path(specgen.__file__).parent)}), flush=True)


def run_child(tree: Path, prompts_file: str, job: str, args) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", prompts_file, "--job", job,
           "--k", str(args.k), "--max-tokens", str(args.max_tokens), "--threads", str(args.threads)]
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": str(args.threads)}
    out = subprocess.run(cmd, env=env, cwd=str(tree), capture_output=True, text=True, check=False)
    lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    if out.returncode or not lines:
        raise SystemExit(f"{tree}: the job failed:\n{out.stderr[-3000:]}")
    result = json.loads(lines[-1][len("RESULT "):])
    if Path(result["specgen"]).resolve() != (tree / "specgen").resolve():
        raise SystemExit(f"{tree}: the child imported specgen from {result['specgen']}")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--other", type=Path, help="the other checkout")
    ap.add_argument("--jobs", nargs="+", default=["none:1", "none:32", "ngram:1"], help="method:batch_size")
    ap.add_argument("--set", default="code_rewrite")
    ap.add_argument("--prompts", type=int, default=32, help="prompts per job (at least the batch size)")
    ap.add_argument("--k", type=int, default=5, help="num_speculative_tokens of speculative jobs")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--job", default="none:1", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    if args.other is None or not (args.other / "specgen").is_dir():
        raise SystemExit("--other: give another checkout of specgen (git worktree add DIR COMMIT)")
    print(machine())
    n = max([args.prompts] + [int(j.split(":")[1]) for j in args.jobs])
    sets = load_sets(n, n)
    trees = {"this": ROOT, "other": args.other.resolve()}
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for job in args.jobs:
            bs = int(job.split(":")[1])
            prompts_file = str(Path(d) / "prompts.json")
            Path(prompts_file).write_text(json.dumps(sets[args.set][:max(args.prompts, bs)]))
            runs: dict[str, list[dict]] = {"this": [], "other": []}
            for rep in range(args.repeats):  # alternated, each repeat in the other order
                for name in (("this", "other") if rep % 2 == 0 else ("other", "this")):
                    runs[name].append(run_child(trees[name], prompts_file, job, args))
            ratios = [a["tok_s"] / b["tok_s"] for a, b in zip(runs["this"], runs["other"])]
            med = {k: float(np.median([r["tok_s"] for r in v])) for k, v in runs.items()}
            same = len({r["digest"] for v in runs.values() for r in v}) == 1
            rows.append([args.set, job, med["this"], med["other"], float(np.median(ratios)),
                         " ".join(f"{x:.2f}" for x in ratios), "yes" if same else "NO"])
            print_table(["set", "job", "this tok/s", "other tok/s", "this/other", "per repeat",
                         "same tokens"], rows)
            print(flush=True)


if __name__ == "__main__":
    main()
