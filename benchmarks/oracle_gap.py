"""How close can a chain of MTP drafts get to its oracle bound at batch 1, with or without per-token
confidence?

    python benchmarks/oracle_gap.py [SETS (comma-separated)] [PROMPTS PER SET]

The shipped head drafts k = 2 every step (no adaptation, no copies) on the reference backend, which here also
records each draft's softmax probability (the head's pass is wrapped: the same operators, one more softmax).
Each step's fate (first draft right, both right) comes from the run's own outputs. The steps are then priced
at the fused backend's step costs c(1..3) measured at the prompts' median length, and the head's time per
draft d (0.03 and 0.06 of c(1): what the shipped head measured) for:
- the oracle: each step verifies exactly the drafts that will be accepted (the drafter charged for those
  only);
- the best fixed k: k drafts every step, the best k in 0..2;
- a confidence gate: the first draft verified when its probability is >= tau, the second when the product of
  the two is; tau is the best of a grid, chosen on the same steps (optimistic).
Decoding steps only (no prefill, no host time per step): speedups over plain decoding and their ratio to the
oracle's. Slow (reference backend): minutes per set.
"""
import sys

import numpy as np
import paddle
import paddle.nn.functional as F
from common import load_sets, machine

from specgen import EngineConfig, Method, SamplingParams, SpecConfig, load_model
from specgen.api import make_engine
from specgen.app import bounds
from specgen.backends import reference as R
from specgen.config import MtpConfig
from specgen.engine.types import Request

REC = []
orig_pass = R.ReferenceHead._pass
def _pass(self, cache, slots, starts, lens, token_ids, prev_hidden):
    last, d, x = orig_pass(self, cache, slots, starts, lens, token_ids, prev_hidden)
    hd = self.head
    logits = self.lm_head(R.rms_norm(last, hd.final_norm, self.shape.eps))
    self._p = F.softmax(logits, axis=-1).max(axis=-1).numpy()
    return last, d, x
R.ReferenceHead._pass = _pass
def run(self, cache, p):
    # the same as ReferenceHead.run, recording each depth's probabilities
    first = np.concatenate([[0], np.cumsum(p.seq_lens)[:-1]]).astype(np.int64)
    h_main = paddle.gather(p.hidden, paddle.to_tensor(p.rows))
    x, d, rows = self._pass(cache, p.token_slots[first], p.positions[first], p.seq_lens, p.token_ids, h_main)
    out = np.zeros((len(p.last_rows), p.depth), np.int64)
    probs = np.zeros((len(p.last_rows), p.depth))
    if not len(p.last_rows):
        return out, rows
    wanted = np.searchsorted(first, p.last_rows, side="right") - 1
    x = paddle.gather(x, paddle.to_tensor(wanted))
    out[:, 0] = d = d[wanted]
    probs[:, 0] = self._p[wanted]
    slots, last_pos = p.token_slots[p.last_rows], p.positions[p.last_rows]
    ones = np.ones(len(slots), np.int64)
    for i in range(1, p.depth):
        x, d, _ = self._pass(cache, slots, last_pos + i, ones, d, x)
        out[:, i] = d
        probs[:, i] = self._p
    REC.append((out[0].copy(), probs[0].copy()))
    return out, rows
R.ReferenceHead.run = run

print(machine())
sets = (sys.argv[1] if len(sys.argv) > 1 else "math_reasoning,qa,summarization,code_rewrite").split(",")
n = int(sys.argv[2]) if len(sys.argv) > 2 else 4
ref = load_model(None, backend="reference")
fused = load_model(None)
data = load_sets(n, n)
spec = SpecConfig(method=Method.MTP, num_speculative_tokens=2, adaptive=False, mtp=MtpConfig(copy=0))
allrows = {}
for name in sets:
    prompts = [list(ref.tokenizer.encode_chat(m)) for m in data[name][:n]]
    rows = []
    for i, p in enumerate(prompts):
        REC.clear()
        eng = make_engine(ref, EngineConfig(batch_size=1), spec)
        out = list(eng.run([Request(str(i), i, tuple(p), SamplingParams(max_tokens=128))]))[0].token_ids
        pos = 1
        for d, pr in REC:
            if pos >= len(out):
                break
            c1 = pos < len(out) and d[0] == out[pos]
            c2 = c1 and pos + 1 < len(out) and d[1] == out[pos + 1]
            rows.append((pr[0], pr[1], c1, c2))
            pos += 1 + int(c1) + int(c2)
    position = int(np.median([len(p) for p in prompts]))
    costs = bounds.step_costs(fused.model, position, [1, 2, 3])
    allrows[name] = (np.array(rows, dtype=float), costs)
    print(name, len(rows),
          "steps; c(2)/c(1) %.3f c(3)/c(1) %.3f" % (costs[2] / costs[1], costs[3] / costs[1]), flush=True)

for name, (r, costs) in allrows.items():
    c = np.array([costs[1], costs[2], costs[3]]) / costs[1]
    p1, p2, a1, a2 = r.T
    acc = a1 + a2  # drafts accepted (k = 2)
    for dd in (0.03, 0.06):
        oracle = (1 + acc).sum() / np.sum(c[acc.astype(int)] + acc * dd)
        fixed = {k: (1 + np.minimum(acc, k)).sum() / np.sum(np.full(len(acc), c[k] + k * dd))
                 for k in range(3)}
        best = (0, 0)
        for tau in np.linspace(0.05, 0.95, 19):
            k = (p1 >= tau).astype(int) + (p1 * p2 >= tau).astype(int)
            emitted = 1 + np.minimum(acc, k)
            cost = c[k] + dd * (1 + (p1 >= tau))
            rate = emitted.sum() / cost.sum()
            best = max(best, (rate, tau))
        fk = max(fixed.values())
        print(f"{name:15s} d/c1={dd:.2f} acc1={a1.mean():.2f} acc2={a2.mean():.2f} oracle={oracle:.3f} "
              f"best fixed k={fk:.3f} ({fk / oracle:.2f} of oracle) confidence-gated={best[0]:.3f} "
              f"({best[0] / oracle:.2f}; tau {best[1]:.2f})")
