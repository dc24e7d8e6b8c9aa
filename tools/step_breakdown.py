"""Where a training step's milliseconds go, from a lightcc timeline (rank 0's ``LCC_TIMELINE``).

    LCC_TIMELINE=/tmp/t.json python benchmarks/training.py --netns --models resmlp \\
        --configs lightcc:fp16 --rounds 1 --iters 20
    python tools/step_breakdown.py /tmp/t.json --skip 8

Per step (the N-th submission of every tensor track): the period from one step's first
gradient to the next one's (a whole step), backward as seen by the engine (first to last
gradient submitted), how late the first bucket starts, how much of backward the buckets are
busy (the wire could be), the tail from the last gradient to the last bucket's end (exposed
communication), and the codec phases of compressed buckets (``COMPRESS_SEND``, ``DECOMPRESS``,
...: Python/numba work on the thread that executes). Prints medians over the steps in ms.
"""
from __future__ import annotations

import argparse
import statistics
import sys

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from plot_timeline import load  # noqa: E402

COLLECTIVE = ("ALLREDUCE", "COMPRESSED_ALLREDUCE")
CODEC = ("COMPRESS", "COMPRESS_SEND", "DECOMPRESS", "DECOMPRESS_ACCUMULATE_RECOMPRESS")


def union(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of the union of ``intervals`` clipped to [lo, hi]."""
    total, end = 0.0, lo
    for a, b in sorted(intervals):
        a, b = max(a, end), min(b, hi)
        if b > a:
            total += b - a
            end = b
    return total


def breakdown(path: str, skip: int) -> list[dict]:
    _, tracks = load(path)
    tensors = {t: sorted(e["ts"] for e in ev if e["name"] == "QUEUE")
               for t, ev in tracks.items() if any(e["name"] == "QUEUE" for e in ev)}
    steps = min(len(v) for v in tensors.values())
    firsts = [min(v[i] for v in tensors.values()) for i in range(steps)]
    lasts = [max(v[i] for v in tensors.values()) for i in range(steps)]
    spans = [e for t, ev in tracks.items() for e in ev if e.get("ph") == "X"
             and (t.startswith("bucket") or t.startswith("link:"))]
    rows = []
    for i in range(skip, steps - 1):
        b0, b1, nxt = firsts[i], lasts[i], firsts[i + 1]
        mine = [e for e in spans if b0 <= e["ts"] < nxt]
        coll = [(e["ts"], e["ts"] + e["dur"]) for e in mine if e["name"] in COLLECTIVE]
        if not coll:
            continue
        end = max(b for _, b in coll)
        ends = [e["ts"] + e["dur"] for e in mine if e["name"] in ("UNPACK",)] or [end]
        rows.append({
            "period": (nxt - b0) / 1e3,
            "backward": (b1 - b0) / 1e3,
            "first_bucket_late": (min(a for a, _ in coll) - b0) / 1e3,
            "busy_in_backward": union(coll, b0, b1) / 1e3,
            "tail": (max(ends) - b1) / 1e3,
            "codec": sum(e["dur"] for e in mine if e["name"] in CODEC) / 1e3,
            "buckets": len(coll),
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--skip", type=int, default=5, help="steps to skip (warm-up)")
    args = ap.parse_args(argv)
    rows = breakdown(args.trace, args.skip)
    if not rows:
        print("no complete step with a collective in this trace", file=sys.stderr)
        return 1
    print(f"{len(rows)} steps, medians in ms:")
    for key in rows[0]:
        vals = [r[key] for r in rows]
        print(f"  {key:<18} {statistics.median(vals):8.1f}   (min {min(vals):.1f}, "
              f"max {max(vals):.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
