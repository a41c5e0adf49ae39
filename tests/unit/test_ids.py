"""SeenIds holds exactly the ids a set would: counted families as bits, everything else in a set."""
from __future__ import annotations

import random

import pytest

from specgen.io.ids import MAX_FAMILIES, SeenIds


def _ids(rng: random.Random, n: int) -> list[str]:
    kinds = [
        lambda i: str(i), lambda i: f"req-{i}", lambda i: f"doc-{i:06d}",
        lambda i: f"x{rng.randrange(10**12)}", lambda i: f"{rng.random():.6f}", lambda i: "", lambda i: "007",
        lambda i: f"p{rng.randrange(MAX_FAMILIES * 2)}-{i}",
        lambda i: "9" * rng.choice([18, 19, 40]), lambda i: f"r{n - i}",
    ]
    return [rng.choice(kinds)(i) for i in range(n)]


@pytest.mark.parametrize("seed", range(6))
def test_seen_ids_agree_with_a_set(seed):
    rng = random.Random(seed)
    ids = _ids(rng, 3000)
    seen, ref = SeenIds(), set()
    for number, rid in enumerate(ids, start=1):
        assert (rid in seen) == (rid in ref)
        seen.add(rid, number if rng.random() < 0.7 else 0)
        ref.add(rid)
        assert len(seen) == len(ref)
    probes = _ids(random.Random(seed + 100), 3000)
    assert all((p in seen) == (p in ref) for p in probes + ids)


def test_counted_ids_cost_bits_not_set_entries():
    seen = SeenIds()
    for i in range(100_000):
        seen.add(f"req-{i}", i + 1)
    assert len(seen) == 100_000 and not seen._others
    assert sum(len(f.bits) for f in seen._families.values()) <= 2 * 100_000 // 8  # bitmaps grow by doubling
