"""What a `specgen` command spends before it generates: importing Paddle, loading the fused kernels, loading the
default model, and the whole example job end to end, each in a fresh process. With --compare, another checkout
(e.g. `git worktree add /tmp/old <commit>`) is timed the same way, alternated with this one, side by side.

    python benchmarks/startup.py [--compare /tmp/old] [--repeats 2]

Prints seconds per phase (best of --repeats) and, with --compare, the ratio other / this.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = """
import json, sys, time
t0 = time.perf_counter()
import paddle
t1 = time.perf_counter()
from specgen import kernels, load_model
kernels.ops()
t2 = time.perf_counter()
load_model(None, threads=2)
t3 = time.perf_counter()
import specgen
assert specgen.__file__.startswith(sys.argv[1]), specgen.__file__  # the checkout asked for
print(json.dumps({"import paddle": t1 - t0, "kernels": t2 - t1, "load_model": t3 - t2}))
"""


def run(tree: Path) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
    with tempfile.TemporaryDirectory() as d:  # run elsewhere than a checkout: its specgen/ would be imported
        out = subprocess.run([sys.executable, "-c", PHASES, str(tree)], env=env, cwd=d, capture_output=True,
                             text=True, check=True)
        times = json.loads(out.stdout.strip().splitlines()[-1])
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "specgen", "run", str(ROOT / "examples" / "prompts.jsonl"), "-o",
                        str(Path(d) / "out.jsonl")], env=env, cwd=d, capture_output=True, check=True)
        times["example job, whole command"] = time.perf_counter() - start
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compare", type=Path, default=None, help="another checkout to time alternately")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    trees = {"this": ROOT} | ({"other": args.compare.resolve()} if args.compare else {})
    for tree in trees.values():  # a first run builds what a fresh checkout builds (kernels, the model cache)
        run(tree)
    best: dict[str, dict[str, float]] = {name: {} for name in trees}
    for _ in range(args.repeats):
        for name, tree in trees.items():
            for phase, s in run(tree).items():
                best[name][phase] = min(best[name].get(phase, s), s)
    print(f"{'phase':<28}" + "".join(f"{name + ' s':>10}" for name in trees) + ("   other/this" if args.compare else ""))
    for phase in best["this"]:
        row = "".join(f"{best[name][phase]:>10.2f}" for name in trees)
        ratio = f"{best['other'][phase] / best['this'][phase]:>12.2f}x" if args.compare else ""
        print(f"{phase:<28}{row}{ratio}")


if __name__ == "__main__":
    main()
