"""Greedy steps without the LM head's logits (Model.screen, kernels/linear.cc "Greedy tokens without the logits")
against the logits and their argmax, side by side on the default model.

    python benchmarks/greedy_screen.py [--rows 1 6 32 192] [--jobs SET:BATCH ...] [--prompts N] [--repeats R]

1. The LM head alone, on final hidden states of Spec-Bench prompts (the model's own): float32 logits + argmax
   (specgen_linear, specgen_argmax) against specgen_screened_argmax, ms per call, medians of alternated calls;
   and how many columns per row the screen leaves for the float32 product (the same bound, in numpy).
2. One forward (Model.forward_greedy) of B slots feeding T tokens each, logits on and off, alternated.
3. Whole greedy jobs (`none` and `ngram` k=5), every forward run twice, with and without the logits (in turn
   first; the second rewrites the same K/V rows and gives the same tokens), so that the two are timed side by
   side under the same load: forward ms per decode step each way (mean, and the median of per-step ratios);
   then the same job once more, ordinarily, for the rest of a step's time (wall time less the forwards), and
   the job's ratio, with its steps that carry prompt tokens counted the same both ways (the screen changes only
   their few logit rows, and one 6 s prefill forward swings by a second with the machine's load).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("OMP_NUM_THREADS", "2")

import numpy as np


def hidden_rows(model, prompts, every: int = 12) -> np.ndarray:
    from specgen.engine.types import build_forward_batch

    rows = []
    for ids in prompts:
        ids = np.array(ids[:300], dtype=np.int64)
        b = build_forward_batch(np.array([0]), np.array([0]), np.array([len(ids)]), ids, np.array([True]))
        rows.append(model.forward(b, model.new_cache(1, len(ids) + 1))[1].numpy()[::every])
    return np.concatenate(rows)


def candidates(model, h: np.ndarray) -> np.ndarray:
    """Columns per row the screen keeps (its bound, evaluated in float64: a close estimate of the kernel's)."""
    s = model.screen
    panels = s.panels.panels.numpy().view(np.uint8)
    _, kb, _ = panels.shape
    from specgen.kernels import _dequantize_panels, _float_layout

    w = _dequantize_panels(_float_layout(panels, s.panels.kind), s.panels.kind)  # [panels, k, 32]
    w = w.transpose(1, 0, 2).reshape(kb * 32, -1)[:, :s.panels.n].astype(np.float64)
    c = s.bound.numpy().transpose(1, 0, 2).reshape(kb, -1)[:, :s.panels.n].astype(np.float64)
    hb = h.reshape(len(h), kb, 32)
    dx = (np.abs(hb).max(2) / 127).astype(np.float32)
    xq = np.clip(np.rint(hb / np.where(dx > 0, dx, 1)[:, :, None]), -127, 127) * dx[:, :, None]
    a = xq.reshape(len(h), -1).astype(np.float64) @ w
    e = 0.51 * (dx.astype(np.float64) @ c)
    return (a + e >= (a - e).max(1, keepdims=True)).sum(1)


def timed(fn, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 6, 32, 192])
    ap.add_argument("--steps", nargs="+", default=["1x1", "1x6", "32x1", "32x6"], help="SLOTSxTOKENS forwards")
    ap.add_argument("--jobs", nargs="*", default=["writing:1", "code_rewrite:1", "writing:32", "code_rewrite:32"])
    ap.add_argument("--prompts", type=int, default=8, help="prompts per job, at least the batch size (batch 1 runs "
                    "them in turn)")
    args = ap.parse_args()
    import paddle
    from paired import alternated_forward, paired_jobs
    from spec_bench import load_sets

    from specgen import load_model

    lm = load_model(None, threads=2)
    model = lm.model
    if model.screen is None:
        sys.exit("no screen on this model/machine (needs the fused kernels, a Q8_0 / Q4_0 LM head and VNNI)")
    most = max([args.prompts, 24] + [int(j.split(":")[1]) for j in args.jobs])
    sets = load_sets(most, most)
    chats = [list(lm.tokenizer.encode_chat(m)) for name in ("summarization", "qa", "writing", "code_rewrite")
             for m in sets[name][:6]]
    h = hidden_rows(model, chats)
    np.random.default_rng(0).shuffle(h)
    cand = candidates(model, h)
    print(f"screen: {len(h)} rows of final hidden states; columns left per row: median {np.median(cand):.0f}, "
          f"mean {cand.mean():.1f}, 90th percentile {np.percentile(cand, 90):.0f}, max {cand.max()} "
          f"(of {model.screen.panels.n})", flush=True)

    ops, head, scr = model.ops, model.w.lm_head, model.screen
    print(f"\n{'rows':>5}{'logits+argmax ms':>18}{'screened ms':>13}{'ratio':>8}")
    for rows in args.rows:
        x = paddle.to_tensor(np.resize(h, (rows, h.shape[1])).astype(np.float32))
        def full(x=x):
            return ops.specgen_argmax(ops.specgen_linear(x, head.panels, head.n)).numpy()

        def screened(x=x):
            return ops.specgen_screened_argmax(x, head.panels, scr.panels.panels, scr.bound, head.n).numpy()

        assert np.array_equal(full(), screened())
        n = 20 if rows < 64 else 5
        a, b = [], []
        for i in range(7):
            for f, out in ((full, a), (screened, b)) if i % 2 else ((screened, b), (full, a)):
                out.append(timed(f, n))
        print(f"{rows:>5}{np.median(a) * 1e3:>18.3f}{np.median(b) * 1e3:>13.3f}{np.median(a) / np.median(b):>7.2f}x",
              flush=True)

    original = model.forward_greedy

    def variant(logits_on: bool):
        def forward(batch, cache, logits=True):
            return original(batch, cache, logits=logits_on)
        return forward

    print(f"\n{'forward':>8}{'logits ms':>11}{'screened ms':>13}{'ratio':>8}")
    for step in args.steps:
        a, z = alternated_forward(model, step, variant(True), variant(False))
        print(f"{step:>8}{a:>11.2f}{z:>13.2f}{a / z:>7.3f}x", flush=True)

    print("\nA = with the logits, B = screened")
    paired_jobs(lm, sets, args.jobs, args.prompts, variant(True), variant(False),
                lambda x, y: np.array_equal(x[2], y[2]))


if __name__ == "__main__":
    main()
