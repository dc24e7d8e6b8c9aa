"""One timeline for the job: the ranks' files merged into one Perfetto file, and a per-rank table.

Every rank writes its own file (``path`` on rank 0, ``path.rank<N>`` elsewhere; ``pid`` is the
rank, and each file names its process ``rank N``), so merging is reading them all and writing
one JSON array. Big runs stay loadable: at most ``MAX_EVENTS`` events are kept, shared evenly
among the ranks; a rank over its share keeps its earliest events (metadata always), and the
merged file ends with a ``lightcc_merge`` event counting what was left out.

:func:`summary` reads the merged events into one row per rank: negotiation wait, wire time and
pack/unpack time, each the wall time covered by the union of those spans (overlapping spans
of several tensors count once), in ms.
"""
from __future__ import annotations

import glob
import json
import os
import re
from typing import Any

MAX_EVENTS = 2_000_000          # events kept in the merged file (Perfetto loads this size)
WIRE_PHASES = {"ALLREDUCE", "COMPRESSED_ALLREDUCE", "ALLGATHER", "BROADCAST", "ALLTOALL",
               "REDUCESCATTER", "DIRECT_ALLREDUCE"}


def read_events(path: str) -> list[dict]:
    """The events of one rank's file; a file cut short (a rank that died) loses only its
    unfinished last line."""
    events = []
    with open(path) as fh:
        for line in fh:
            line = line.strip().rstrip(",")
            if line in ("", "[", "]"):
                continue
            try:
                events.append(json.loads(line))
            except ValueError:
                continue
    return events


def rank_files(path: str) -> list[str]:
    """``path`` and its ``path.rank<N>`` siblings that exist, by rank."""
    others = [p for p in glob.glob(glob.escape(path) + ".rank*")
              if re.fullmatch(r"\d+", p[len(path) + 5:])]
    files = ([path] if os.path.exists(path) else []) + \
        sorted(others, key=lambda p: int(p[len(path) + 5:]))
    return files


def merge(path: str, max_events: int = MAX_EVENTS, remove_parts: bool = True) -> dict[str, Any]:
    """Merge ``path`` and ``path.rank<N>`` into ``path``; returns {ranks, events, dropped}."""
    files = rank_files(path)
    per_rank = [read_events(f) for f in files]
    share = max(1, max_events // max(1, len(per_rank)))
    kept: list[dict] = []
    dropped = 0
    for events in per_rank:
        meta = [e for e in events if e.get("ph") == "M"]
        rest = [e for e in events if e.get("ph") != "M"]
        keep = rest[:max(0, share - len(meta))]
        dropped += len(rest) - len(keep)
        kept += meta + keep
    if dropped:
        kept.append({"name": "lightcc_merge", "ph": "i", "s": "g", "pid": 0, "tid": 0,
                     "ts": max((e.get("ts", 0) for e in kept), default=0),
                     "args": {"dropped_events": dropped, "max_events": max_events}})
    tmp = f"{path}.merging"
    with open(tmp, "w") as fh:
        fh.write("[\n")
        fh.write(",\n".join(json.dumps(e, separators=(",", ":")) for e in kept))
        fh.write("\n]\n")
    os.replace(tmp, path)
    if remove_parts:
        for f in files[1:]:
            os.remove(f)
    return {"ranks": len(files), "events": len(kept), "dropped": dropped}


def _union_ms(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total / 1000.0


def summary(events: list[dict]) -> list[dict[str, Any]]:
    """One row per rank: ``rank``, ``collectives``, ``negotiate_ms``, ``wire_ms``,
    ``pack_ms`` (the union of those spans), ``span_ms`` (first to last event)."""
    tracks = {(e.get("pid"), e.get("tid")): str((e.get("args") or {}).get("name", ""))
              for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}
    ranks: dict[int, dict[str, list]] = {}
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        r = ranks.setdefault(int(e.get("pid", 0)), {"neg": [], "wire": [], "pack": [],
                                                     "all": [], "n": []})
        iv = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        r["all"].append(iv)
        name = e.get("name")
        if name == "NEGOTIATE":
            r["neg"].append(iv)
            r["n"].append(1)
        elif name in WIRE_PHASES and \
                not tracks.get((e.get("pid"), e.get("tid")), "").startswith("link:"):
            r["wire"].append(iv)
        elif name in ("PACK", "UNPACK"):
            r["pack"].append(iv)
    rows = []
    for rank in sorted(ranks):
        r = ranks[rank]
        span = (max(b for _, b in r["all"]) - min(a for a, _ in r["all"])) / 1000.0
        rows.append({"rank": rank, "collectives": len(r["n"]),
                     "negotiate_ms": _union_ms(r["neg"]), "wire_ms": _union_ms(r["wire"]),
                     "pack_ms": _union_ms(r["pack"]), "span_ms": span})
    return rows


def table(rows: list[dict[str, Any]]) -> list[str]:
    """The summary as aligned text lines (what lccrun prints after the job)."""
    out = ["rank  collectives  negotiation wait ms  wire ms  pack+unpack ms  traced ms"]
    for r in rows:
        out.append(f"{r['rank']:>4}  {r['collectives']:>11}  {r['negotiate_ms']:>19.1f}  "
                   f"{r['wire_ms']:>7.1f}  {r['pack_ms']:>14.1f}  {r['span_ms']:>9.1f}")
    return out
