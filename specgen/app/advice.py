"""What to run, from a bench: the fastest method, k and batch size on the sample, its YAML for --config,
and why."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from specgen.config import DRAFTERS, Method, RunConfig
from specgen.io.bench_rows import BenchRow


@dataclass(frozen=True)
class Advice:
    method: str
    k: int | None  # num_speculative_tokens; None for none
    batch_size: int
    tok_s: float
    headline: str  # the choice, as one line
    why: str  # one line: what it gains of what was possible, or why no drafter pays
    yaml: str  # the `--config` file that runs it

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def advise(rows: Sequence[BenchRow], cfg: RunConfig) -> Advice | None:
    """The fastest row whose outputs were identical to the baseline's (None if no row has a rate). A drafter
    that verified no drafts ran as plain decoding (the controller found none that pays): its rate differs from
    none's by noise alone, so it is not a choice."""
    candidates = [r for r in rows if r.identical and r.tok_s and (r.k is None or r.summary.num_draft_tokens)]
    if not candidates:
        return None
    best = max(candidates, key=lambda r: r.tok_s)
    sizes = sorted({r.batch_size for r in rows})
    k = "" if best.k is None else f", k {best.k}"
    tried = f" (batch sizes tried: {', '.join(map(str, sizes))})" if len(sizes) > 1 else ""
    headline = (f"fastest on the sample: {best.method}{k}, batch {best.batch_size}, "
                f"{best.tok_s:.1f} tok/s{tried}")
    why = _why(best, [r for r in rows if r.batch_size == best.batch_size]) + _elsewhere(best, candidates)
    return Advice(best.method, best.k, best.batch_size, best.tok_s, headline, why,
                  config_yaml(cfg, Method(best.method), best.k, best.batch_size))


def _elsewhere(best: BenchRow, rows: Sequence[BenchRow]) -> str:
    """What pays at the other batch sizes (a job held to a smaller batch, for its memory): the best drafter
    over plain decoding at each, where one gains."""
    parts = []
    for size in sorted({r.batch_size for r in rows} - {best.batch_size}):
        gains = [r for r in rows if r.batch_size == size and r.method != Method.NONE.value
                 and (r.speedup_over_plain or 0) > 1]
        if gains:
            top = max(gains, key=lambda r: r.speedup_over_plain)
            parts.append(f"at batch {size} {top.label} gains {top.speedup_over_plain:.2f}x"
                         + _of_possible(top))
    return "".join(f"; {p}" for p in parts)


def _why(best: BenchRow, same_size: Sequence[BenchRow]) -> str:
    base = same_size[0]
    if best.method == Method.NONE.value:
        drafters = [r for r in same_size if r.method != Method.NONE.value and r.speedup_over_plain]
        if not drafters:
            return f"only plain decoding was benched at batch {best.batch_size}: run none"
        others = "; ".join(_versus_plain(r) for r in drafters)
        return f"no drafter pays at batch {best.batch_size}: run none ({others})"
    over = "none" if best.speedup_over_plain is not None else base.label
    gain = best.speedup_over_plain if best.speedup_over_plain is not None else best.speedup
    line = f"{best.label} gains {gain:.2f}x over {over} at batch {best.batch_size}" + _of_possible(best)
    if best.possible is not None:
        line += f", {best.possible.ceiling:.2f} tokens per step if verifying were free"
    positions = best.summary.per_position_acceptance
    if best.method != Method.NGRAM.value and positions:
        line += "; drafts accepted per position " + ", ".join(f"{p:.2f}" for p in positions)
    return line


def _versus_plain(row: BenchRow) -> str:
    if not row.summary.num_draft_tokens:
        return f"{row.label} verified no drafts"
    return f"{row.label} {row.speedup_over_plain:.2f}x" + ("" if row.possible is None else
                                                          f" of a possible {row.possible.oracle:.2f}x")


def _of_possible(row: BenchRow) -> str:
    if row.possible is None or row.of_oracle is None:
        return ""
    return f" of a possible {row.possible.oracle:.2f}x ({row.of_oracle:.0%} of the oracle bound)"


def config_yaml(cfg: RunConfig, method: Method, k: int | None, batch_size: int) -> str:
    """The YAML (sampling / engine / speculative, as settings.load_yaml reads it) that runs `method` with `k`
    drafts at most at `batch_size`, with the bench's other settings: the fields that differ from the defaults,
    and max_tokens."""
    sampling = {"max_tokens": cfg.sampling.max_tokens, **_changed(cfg.sampling)}
    engine = {**_changed(cfg.engine), "batch_size": batch_size}
    speculative: dict[str, Any] = {"method": method.value}
    if method is not Method.NONE:
        speculative["num_speculative_tokens"] = k
        speculative.update({k: v for k, v in _changed(cfg.spec).items()
                            if k not in ("method", "num_speculative_tokens",
                                         *(d.section for d in DRAFTERS.values() if d.section))})
        section = DRAFTERS[method].section
        if section and _changed(getattr(cfg.spec, section)):
            speculative[section] = _changed(getattr(cfg.spec, section))
    return yaml.safe_dump({"sampling": sampling, "engine": engine, "speculative": speculative},
                          sort_keys=False)


def _changed(obj: Any) -> dict[str, Any]:
    """A config dataclass's fields that differ from its defaults, as YAML values."""
    default = type(obj)()
    return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)
            if getattr(obj, f.name) != getattr(default, f.name)
            and not dataclasses.is_dataclass(getattr(obj, f.name))}


def _plain(value: Any) -> Any:
    if isinstance(value, Method):
        return value.value
    return list(value) if isinstance(value, tuple) else value
