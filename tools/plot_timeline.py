"""Draw one training step of a lightcc timeline as a Gantt chart (PNG), without a browser.

    python tools/plot_timeline.py trace.json --step 3 --out docs/img/timeline.png

A "step" is the N-th round of every tensor track (its N-th QUEUE .. EXECUTE); the chart
shows the engine's cycle markers, the link tracks (``link:*``), the fusion buckets and up to
``--max-tensors`` tensor tracks over that step's time range, one colour per phase.
Needs matplotlib (``pip install matplotlib``).
"""
from __future__ import annotations

import argparse
import collections
import json
import sys

COLORS = {"QUEUE": "#c7c7c7", "NEGOTIATE": "#ffbb78", "EXECUTE": "#aec7e8", "PACK": "#98df8a",
          "ALLREDUCE": "#1f77b4", "COMPRESSED_ALLREDUCE": "#9467bd", "UNPACK": "#2ca02c",
          "REDUCE_SCATTER": "#d62728", "ALLGATHER": "#ff7f0e", "BROADCAST": "#8c564b",
          "ALLTOALL": "#e377c2"}


def load(path: str) -> tuple[dict[int, str], dict[str, list[dict]]]:
    text = open(path, encoding="utf-8").read().rstrip()
    if not text.endswith("]"):                  # a run that died before closing the file
        text = text.rstrip(",") + "]"
    events = json.loads(text)
    names = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    tracks: dict[str, list[dict]] = collections.defaultdict(list)
    for e in events:
        if e.get("ph") in ("X", "i"):
            tracks[names.get(e["tid"], str(e["tid"]))].append(e)
    return names, tracks


def step_window(tracks: dict[str, list[dict]], step: int) -> tuple[float, float]:
    """Time range (us) of the ``step``-th QUEUE..EXECUTE round of every tensor track."""
    lo, hi = float("inf"), 0.0
    for events in tracks.values():
        queue = sorted(e["ts"] for e in events if e["name"] == "QUEUE")
        execs = sorted(e["ts"] + e["dur"] for e in events if e["name"] == "EXECUTE")
        if len(queue) > step and len(execs) > step:
            lo, hi = min(lo, queue[step]), max(hi, execs[step])
    if hi == 0.0:
        raise SystemExit(f"no tensor has {step + 1} rounds in this trace")
    return lo, hi


def plot(path: str, step: int, out: str, max_tensors: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    _, tracks = load(path)
    lo, hi = step_window(tracks, step)
    pad = (hi - lo) * 0.02
    lo, hi = lo - pad, hi + pad
    links = sorted(t for t in tracks if t.startswith("link:"))
    buckets = sorted(t for t in tracks if t.startswith("bucket[")
                     and any(lo <= e["ts"] <= hi for e in tracks[t]))
    tensors = [t for t in tracks if t not in links and t not in buckets and t != "engine"
               and t.split("[")[0] != "bucket"
               and any(lo <= e["ts"] <= hi for e in tracks[t])][:max_tensors]
    rows = links + buckets + tensors
    fig, ax = plt.subplots(figsize=(12, 0.32 * len(rows) + 1.6))
    seen = set()
    for y, track in enumerate(rows):
        for e in tracks[track]:
            if e["ph"] != "X" or e["ts"] + e["dur"] < lo or e["ts"] > hi:
                continue
            color = COLORS.get(e["name"], "#7f7f7f")
            inner = e["name"] not in ("EXECUTE", "QUEUE", "NEGOTIATE") or track.startswith("bucket")
            height = 0.8 if not inner or track.startswith(("bucket", "link")) else 0.45
            ax.barh(y, (e["dur"]) / 1e3, left=(e["ts"] - lo) / 1e3, height=height, color=color,
                    label=e["name"] if e["name"] not in seen else None, edgecolor="none")
            seen.add(e["name"])
    for e in tracks.get("engine", []):
        if e["name"] == "CYCLE" and lo <= e["ts"] <= hi:
            ax.axvline((e["ts"] - lo) / 1e3, color="#bbbbbb", lw=0.6, ls=":", zorder=0)
    ax.set_yticks(range(len(rows)), [r if len(r) < 36 else r[:33] + "..." for r in rows],
                  fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step's first submission (dotted: engine cycles)")
    ax.set_title(f"lightcc timeline, rank 0, step {step}: {len(tensors)} of the tensor tracks, "
                 f"buckets and links")
    ax.legend(loc="lower right", fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace")
    p.add_argument("--step", type=int, default=2, help="which round (0-based)")
    p.add_argument("--out", default="timeline.png")
    p.add_argument("--max-tensors", type=int, default=16)
    args = p.parse_args(argv)
    plot(args.trace, args.step, args.out, args.max_tensors)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
