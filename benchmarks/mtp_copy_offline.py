"""Where the MTP head's first drafts miss, and what copying from the text would take, teacher-forced offline.

    python benchmarks/mtp_copy_offline.py --per-category 16 --mbpp 16 [--mtp-model DIR]

The default model's greedy continuations of held-out prompts (the evaluation slice of benchmarks/mtp_bench.py)
are generated once with the hidden states the engine hands an MTP head (specgen.train.data, cached under
--data). The head then runs over each whole sequence at once, attending to all of it as in the engine, and at
every position i whose token i + 1 was generated its first draft (argmax over its draft vocabulary) is compared
with the label, token i + 2. Printed per set:
- the head's first-draft accuracy, and split by where the label's bigram (token i + 1, token i + 2) occurred
  before: within the last 128 positions (the head's training windows), only further back, or never;
- the copy rule's accuracy: the token that followed the latest earlier occurrence of the longest tail of
  3..1 tokens (n-gram drafting), and what `copy if its tail has >= N tokens, else the head` gives for N = 1..3
  (SpecConfig.mtp_copy = N), and the share where either is right.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spec_bench import load_sets

WINDOW = 128  # TrainConfig.seq_len: positions a training window holds


def bigram_classes(tokens: list[int]) -> np.ndarray:
    """[len(tokens)] 0: the bigram ending at p occurred within WINDOW positions before, 1: only further back,
    2: never (positions 0 and 1: 2)."""
    last: dict[tuple[int, int], int] = {}
    out = np.full(len(tokens), 2, np.int64)
    for p in range(1, len(tokens)):
        bg = (tokens[p - 1], tokens[p])
        if bg in last:
            out[p] = 0 if p - last[bg] <= WINDOW else 1
        last[bg] = p
    return out


def load_head(model, path: str):
    """A trained head (DeepSeek-V3 layout on disk) as a TrainableHead, and its draft vocabulary."""
    from specgen.engine.model import TensorReader
    from specgen.engine.proposers.mtp import _block_config, load_draft_vocab, load_mtp_weights
    from specgen.train.head import TrainableHead

    cfg, h = model.config, model.config.hidden_size
    w = load_mtp_weights(path)
    r = TensorReader(w, path, _block_config(cfg, w), "float32")
    p = f"model.layers.{cfg.num_layers}."
    weights = {k: v.numpy() for k, v in r.layer(p).items() if v is not None}
    weights.update(enorm=r.param(p + "enorm.weight", (h,)).numpy(), hnorm=r.param(p + "hnorm.weight", (h,)).numpy(),
                   eh_proj=np.ascontiguousarray(r.get(p + "eh_proj.weight", (h, 2 * h)).T.astype(np.float32)),
                   final_norm=r.param(p + "shared_head.norm.weight", (h,)).numpy())
    vocab = load_draft_vocab(path)
    return TrainableHead(model, weights), (np.arange(cfg.vocab_size) if vocab is None else vocab)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-category", type=int, default=16)
    ap.add_argument("--mbpp", type=int, default=16)
    ap.add_argument("--sets", nargs="+", default=["summarization", "rag", "code_rewrite"])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--mtp-model", default=None, help="head directory [default: the head shipped for the model]")
    ap.add_argument("--data", default="runs/mtp_copy_offline", help="where the generated sequences are cached")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import paddle

    from specgen import kernels, load_model
    from specgen.engine.proposers.mtp import SHIPPED_HEAD
    from specgen.engine.proposers.ngram import ngram_match
    from specgen.train.config import TrainConfig
    from specgen.train.data import generate_data, load_data, read_requests

    loaded = load_model(None, threads=args.threads)
    data_dir = Path(args.data) / f"{'-'.join(args.sets)}-{args.per_category}-{args.mbpp}-{args.max_tokens}"
    data_dir.mkdir(parents=True, exist_ok=True)
    prompts = data_dir / "prompts.jsonl"
    sets = {k: v for k, v in load_sets(args.per_category, args.mbpp).items() if k in args.sets}
    prompts.write_text("".join(json.dumps({"id": f"{name}-{i}", "messages": m}) + "\n"
                               for name, ps in sets.items() for i, m in enumerate(ps)))
    tc = TrainConfig(gen_max_tokens=args.max_tokens, gen_batch_size=48)  # prompt positions recorded too
    generate_data(loaded, read_requests(prompts, "jsonl", loaded, tc), data_dir / "data", tc)
    data = load_data(data_dir / "data")
    head, vocab = load_head(loaded.model, args.mtp_model or str(SHIPPED_HEAD))
    lm = paddle.gather(kernels.dense(loaded.model.w.lm_head), paddle.to_tensor(vocab), axis=1)  # [hidden, V']

    counts: dict[str, dict[str, int]] = {}
    with paddle.no_grad():
        for s, sid in enumerate(data.ids):
            name = sid.rsplit("-", 1)[0]
            T, P = int(data.num_rows[s]) + 1, int(data.prompt_len[s])
            toks = data.tokens[data.tok_start[s]: data.tok_start[s] + T]
            hidden = np.asarray(data.hidden[data.row_start[s]: data.row_start[s] + T - 2], np.float32)[None]
            L = T - 2  # positions i with a label at i + 2
            x, _ = head(paddle.to_tensor(hidden), paddle.to_tensor(toks[1:T - 1][None]),
                        paddle.to_tensor(np.arange(L)[None]))
            rows = np.arange(max(P - 1, 0), L)  # token i + 1 generated
            if not len(rows):
                continue
            labels = toks[rows + 2]
            head_pick = vocab[head.logits(x, paddle.to_tensor(rows), lm).numpy().argmax(-1)]
            # n-gram drafting's rule (tails of 3..1 tokens) at each position, from the tokens before it
            copy, tail = ngram_match(np.broadcast_to(toks, (len(rows), T)), rows + 2, 1, 1, 3)
            copy_pick = np.where(copy.num_draft > 0, copy.draft_ids[:, 0], -1)
            cls = bigram_classes(toks.tolist())[rows + 2]
            head_ok, copy_ok = head_pick == labels, copy_pick == labels
            c = counts.setdefault(name, {})
            for key, v in [("n", len(rows)), ("head", head_ok.sum()), ("copy", copy_ok.sum()),
                           ("either", (head_ok | copy_ok).sum())] + \
                    [(f"cls{j}", (cls == j).sum()) for j in range(3)] + \
                    [(f"head{j}", (head_ok & (cls == j)).sum()) for j in range(3)] + \
                    [(f"mix{n}", (np.where(tail >= n, copy_pick, head_pick) == labels).sum()) for n in (1, 2, 3)]:
                c[key] = c.get(key, 0) + int(v)
    print(f"head: {args.mtp_model or SHIPPED_HEAD}")
    print(f"{'set':<15}{'positions':>10}{'head':>7}  {'bigram <=128 back':>18}{'further back':>14}{'never':>13}"
          f"{'copy':>7}{'mix 1':>7}{'mix 2':>7}{'mix 3':>7}{'either':>8}")
    for name, c in counts.items():
        n = c["n"]
        split = [f"{c[f'cls{j}'] / n:.2f}: {c[f'head{j}'] / max(c[f'cls{j}'], 1):.3f}" for j in range(3)]
        print(f"{name:<15}{n:>10}{c['head'] / n:>7.3f}  {split[0]:>18}{split[1]:>14}{split[2]:>13}"
              f"{c['copy'] / n:>7.3f}{c['mix1'] / n:>7.3f}{c['mix2'] / n:>7.3f}{c['mix3'] / n:>7.3f}"
              f"{c['either'] / n:>8.3f}")


if __name__ == "__main__":
    main()
