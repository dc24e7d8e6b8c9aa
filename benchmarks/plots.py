"""Plots of the benchmarks' tables, drawn with matplotlib (``pip install matplotlib``).

* :func:`plot_allreduce`: bus bandwidth against message size, one line per column of
  ``benchmarks/allreduce.py`` (lightcc, mpi4py, gloo, the line rate); ``allreduce.py --plot``.
* :func:`plot_training`: images/s per configuration and model of ``benchmarks/training.py``
  (its ``--json`` rows), as bars, with the bounds drawn as horizontal marks when given; meant
  for ``training.py --plot`` (not wired there yet) and usable from the command line on a saved
  ``--json`` file::

      python benchmarks/plots.py training results.json training.png

Each function returns what it drew (the x/y values of every line or bar), so a test can check
the picture against the table.
"""
from __future__ import annotations

import json
import statistics
import sys
from typing import Any

WIDTH_IN, HEIGHT_IN, DPI = 8.0, 5.0, 100     # every PNG is 800 x 500 pixels


def busbw(nbytes: int, seconds: float, nranks: int) -> float:
    """Bus bandwidth in GB/s: 2(n-1)/n * bytes / time (NCCL-tests' definition)."""
    return 2 * (nranks - 1) / nranks * nbytes / seconds / 1e9


def _figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt, plt.subplots(figsize=(WIDTH_IN, HEIGHT_IN), dpi=DPI)


def plot_allreduce(rows: list[tuple[int, dict[str, float], Any]], nranks: int, path: str,
                   title: str = "") -> dict[str, list[tuple[int, float]]]:
    """Bus bandwidth (GB/s) against size (log scale) for every column of ``rows``
    (``allreduce.py``'s ``(nbytes, {column: p50 seconds}, ratios)``); saves ``path``."""
    plt, (fig, ax) = _figure()
    drawn: dict[str, list[tuple[int, float]]] = {}
    columns = [c for c in rows[0][1]] if rows else []
    for col in columns:
        points = [(nbytes, busbw(nbytes, res[col], nranks)) for nbytes, res, _ in rows
                  if col in res]
        drawn[col] = points
        style = "-" if col.startswith("lightcc") else "--"
        ax.plot([p[0] for p in points], [p[1] for p in points], style, marker="o",
                markersize=3, label=col)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(title or f"allreduce float32 sum, {nranks} ranks")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return drawn


def training_medians(rows: list[dict]) -> dict[str, dict[str, float]]:
    """model -> config -> median images/s over rounds, from ``training.py --json`` rows."""
    values: dict[str, dict[str, list[float]]] = {}
    for r in rows:
        if "img_s" in r and "config" in r:
            values.setdefault(r["model"], {}).setdefault(r["config"], []).append(r["img_s"])
    return {m: {c: statistics.median(v) for c, v in cs.items()} for m, cs in values.items()}


def plot_training(rows: list[dict], path: str, bounds: dict[str, dict[str, float]] | None = None,
                  title: str = "") -> dict[str, dict[str, float]]:
    """Grouped bars of images/s (median over rounds) per model and configuration; ``bounds``
    (model -> {label: images/s}) adds a horizontal mark per bound. Saves ``path``."""
    plt, (fig, ax) = _figure()
    medians = training_medians(rows)
    models = list(medians)
    configs = sorted({c for cs in medians.values() for c in cs})
    width = 0.8 / max(1, len(configs))
    for i, config in enumerate(configs):
        xs = [m + (i - (len(configs) - 1) / 2) * width for m in range(len(models))]
        ys = [medians[model].get(config, 0.0) for model in models]
        ax.bar(xs, ys, width, label=config)
    for m, model in enumerate(models):
        for label, value in (bounds or {}).get(model, {}).items():
            ax.hlines(value, m - 0.45, m + 0.45, colors="black", linestyles=":")
            ax.annotate(label, (m + 0.45, value), fontsize=7, va="bottom", ha="right")
    ax.set_xticks(range(len(models)), models)
    ax.set_ylabel("images/s (all ranks, median over rounds)")
    ax.set_title(title or "training throughput per configuration")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return medians


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] != "training":
        print("usage: python benchmarks/plots.py training RESULTS.json OUT.png", file=sys.stderr)
        return 2
    with open(argv[1]) as fh:
        data = json.load(fh)
    plot_training(data["rows"] if isinstance(data, dict) else data, argv[2])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
