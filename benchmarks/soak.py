"""Soak: does `specgen run` hold its memory flat from 10k to 1M records, and does a killed run resume exactly?

    python benchmarks/soak.py --records 1000000 --sizes 10000 100000 1000000 --kills 3

Writes --records short records as JSONL into a temporary folder: ids per --ids ("req-N" by default), prompts
alternately 3 to 8 random token ids and a few words of text. Then, on the tiny test model (--max-tokens 4,
--batch-size 256, --ignore-eos, --quiet):
1. RSS: one fresh `python -m specgen run` per size in --sizes, on the first that many records (the records
   count is always one of them); the peak RSS of each process is its ru_maxrss (os.wait4). Flat peaks mean
   the job holds nothing per record.
2. Kill and resume: the whole input again, SIGKILLed --kills times at random moments, resumed with --resume
   each time and then run to the end; every id must be in the output exactly once, each with --max-tokens
   tokens. A kill comes when the output has reached a record count drawn uniformly from the first 90% of what
   is left (the output is looked at every POLL_S, so the kill lands anywhere in the stream of writes).
Exits 1 when the check fails.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from common import machine, print_table

ROOT = Path(__file__).resolve().parents[1]
TINY_LLAMA = ROOT / "tests" / "fixtures" / "tiny" / "llama"
WORDS = ["lorem", "ipsum", "dolor", "sit", "amet", "soak", "test", "batch", "token", "resume"]
POLL_S = 0.01  # how often the kill pass looks at the output
ID_KINDS = ("named", "number", "random")  # "req-N"; "N" (as the default ids); 16 random hex digits


@dataclass(frozen=True)
class Attempt:
    """One `specgen run` process."""

    records_before: int  # complete lines in the output when it started
    records_after: int
    torn_bytes: int  # bytes after the last newline when it ended (a line cut by the kill)
    wall_s: float
    peak_rss: int  # bytes
    killed_at: float | None  # seconds after its start; None: it ran to the end


def record_id(kind: str, i: int, rnd: random.Random) -> str:
    if kind == "named":
        return f"req-{i}"
    if kind == "number":
        return str(i)
    return f"{rnd.getrandbits(64):016x}"


def write_inputs(folder: Path, num_records: int, sizes: list[int], ids: str, seed: int) -> tuple[dict, list]:
    """{size: the file of its first records}, and every id in input order."""
    rnd = random.Random(seed)
    paths = {n: folder / f"in-{n}.jsonl" for n in sizes}
    files = {n: open(p, "w") for n, p in paths.items()}  # noqa: SIM115 (all open at once, closed below)
    all_ids = []
    try:
        for i in range(1, num_records + 1):
            rid = record_id(ids, i, rnd)
            all_ids.append(rid)
            if i % 2:
                record = {"id": rid, "input_ids": [rnd.randrange(3, 256) for _ in range(rnd.randint(3, 8))]}
            else:
                record = {"id": rid, "prompt": f"{rnd.choice(WORDS)} {rnd.choice(WORDS)} {i}"}
            line = json.dumps(record) + "\n"
            for n, f in files.items():
                if i <= n:
                    f.write(line)
    finally:
        for f in files.values():
            f.close()
    return paths, all_ids


def lines_and_tail(path: Path) -> tuple[int, int]:
    """(complete lines, bytes after the last newline) of a file; (0, 0) when it does not exist."""
    if not path.exists():
        return 0, 0
    lines, size, last_newline = 0, 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            lines += chunk.count(b"\n")
            if b"\n" in chunk:
                last_newline = size + chunk.rindex(b"\n") + 1
            size += len(chunk)
    return lines, size - last_newline


class LineCounter:
    """Complete lines of a file being appended to, counted from `offset` (just after a newline) on."""

    def __init__(self, path: Path, lines: int, offset: int):
        self.path, self.lines, self.offset = path, lines, offset

    def count(self) -> int:
        if self.path.exists():
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
            if b"\n" in chunk:
                end = chunk.rindex(b"\n") + 1
                self.lines += chunk.count(b"\n")
                self.offset += end
        return self.lines


def run_specgen(argv: list[str], log: Path, kill_when: Callable[[], bool] | None = None,
                ) -> tuple[int, float, int, float | None]:
    """(exit code, wall seconds, peak RSS in bytes, seconds to the kill or None) of one specgen process;
    `kill_when` is asked every POLL_S and SIGKILLs the process when it says so."""
    lock, ended, killed = threading.Lock(), threading.Event(), []
    with open(log, "ab") as err:
        start = time.perf_counter()
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err)

        def watch() -> None:
            while not ended.wait(POLL_S):
                if kill_when():
                    with lock:  # never after the exit: until wait4 reaps it below, the pid is this child's
                        if not ended.is_set():
                            killed.append(time.perf_counter() - start)
                            os.kill(proc.pid, signal.SIGKILL)
                    return

        watcher = threading.Thread(target=watch, daemon=True) if kill_when is not None else None
        if watcher is not None:
            watcher.start()
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped yet
        wall = time.perf_counter() - start
        with lock:
            ended.set()
        if watcher is not None:
            watcher.join()
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage, not the max over all children
        proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, wall, usage.ru_maxrss * 1024, killed[0] if killed else None


def specgen_argv(args: argparse.Namespace, inp: Path, out: Path, resume: bool) -> list[str]:
    argv = [sys.executable, "-m", "specgen", "run", str(inp), "-o", str(out), "--model", str(args.model),
            "--max-tokens", str(args.max_tokens), "--batch-size", str(args.batch_size),
            "--ignore-eos", "--quiet"]
    return argv + (["--resume"] if resume else [])


def check_exit(code: int, log: Path) -> None:
    if code != 0:
        tail = log.read_text(errors="replace")[-2000:]
        raise SystemExit(f"specgen run exited {code}:\n{tail}")


def rss_pass(args: argparse.Namespace, paths: dict[int, Path], folder: Path) -> list[tuple[int, float, int]]:
    """(records, wall seconds, peak RSS) per size, each a fresh process on a fresh output."""
    results = []
    for n, inp in sorted(paths.items()):
        out = folder / f"rss-{n}.jsonl"
        code, wall, peak, _ = run_specgen(specgen_argv(args, inp, out, resume=False), folder / "rss.log")
        check_exit(code, folder / "rss.log")
        lines, _ = lines_and_tail(out)
        if lines != n:
            raise SystemExit(f"{out}: {lines} records written, expected {n}")
        out.unlink()
        results.append((n, wall, peak))
        print(f"  {n} records: {wall:.1f} s, peak RSS {peak / 2**20:.1f} MiB", flush=True)
    return results


def reached(counter: LineCounter, target: int) -> bool:
    return counter.count() >= target


def kill_pass(args: argparse.Namespace, inp: Path, folder: Path) -> list[Attempt]:
    """Kill the job args.kills times at random moments, resuming each time, then let it finish."""
    rnd = random.Random(args.seed + 1)
    out, log = folder / "killed.jsonl", folder / "killed.log"
    out.unlink(missing_ok=True)
    attempts: list[Attempt] = []
    for k in range(args.kills + 1):
        before, torn = lines_and_tail(out)
        kill_when = None
        if k < args.kills:
            counter = LineCounter(out, before, out.stat().st_size - torn if out.exists() else 0)
            target = before + round(rnd.uniform(0.0, 0.9) * (args.records - before))
            kill_when = partial(reached, counter, target)
        code, wall, peak, killed_at = run_specgen(specgen_argv(args, inp, out, resume=k > 0), log, kill_when)
        if killed_at is None:
            check_exit(code, log)
        after, torn = lines_and_tail(out)
        attempts.append(Attempt(before, after, torn, wall, peak, killed_at))
        what = f"killed at {killed_at:.1f} s" if killed_at is not None else f"exit {code}"
        print(f"  attempt {k + 1}: {what}, {after - before} records written, {after} in all", flush=True)
        if killed_at is None and k < args.kills:
            print("  (it finished before its kill)")
            break
    return attempts


def check_output(out: Path, all_ids: list[str], max_tokens: int) -> list[str]:
    """What is wrong with the finished output: ids missing, repeated or unknown, errors, short outputs."""
    counts: Counter[str] = Counter()
    problems = []
    with open(out, "rb") as f:
        for number, line in enumerate(f, start=1):
            record = json.loads(line)
            counts[record["id"]] += 1
            if record.get("error") is not None or record["num_output_tokens"] != max_tokens:
                problems.append(f"line {number}: error {record.get('error')!r}, "
                                f"{record['num_output_tokens']} tokens")
    expected = set(all_ids)
    repeated = [i for i, c in counts.items() if c > 1]
    missing = expected - counts.keys()
    unknown = counts.keys() - expected
    for name, bad in (("repeated", repeated), ("missing", missing), ("unknown", unknown)):
        if bad:
            problems.append(f"{len(bad)} ids {name}, e.g. {sorted(bad)[:5]}")
    if sum(counts.values()) != len(all_ids):
        problems.append(f"{sum(counts.values())} records, expected {len(all_ids)}")
    return problems[:20]


def print_rss(rss: list[tuple[int, float, int]]) -> None:
    """The RSS table, and the marginal rate: records/s between the smallest and the largest size."""
    (n0, wall0, peak0), (n1, wall1, _) = rss[0], rss[-1]
    rate = (n1 - n0) / (wall1 - wall0) if n1 > n0 and wall1 > wall0 else n1 / wall1
    rows = [[n, wall, n / wall, peak / 2**20, (peak - peak0) / 2**20, None] for n, wall, peak in rss]
    for row, (n, _, peak), (m, _, prev) in zip(rows[1:], rss[1:], rss):
        row[-1] = (peak - prev) / (n - m)  # what each record past the previous size added to the peak
    print()
    print_table(["records", "wall s", "records/s", "peak RSS MiB", "vs first MiB", "bytes/record"], rows, 1)
    print(f"marginal rate {rate:.0f} records/s, startup {max(wall0 - n0 / rate, 0.0):.1f} s")


def print_attempts(attempts: list[Attempt], uninterrupted_s: float) -> None:
    rows = [[i + 1, a.records_before, a.records_after - a.records_before, a.torn_bytes,
             a.killed_at, a.wall_s, a.peak_rss / 2**20] for i, a in enumerate(attempts)]
    print()
    headers = ["attempt", "done before", "written", "torn bytes", "killed at s", "wall s", "peak RSS MiB"]
    print_table(headers, rows, 1)
    total = sum(a.wall_s for a in attempts)
    print(f"total wall {total:.1f} s over {len(attempts)} attempts (uninterrupted: {uninterrupted_s:.1f} s)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--sizes", type=int, nargs="*", default=[10_000, 100_000, 1_000_000],
                    help="prefix sizes of the RSS pass (those over --records are dropped, --records added)")
    ap.add_argument("--kills", type=int, default=3, help="SIGKILLs in the resume pass (0: no resume pass)")
    ap.add_argument("--ids", choices=ID_KINDS, default="named")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--model", type=Path, default=TINY_LLAMA)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", type=Path, help="keep the files here [default: a temporary folder, removed]")
    args = ap.parse_args()
    sizes = sorted({n for n in args.sizes if n < args.records} | {args.records})

    print(machine())
    argv = specgen_argv(args, Path("IN.jsonl"), Path("OUT.jsonl"), resume=False)
    print("command: python", " ".join(argv[1:]), "[--resume]")
    with tempfile.TemporaryDirectory(prefix="specgen-soak-") as tmp:
        folder = args.workdir or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        paths, all_ids = write_inputs(folder, args.records, sizes, args.ids, args.seed)
        print(f"wrote {args.records} records ({args.ids} ids) to {folder}")

        print("pass 1: peak RSS, a fresh process per size", flush=True)
        rss = rss_pass(args, paths, folder)
        print_rss(rss)
        if args.kills <= 0:
            return

        print(f"\npass 2: {args.records} records, killed {args.kills} times and resumed", flush=True)
        attempts = kill_pass(args, paths[args.records], folder)
        print_attempts(attempts, rss[-1][1])
        problems = check_output(folder / "killed.jsonl", all_ids, args.max_tokens)
        if problems:
            print("check FAILED:\n  " + "\n  ".join(problems))
            sys.exit(1)
        print(f"check passed: all {args.records} ids once each, {args.max_tokens} tokens each, no errors")


if __name__ == "__main__":
    main()
