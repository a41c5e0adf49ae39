"""loss.csv -> loss.png: training loss and held-out loss on the left, accuracies on the right."""
from __future__ import annotations

import csv
from pathlib import Path


def _column(rows: list[dict[str, str]], name: str) -> tuple[list[int], list[float]]:
    pts = [(int(r["step"]), float(r[name])) for r in rows if r.get(name) not in (None, "")]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_loss(csv_path: Path, png_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, label in (("loss", "train objective (training vocabulary)"),
                        ("eval_loss", "held-out (full vocabulary)")):
        left.plot(*_column(rows, name), marker="." if name.startswith("eval") else None, label=label)
    left.set(xlabel="step", ylabel="cross-entropy", title="loss")
    for name, label in (("acc", "train top-1"), ("eval_acc", "held-out top-1 (~ position-1 acceptance)"),
                        ("acc2", "train second draft, given the first"),
                        ("eval_acc2", "held-out both drafts (~ position 2)")):
        xs, ys = _column(rows, name)
        if xs:
            right.plot(xs, ys, marker="." if name.startswith("eval") else None, label=label)
    right.set(xlabel="step", ylabel="accuracy", title="accuracy", ylim=(0, 1))
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
