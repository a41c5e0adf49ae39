"""A whole `specgen run` job with an environment switch off and on, alternated, in fresh processes:

    python benchmarks/env_job_ab.py [--switch SPECGEN_WIDE_LINEAR] [--prompts 40] [--every 12] [--max-tokens 64]
                                    [--methods none ngram] [--repeats 2] [--batch-size 32]

The prompts: every --every-th Spec-Bench question (first turn), all categories mixed, --max-tokens each, in
--batch-size slots (the default batch of 32). Each repeat runs every method with the switch at 0 and at 1 (unset);
the table gives each run's wall time (the job's own summary) and whether its outputs equal the first run's token
for token.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--switch", default="SPECGEN_WIDE_LINEAR")
    ap.add_argument("--prompts", type=int, default=40)
    ap.add_argument("--every", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--methods", nargs="+", default=["none", "ngram"])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=32)
    args = ap.parse_args()
    import pyarrow.parquet as pq
    from spec_bench import DATA

    tmp = Path(tempfile.mkdtemp(prefix="env_job_ab."))
    questions = [json.loads(line) for line in (DATA / "spec_bench" / "question.jsonl").read_text().splitlines()][:: args.every][: args.prompts]
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{q['question_id']}", "prompt": q["turns"][0],
                                           "max_tokens": args.max_tokens}) + "\n" for q in questions))
    first = None
    print(f"{len(questions)} prompts, batch {args.batch_size}; {args.switch} = 0 / 1; wall s from each job's summary")
    print(f"{'repeat':>7}{'method':>8}{'switch':>8}{'wall s':>9}{'same tokens':>13}")
    walls: dict[tuple[str, str], list[float]] = {}
    for rep in range(args.repeats):
        for method in args.methods:
            for value in ("0", "1"):
                out, summary = tmp / f"out_{rep}_{method}_{value}.parquet", tmp / f"sum_{rep}_{method}_{value}.json"
                env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
                if value == "0":
                    env[args.switch] = "0"
                else:
                    env.pop(args.switch, None)
                subprocess.run([sys.executable, "-m", "specgen", "run", "--method", method, str(prompts), "-o", str(out),
                                "--summary-json", str(summary), "--batch-size", str(args.batch_size)], env=env, check=True, capture_output=True)
                wall = json.loads(summary.read_text())["wall_time_s"]
                table = pq.read_table(out).to_pydict()
                tokens = dict(zip(table["id"], table["token_ids"]))
                first = first or tokens
                walls.setdefault((method, value), []).append(wall)
                print(f"{rep + 1:>7}{method:>8}{value:>8}{wall:>9.2f}{tokens == first!s:>13}", flush=True)
    for method in args.methods:
        off, on = statistics.median(walls[(method, "0")]), statistics.median(walls[(method, "1")])
        print(f"{method}: median wall {off:.2f} s off, {on:.2f} s on: {off / on:.2f}x")


if __name__ == "__main__":
    main()
