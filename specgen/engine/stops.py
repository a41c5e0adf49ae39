"""Stop strings: cutting a step's emitted tokens where the output text first contains one."""
from __future__ import annotations

import numpy as np

from specgen.engine.slots import SlotTable
from specgen.models.tokenizer import TextTokenizer


def stop_strings(tokenizer: TextTokenizer | None, requests: list, t: SlotTable, slots: np.ndarray,
                 emitted: np.ndarray, kept: np.ndarray) -> tuple[np.ndarray, dict[int, str]]:
    """Cut runs at the first token after which the output text contains a stop string.

    Only requests that have stop strings are looked at (a per-request loop over that subset); none stops an
    output shorter than its min_tokens (vLLM's rule). Modifies `kept`
    ([num_seqs] int64) in place; returns (stopped [num_seqs] bool, {slot: text cut before the stop})."""
    stopped = np.zeros(len(slots), bool)
    texts: dict[int, str] = {}
    if tokenizer is None:
        return stopped, texts
    for i, s in enumerate(slots.tolist()):
        stops = requests[s].params.stop
        if not stops:
            continue
        prior = t.output_ids(s)
        for j in range(int(kept[i])):
            if len(prior) + j + 1 < requests[s].params.min_tokens:
                continue
            text = tokenizer.decode(prior + emitted[i, : j + 1].tolist())
            hits = [text.find(x) for x in stops if x in text]
            if hits:
                kept[i] = j + 1
                stopped[i] = True
                texts[s] = text[: min(hits)]
                break
    return stopped, texts
