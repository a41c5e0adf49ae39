"""Where one step's time goes: plain and n-gram (k=5) decoding at batch 1, 32 and 256 on the default model.

    python benchmarks/profile_step.py --batch-sizes 1 32 256 --steps 8 [--reference]

Fills every slot with a Spec-Bench summarization or RAG prompt, runs prefill and a few warm-up steps, then times --steps decode
steps, split into: linear layers (matmuls on weights), LM head, attention (RoPE + cache write + attention,
fused or the Paddle reference ops), norms and SiLU-gate, other tensor ops, sampling, verification and commit
(the runner's host-side work), drafting (proposer), and the rest (Python). Also counts Paddle/fused op calls
per step. --reference runs the Paddle reference path instead of the fused CPU kernels. With packed weights a
forward's decoder blocks are one fused op (specgen_stack), timed whole as "blocks"; --op-by-op calls its kernels
one by one (SPECGEN_FUSED_LAYER=0) to split that time into linear, attention and norms. The embedding, final norm
and LM head run as their own ops (SPECGEN_FUSED_FORWARD=0; by default they are inside one specgen_forward op
with the blocks), so the profile can time them apart.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"


class Timer:
    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.depth = 0

    @contextmanager
    def section(self, name: str):
        start = time.perf_counter()
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
            self.seconds[name] += time.perf_counter() - start
            self.calls[name] += 1

    def wrap(self, owner, attr: str, name_of):
        fn = getattr(owner, attr)

        def timed(*a, **kw):
            if self.depth > 0:  # already inside a timed section (e.g. an op calling another)
                return fn(*a, **kw)
            with self.section(name_of(*a, **kw)):
                return fn(*a, **kw)

        setattr(owner, attr, timed)
        return fn


def instrument(timer: Timer, model, engine_mod, vocab: int):
    import paddle
    import paddle.nn.functional as F

    from specgen import kernels as kernels_mod
    from specgen.engine import model as model_mod

    def mm_name(x, y, *a, **kw):
        return "lm_head" if y.shape[-1] == vocab else ("linear" if len(y.shape) == 2 else "attention")

    timer.wrap(paddle, "matmul", mm_name)
    for attr in ("gather", "scatter", "scatter_", "concat", "split", "zeros", "rsqrt", "mean", "to_tensor", "argmax"):
        timer.wrap(paddle, attr, lambda *a, _n=attr, **kw: "other tensor ops")
    timer.wrap(F, "softmax", lambda *a, **kw: "attention")
    timer.wrap(F, "silu", lambda *a, **kw: "norms + silu")
    timer.wrap(F, "embedding", lambda *a, **kw: "other tensor ops")
    timer.wrap(model_mod, "rms_norm", lambda *a, **kw: "norms + silu")
    if model.ops is not None:
        class TimedOps:
            pass

        t = TimedOps()
        names = {"specgen_stack": "blocks", "specgen_attention": "attention", "specgen_rms_norm": "norms + silu",
                 "specgen_add_rms_norm": "norms + silu", "specgen_silu_mul": "norms + silu"}
        for op, label in names.items():
            setattr(t, op, getattr(model.ops, op))
            timer.wrap(t, op, lambda *a, _l=label, **kw: _l)
        t.specgen_linear = model.ops.specgen_linear  # packed weights: args (x, panels, n)
        timer.wrap(t, "specgen_linear", lambda x, w, n, *a, **kw: "lm_head" if n == vocab else "linear")
        model.ops = t
    timer.wrap(engine_mod, "sample", lambda *a, **kw: "sampling")
    timer.wrap(engine_mod, "uniforms", lambda *a, **kw: "sampling")
    timer.wrap(kernels_mod, "argmax", lambda *a, **kw: "sampling")  # the greedy tokens (Model.forward_greedy)
    timer.wrap(engine_mod, "accept_lengths", lambda *a, **kw: "verification + commit")
    timer.wrap(engine_mod, "first_stop", lambda *a, **kw: "verification + commit")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32, 256])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prompt-chars", type=int, default=1500, help="characters of each prompt kept")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=1024,
                    help="each request's max_tokens (its KV room is taken when it is placed, if memory allows)")
    ap.add_argument("--reference", action="store_true", help="Paddle reference ops instead of the fused kernels")
    ap.add_argument("--unpacked", action="store_true", help="MKL's matmul instead of the packed linear kernel")
    ap.add_argument("--op-by-op", action="store_true", help="the decoder block's kernels one by one, not fused")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    # the embedding, final norm and LM head as their own ops (not inside specgen_forward), to time them apart
    os.environ["SPECGEN_FUSED_FORWARD"] = "0"
    if args.unpacked:
        os.environ["SPECGEN_PACKED_LINEAR"] = "0"
    if args.reference:
        os.environ["SPECGEN_KERNELS"] = "0"
    if args.op_by_op:
        os.environ["SPECGEN_FUSED_LAYER"] = "0"
    from specgen import SamplingParams, load_model
    from specgen.config import EngineConfig, Method, SpecConfig
    from specgen.engine import runner as engine_mod
    from specgen.engine.types import Request
    from specgen.api import make_engine

    lm = load_model(None, threads=args.threads)
    lines = [json.loads(x) for x in (DATA / "spec_bench" / "question.jsonl").read_text().splitlines() if x.strip()]
    lines = [q for q in lines if q["category"] in ("summarization", "rag")]  # input-grounded: n-gram drafts hit
    print(f"kernels: {'off (reference)' if lm.model.ops is None else 'fused'}; packed linear "
          f"{'on' if lm.model.packs else 'off'}; one op per block {'on' if lm.model.fused_layer else 'off'}; "
          f"threads {args.threads}")
    sections = ["blocks", "linear", "lm_head", "attention", "norms + silu", "other tensor ops", "sampling",
                "verification + commit", "drafting", "python + rest"]
    print(f"{'batch':>5} {'method':>6} {'ms/step':>8} {'tok/step':>8} {'ops/step':>8}  " +
          "  ".join(f"{s:>12}" for s in sections))
    for bs in args.batch_sizes:
        for method in ("none", "ngram"):
            spec = SpecConfig(method=Method(method), num_speculative_tokens=5, adaptive=False)
            engine = make_engine(lm, EngineConfig(batch_size=bs, max_prefill_tokens=1 << 16), spec)
            sp = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
            reqs = [Request(str(i), i, tuple(lm.tokenizer.encode_chat(
                [{"role": "user", "content": lines[(i * 7) % len(lines)]["turns"][0][: args.prompt_chars]}])), sp)
                for i in range(bs)]
            for slot, r in enumerate(reqs):
                engine._place(slot, r)
            for _ in range(3):  # prefill + warm-up
                engine.step()
            timer = Timer()
            saved = (lm.model.ops,)
            import paddle
            import paddle.nn.functional as F
            from specgen import kernels as kernels_mod
            from specgen.engine import model as model_mod
            originals = {(paddle, a): getattr(paddle, a) for a in ("matmul", "gather", "scatter", "scatter_", "concat",
                                                                  "split", "zeros", "rsqrt", "mean", "to_tensor",
                                                                  "argmax")}
            originals.update({(F, "softmax"): F.softmax, (F, "silu"): F.silu, (F, "embedding"): F.embedding,
                              (model_mod, "rms_norm"): model_mod.rms_norm, (engine_mod, "sample"): engine_mod.sample,
                              (engine_mod, "uniforms"): engine_mod.uniforms,
                              (kernels_mod, "argmax"): kernels_mod.argmax,
                              (engine_mod, "accept_lengths"): engine_mod.accept_lengths,
                              (engine_mod, "first_stop"): engine_mod.first_stop})
            instrument(timer, lm.model, engine_mod, lm.model.config.vocab_size)
            prop = engine.proposer
            orig_propose = prop.propose

            def propose(view, _f=orig_propose):
                with timer.section("drafting"):
                    return _f(view)

            prop.propose = propose
            before = int(engine.table.seq_len.sum())
            start = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            total = time.perf_counter() - start
            emitted = int(engine.table.seq_len.sum()) - before
            for (owner, attr), fn in originals.items():
                setattr(owner, attr, fn)
            lm.model.ops = saved[0]
            accounted = sum(timer.seconds.values())
            timer.seconds["python + rest"] = total - accounted
            ops = sum(v for k, v in timer.calls.items() if k not in ("drafting",)) / args.steps
            row = "  ".join(f"{timer.seconds[s] / args.steps * 1e3:>12.2f}" for s in sections)
            print(f"{bs:>5} {method:>6} {total / args.steps * 1e3:>8.1f} {emitted / args.steps / bs:>8.2f} "
                  f"{ops:>8.0f}  {row}", flush=True)


if __name__ == "__main__":
    main()
