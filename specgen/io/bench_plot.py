"""A bench as a picture: tok/s per method and batch size beside its oracle bound (left), and how often each
draft position was accepted (right)."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from specgen.errors import ConfigError
from specgen.io.bench_rows import BenchRow


def plot_bench(rows: Sequence[BenchRow], png_path: Path, title: str = "specgen bench") -> None:
    """Bars: each row's output tok/s, grouped by batch size; a black tick over a bar: the rate its oracle
    bound allows (plain decoding's rate x the bound). Lines: per draft position, accepted drafts per decode
    step."""
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    sizes = sorted({r.batch_size for r in rows})
    methods = list(dict.fromkeys(r.label for r in rows))
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    width = 0.8 / len(methods)
    bound_label = "oracle bound"
    for j, method in enumerate(methods):
        for i, size in enumerate(sizes):
            row = next((r for r in rows if r.label == method and r.batch_size == size), None)
            if row is None or not row.tok_s:
                continue
            x = i + (j - (len(methods) - 1) / 2) * width
            left.bar(x, row.tok_s, width, color=f"C{j}", label=method if i == 0 else None)
            if row.possible is not None and row.speedup_over_plain:
                bound = row.tok_s / row.speedup_over_plain * row.possible.oracle
                left.plot([x - width / 2, x + width / 2], [bound, bound], color="black", lw=2,
                          label=bound_label)
                bound_label = None
    left.set_xticks(range(len(sizes)), [f"batch {s}" for s in sizes])
    left.set(ylabel="output tokens/s", title="rate per method (black: its oracle bound)")
    left.set_ylim(0, left.get_ylim()[1] * 1.3)  # room for the legend above the bars
    left.legend(fontsize=8, loc="upper left", ncol=2)
    drew = False
    for j, method in enumerate(methods):
        for size in sizes:
            row = next((r for r in rows if r.label == method and r.batch_size == size), None)
            positions = [] if row is None else row.summary.per_position_acceptance
            if positions:
                right.plot(range(1, len(positions) + 1), positions, marker="o", color=f"C{j}",
                           ls="-" if size == sizes[0] else "--", label=f"{method}, batch {size}")
                drew = True
    right.xaxis.get_major_locator().set_params(integer=True)
    right.set(xlabel="draft position", ylabel="accepted per decode step",
              title="acceptance per draft position", ylim=(0, 1))
    if drew:
        right.legend(fontsize=8)
    for ax in (left, right):
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    try:
        fig.savefig(png_path, dpi=80)
    except OSError as exc:
        raise ConfigError(f"{png_path}: cannot write the plot ({exc})") from None
    finally:
        plt.close(fig)
