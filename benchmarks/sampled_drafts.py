"""What sampled speculation could accept (issue 57): the shipped MTP head's first draft against the main
model's token, on greedy text and on sampled text, under every drafting rule that could apply.

    python benchmarks/sampled_drafts.py [--per-set 4] [--max-tokens 64] [--temperature 0.8] [--top-p 0.95]

Per set, each prompt is completed twice by plain decoding (greedy; then sampled, seed 1), then read back in
one forward of the main model and one pass of the head (the reference backend, float32; the head's prompt
window as the engine feeds it). At each output position after the first, p is the main model's distribution of
the next token and q the head's (each filtered by the job's temperature and top-p by layers/sampling.py's
rule), and the expected share of first drafts accepted is, exactly (no sampling noise):
- greedy text, greedy job: the head's argmax is the model's (what greedy speculation accepts);
- sampled text, sampled job, for the rules a drafter could follow:
  - "argmax draft": the head's argmax, accepted with probability p(argmax q) (what specgen drafts);
  - "same uniform": the head samples its own q with the uniform verification would use at that position
    under sampler 2 (the inverse CDF in token-id order; sampler 3 draws with Gumbel noise instead): accepted
    where both land on the same token;
  - "same noise": the head's draft as MTP drafts for sampled requests (layers/sampling.coupled_drafts): the
    Gumbel-max draw over its logits at the temperature (no top-p; the columns within DRAFT_SPAN of its best)
    with the noise verification uses at that position: accepted where both draws are the same token (a Monte
    Carlo estimate, --draws noise draws a position over the tokens either could take);
  - "rejection sampling": Leviathan et al.'s rule, accepting min(1, p / q) of a draft from q: 1 - TV(p, q)
    (not seed-exact: shown as what the standard method would reach);
  - "argmax match": the head's argmax is the model's, for comparison with the greedy job;
  - "best blind draft": max p, what the best draft chosen without the noise (n-gram's copies, any argmax)
    could be accepted with: the ceiling of every drafter but the coupled ones.
Timings are not reported: these are expectations over the texts.
"""
from __future__ import annotations

import argparse

import numpy as np
from common import load_sets, machine, print_table


def filtered(logits: np.ndarray, temperature: float, top_p: float) -> np.ndarray:
    """[rows, vocab] -> the rows' probabilities after temperature and top-p, renormalized: the distribution
    the sampler draws from (layers/sampling.py's filtered_probs)."""
    import paddle

    from specgen.layers.sampling import filtered_probs

    n = len(logits)
    w = filtered_probs(paddle.to_tensor(logits), np.full(n, temperature), np.zeros(n, np.int64),
                       np.full(n, top_p)).numpy()
    return w / w.sum(axis=-1, keepdims=True)


def same_uniform(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """[rows] P(the inverse CDFs of p and q in token-id order give the same token for one uniform u)."""
    cp, cq = np.cumsum(p, axis=-1), np.cumsum(q, axis=-1)
    overlap = np.minimum(cp, cq) - np.maximum(cp - p, cq - q)
    return np.where((p > 0) & (q > 0), np.clip(overlap, 0.0, None), 0.0).sum(axis=-1)


def same_noise(p: np.ndarray, own: np.ndarray, vocab: np.ndarray, temperature: float, draws: int,
               rng) -> np.ndarray:
    """[rows] P(the main model's draw from p = the head's coupled draft), one Gumbel g shared: argmax over p's
    kept tokens of log p + g against argmax over the head's columns within DRAFT_SPAN of its best of
    own / temperature + g (own [rows, draft vocab], its columns' token ids `vocab`; Monte Carlo, `draws`
    noise vectors a row)."""
    from specgen.layers.sampling import DRAFT_SPAN

    out = np.zeros(len(p))
    for i in range(len(p)):
        scaled = own[i] / temperature
        cols = np.nonzero(scaled >= scaled.max() - DRAFT_SPAN)[0]
        support = np.union1d(np.nonzero(p[i] > 0)[0], vocab[cols])
        g = rng.gumbel(size=(draws, len(support)))
        with np.errstate(divide="ignore"):
            lp = np.log(p[i, support])
        lq = np.full(len(support), -np.inf)
        lq[np.searchsorted(support, vocab[cols])] = scaled[cols]
        out[i] = np.mean((lp + g).argmax(-1) == (lq + g).argmax(-1))
    return out


def read_back(lm, head, window: int, prompt: list[int], output: list[int]):
    """(main logits of each next output token after the first [n, vocab], the head's at the same positions
    [n, draft vocab]) for one completed prompt."""
    from specgen.layers.norm import rms_norm
    from specgen.runtime.batch import build_forward_batch

    model = lm.model
    seq = np.array(prompt + output, np.int64)
    n, first = len(seq), len(prompt)
    cache = model.new_cache(1, n + 8)
    batch = build_forward_batch(np.array([0]), np.array([0]), np.array([n]), seq, np.array([True]))
    out = model.forward(batch, cache, logits=True)
    start = max(first - window, 0) if window else 0  # the head's first position (its prompt window)
    head_cache = model.new_cache(1, n + 8)
    # the head at position i reads the main hidden state there and token i + 1, and predicts token i + 2
    _, _, x = head._pass(head_cache, np.array([0]), np.array([0]), np.array([n - 1 - start]), seq[start + 1:],
                         out.hidden[start: n - 1])
    q = head.lm_head(rms_norm(x, head.head.final_norm, model.shape.eps)).numpy().astype(np.float64)
    positions = np.arange(first - 1, n - 2)  # token i + 2 is an output token after the first
    return out.logits.numpy().astype(np.float64)[positions + 1], q[positions - start]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sets", nargs="+", default=["translation", "code_rewrite", "math_reasoning", "qa",
                                                  "summarization"])
    ap.add_argument("--per-set", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--draws", type=int, default=400)
    args = ap.parse_args()
    from specgen import load_model
    from specgen.api import generate
    from specgen.config import SamplingParams
    from specgen.drafters.mtp import (
        MtpHeadWeights,
        load_draft_vocab,
        load_mtp_weights,
        prompt_window,
        shipped_head,
    )
    from specgen.models.loaded import encode_prompt

    print(machine())
    lm = load_model(None, backend="reference", dtype="float32")
    model = lm.model
    path = shipped_head(str(model.source))
    weights = MtpHeadWeights.read_modules(load_mtp_weights(path), str(path), model, load_draft_vocab(path))[0]
    head = model.backend.prepare_drafter(model, weights, False)
    vocab = weights.draft_vocab if weights.draft_vocab is not None else np.arange(model.config.vocab_size)
    window = prompt_window(path)
    t, top_p = args.temperature, args.top_p
    sets = load_sets(args.per_set, args.per_set)
    rows = []
    rng = np.random.default_rng(0)
    for name in args.sets:
        prompts = sets[name]
        ids = [list(encode_prompt(lm, m)) for m in prompts]
        greedy = generate(prompts, lm, SamplingParams(max_tokens=args.max_tokens))
        sampled = generate(prompts, lm, SamplingParams(temperature=t, top_p=top_p, max_tokens=args.max_tokens,
                                                       seed=1))
        match_greedy, sums, n_greedy, n = 0.0, np.zeros(6), 0, 0
        for prompt, g, s in zip(ids, greedy, sampled, strict=True):
            main, own = read_back(lm, head, window, prompt, list(g.token_ids))
            match_greedy += float((vocab[own.argmax(-1)] == main.argmax(-1)).sum())
            n_greedy += len(main)
            main, own = read_back(lm, head, window, prompt, list(s.token_ids))
            p = filtered(main, t, top_p)
            q = np.zeros_like(p)
            q[:, vocab] = filtered(own, t, top_p)
            draft = vocab[own.argmax(-1)]
            sums += [p[np.arange(len(p)), draft].sum(), same_uniform(p, q).sum(),
                     same_noise(p, own, vocab, t, args.draws, rng).sum(),
                     (1.0 - 0.5 * np.abs(p - q).sum(-1)).sum(),
                     float((draft == main.argmax(-1)).sum()), p.max(-1).sum()]
            n += len(p)
        rows.append([name, n_greedy, match_greedy / n_greedy, n, *(sums / n)])
        print_table(["set", "greedy positions", "greedy job", "sampled positions", "argmax draft",
                     "same uniform", "same noise", "rejection sampling", "argmax match", "best blind draft"],
                    rows[-1:], digits=3)
    print()
    print_table(["set", "greedy positions", "greedy job", "sampled positions", "argmax draft", "same uniform",
                 "same noise", "rejection sampling", "argmax match", "best blind draft"], rows, digits=3)


if __name__ == "__main__":
    main()
