"""Whole generation jobs, this checkout against another (e.g. a git worktree of an earlier commit). Two builds
of the kernels cannot share a process, so each job runs in a fresh process of each checkout in turn,
--repeats times:

    git worktree add /tmp/old <commit>
    python benchmarks/checkout_ab.py --compare /tmp/old --batch-sizes 1 32 256 --methods none ngram --repeats 3

A job: the first --prompts prompts of --set (spec_bench.load_sets: a Spec-Bench category or MBPP's code
rewriting; with --ignore-eos every request makes exactly --max-tokens tokens, as in plain.py), greedy, at one
batch size and method (ngram: k = 5, the defaults otherwise). Each process loads the default model and runs a
short warm-up job at that batch size and method, so the kernel build and the job's start-up calibration are
not timed; then it runs the job. tok/s is generated tokens over generate()'s wall time. Printed per job: each
checkout's median tok/s, the median of the per-repeat ratios (this / other), the runs, and whether the two
checkouts' outputs were token-identical. Processes on a shared machine differ by 10-20%, so prefer in-process
comparisons (linear_ab.py, paired.py) where they exist.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def child(args) -> None:
    """One job in this process, `specgen` from PYTHONPATH (the checkout under test); prints a JSON line."""
    from specgen import EngineConfig, SamplingParams, SpecConfig, generate, load_model

    prompts = json.loads(Path(args.child).read_text())
    model = load_model(None, threads=args.threads)
    spec = SpecConfig(method=args.method, num_speculative_tokens=5) if args.method != "none" else SpecConfig()
    sp = SamplingParams(max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    engine = EngineConfig(batch_size=args.batch_size)
    generate(prompts[:2], model=model, sampling=SamplingParams(max_tokens=4), engine=engine, speculative=spec)
    start = time.perf_counter()
    outs = generate(prompts, model=model, sampling=sp, engine=engine, speculative=spec)
    wall = time.perf_counter() - start
    tokens = [o.token_ids for o in outs]
    digest = hashlib.sha256(json.dumps(tokens).encode()).hexdigest()
    print("RESULT " + json.dumps({"tok_s": sum(map(len, tokens)) / wall, "digest": digest}), flush=True)


def run_child(tree: Path, prompts_file: str, args, bs: int, method: str) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", prompts_file, "--batch-size", str(bs),
           "--method", method, "--max-tokens", str(args.max_tokens), "--threads", str(args.threads)]
    if args.ignore_eos:
        cmd.append("--ignore-eos")
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": str(args.threads)}
    out = subprocess.run(cmd, env=env, cwd=str(tree), capture_output=True, text=True)
    lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    if out.returncode or not lines:
        raise SystemExit(f"{tree}: the job failed:\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compare", type=Path, help="the other checkout")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--methods", nargs="+", default=["none", "ngram"], choices=["none", "ngram"])
    ap.add_argument("--set", default="code_rewrite")
    ap.add_argument("--prompts", type=int, default=32, help="prompts per job (at least the batch size)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--batch-size", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--method", default="none", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    if args.compare is None or not (args.compare / "specgen").is_dir():
        raise SystemExit("--compare: give another checkout of specgen (git worktree add DIR COMMIT)")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from spec_bench import load_sets

    sets = load_sets(max(args.prompts, max(args.batch_sizes)), max(args.prompts, max(args.batch_sizes)))
    if args.set not in sets:
        raise SystemExit(f"--set: one of {', '.join(sets)}")
    trees = {"this": ROOT, "other": args.compare.resolve()}
    print(f"{'set':<15}{'bs':>5} {'method':<7}{'this tok/s':>11}{'other tok/s':>12}{'this/other':>11}  runs"
          f"{'':<22}same tokens", flush=True)
    with tempfile.TemporaryDirectory() as d:
        for bs in args.batch_sizes:
            n = max(args.prompts, bs)
            prompts_file = str(Path(d) / f"prompts{n}.json")
            Path(prompts_file).write_text(json.dumps(sets[args.set][:n]))
            for method in args.methods:
                runs: dict[str, list[dict]] = {"this": [], "other": []}
                for rep in range(args.repeats):  # alternated, each repeat in the other order
                    for name in (("this", "other") if rep % 2 == 0 else ("other", "this")):
                        runs[name].append(run_child(trees[name], prompts_file, args, bs, method))
                ratios = [a["tok_s"] / b["tok_s"] for a, b in zip(runs["this"], runs["other"])]
                med = {k: float(np.median([r["tok_s"] for r in v])) for k, v in runs.items()}
                same = len({r["digest"] for v in runs.values() for r in v}) == 1
                shown = ", ".join(f"{x:.2f}" for x in ratios)
                print(f"{args.set:<15}{bs:>5} {method:<7}{med['this']:>11.1f}{med['other']:>12.1f}"
                      f"{np.median(ratios):>10.2f}x  ({shown}){'':<4}{'yes' if same else 'NO'}", flush=True)


if __name__ == "__main__":
    main()
