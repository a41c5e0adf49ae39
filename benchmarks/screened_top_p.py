"""Could a top-p row be drawn from the LM head's screen, as an unfiltered one is? An offline measure.

    python benchmarks/screened_top_p.py --per-set 3 --max-tokens 40 --exact 256 1024 4096

A top-p row's kept set depends on its total weight, so today it needs every float32 logit. The screen (the
integer products of a Q8_0 LM head and their error bound, kernels/linear.cc) bounds every logit. This script
captures the default model's sampled rows (T --temperature, top-p --top-p, five Spec-Bench sets), recomputes
the screen's bounds in numpy (A_j +- s E_j, s = 0.506, as linear.cc's) and asks, row by row: with exact logits
for the --exact columns of highest upper bound and the rest as intervals, is every token's membership in the
nucleus decided (certainly in, certainly out), and can no undecided token win the Gumbel-max draw? Where not,
the row would fall back to every logit. Prints the nucleus's size and the fallback rate for each --exact.
"""
from __future__ import annotations

import argparse

import numpy as np
from common import load_sets, machine, print_table


def capture(lm, per_set: int, max_tokens: int, temperature: float, top_p: float) -> tuple[np.ndarray, ...]:
    """(final normed hidden rows [n, hidden], their float32 logits [n, vocab]) of a sampled job's steps."""
    from specgen import EngineConfig, SamplingParams, generate
    from specgen.engine.engine import Engine

    sets = load_sets(per_set, 0)
    prompts = [m for name in ("writing", "qa", "math_reasoning", "summarization", "translation")
               for m in sets[name]]
    hidden, logits = [], []
    original = Engine._sample

    def record(self, plan, blocks, out, rows):
        if out.logits is not None:
            hidden.append(out.hidden.numpy()[blocks.batch.logit_rows])
            logits.append(out.logits.numpy())
        return original(self, plan, blocks, out, rows)

    Engine._sample = record
    try:
        generate(prompts, model=lm, engine=EngineConfig(batch_size=1),
                 sampling=SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=0))
    finally:
        Engine._sample = original
    return np.concatenate(hidden).astype(np.float64), np.concatenate(logits).astype(np.float64)


def q8_head(path) -> tuple[np.ndarray, np.ndarray]:
    """The GGUF's Q8_0 token embedding (the tied LM head): scales d [vocab, blocks], quants q [vocab, blocks,
    32]."""
    from gguf import GGUFReader

    t = [t for t in GGUFReader(path).tensors if t.name in ("output.weight", "token_embd.weight")][-1]
    assert t.tensor_type.name == "Q8_0", t.tensor_type.name
    blocks = np.asarray(t.data).reshape(t.data.shape[0], -1, 34)
    d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float64)
    return d, blocks[..., 2:].copy().view(np.int8).astype(np.float64)


def decided(x: np.ndarray, z: np.ndarray, d: np.ndarray, q: np.ndarray, temperature: float, top_p: float,
            exact: int, rng) -> tuple[bool, int]:
    """(whether the row's draw is decided from the bounds with `exact` exact columns, its nucleus's size)."""
    xb = x.reshape(d.shape[1], 32)
    dx = np.abs(xb).max(1) / 127.0
    xq = np.round(xb / np.where(dx > 0, dx, 1)[:, None])
    a = (np.einsum("vbk,bk->vb", q, xq) * d * dx[None, :]).sum(1)
    margin = 0.506 * ((np.abs(d) * np.abs(q).sum(-1)) @ dx)
    lo, hi = a - margin, a + margin
    top = np.argpartition(-hi, exact)[:exact]
    lo[top], hi[top] = z[top], z[top]
    m = z.max()
    wlo, whi = np.exp((lo - m) / temperature), np.exp((hi - m) / temperature)
    zlo, zhi = wlo.sum(), whi.sum()
    order_lo, order_hi = np.argsort(lo), np.argsort(hi)
    cum_lo = np.concatenate([[0], np.cumsum(wlo[order_lo])])
    cum_hi = np.concatenate([[0], np.cumsum(whi[order_hi])])
    above_lo = cum_lo[-1] - cum_lo[np.searchsorted(lo[order_lo], hi, side="right")]  # certainly above j
    above_hi = cum_hi[-1] - cum_hi[np.searchsorted(hi[order_hi], lo, side="left")] - whi  # possibly above j
    inside, outside = above_hi < top_p * zlo, above_lo >= top_p * zhi
    undecided = ~inside & ~outside
    g = -np.log(-np.log(rng.random(len(z)) * (1 - 2.0 ** -53) + 2.0 ** -54))
    best = np.where(inside, z / temperature + g, -np.inf).max()
    p = np.exp((z - m) / temperature)
    order = np.argsort(-z)
    nucleus = int(((np.cumsum(p[order]) - p[order]) < top_p * p.sum()).sum())
    return not (undecided & (hi / temperature + g >= best)).any(), nucleus


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-set", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--exact", type=int, nargs="+", default=[256, 1024, 4096])
    args = ap.parse_args()
    from specgen import load_model
    from specgen.models.default_model import default_gguf_path

    print(machine())
    lm = load_model(None, threads=2)
    x, z = capture(lm, args.per_set, args.max_tokens, args.temperature, args.top_p)
    d, q = q8_head(default_gguf_path())
    rows = []
    for exact in args.exact:
        rng = np.random.default_rng(0)
        runs = [decided(x[i], z[i], d, q, args.temperature, args.top_p, exact, rng) for i in range(len(x))]
        sizes = np.array([n for _, n in runs])
        fallback = 1.0 - float(np.mean([ok for ok, _ in runs]))
        spread = [float(np.median(sizes)), float(np.percentile(sizes, 90)), int(sizes.max())]
        rows.append([exact, len(runs), *spread, fallback])
    print_table(["exact columns", "rows", "nucleus median", "p90", "max", "fallback"], rows, digits=3)


if __name__ == "__main__":
    main()
