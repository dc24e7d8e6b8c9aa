"""One timeline for the job: the ranks' files merged into one Perfetto file, and a per-rank table.

Every rank writes its own file (``path`` on rank 0, ``path.rank<N>`` elsewhere; ``pid`` is the
rank, and each file names its process ``rank N``), so merging is reading them all and writing
one JSON array. Big runs stay loadable: at most ``MAX_EVENTS`` events are kept, shared evenly
among the ranks; a rank over its share keeps its earliest events (metadata always), and the
merged file ends with a ``lightcc_merge`` event counting what was left out.

:func:`summary` reads the merged events into one row per rank: negotiation wait, wire time and
pack/unpack time, each the wall time covered by the union of those spans (overlapping spans
of several tensors count once), in ms. :func:`steps` gives one row per training step (the
torch layer marks steps on each rank's ``step`` track) and :func:`step_table` prints them,
the first and last :data:`STEP_ROWS_SHOWN` of a long run.
"""
from __future__ import annotations

import bisect
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
    complete_until = None      # every event that starts before this was kept, on every rank
    for events in per_rank:
        meta = [e for e in events if e.get("ph") == "M"]
        rest = [e for e in events if e.get("ph") != "M"]
        keep = rest[:max(0, share - len(meta))]
        dropped += len(rest) - len(keep)
        kept += meta + keep
        cut = min((e.get("ts", 0) for e in rest[len(keep):]), default=None)
        if cut is not None:
            complete_until = cut if complete_until is None else min(complete_until, cut)
    if dropped:
        kept.append({"name": "lightcc_merge", "ph": "i", "s": "g", "pid": 0, "tid": 0,
                     "ts": max((e.get("ts", 0) for e in kept), default=0),
                     "args": {"dropped_events": dropped, "max_events": max_events,
                              "complete_until_ts": complete_until}})
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


def _track_names(events: list[dict]) -> dict[tuple, str]:
    return {(e.get("pid"), e.get("tid")): str((e.get("args") or {}).get("name", ""))
            for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"}


def _is_wire(e: dict, tracks: dict[tuple, str]) -> bool:
    """A bucket's or tensor's wire phase (the ``link:`` tracks repeat them per call)."""
    return e.get("name") in WIRE_PHASES and \
        not tracks.get((e.get("pid"), e.get("tid")), "").startswith("link:")


def summary(events: list[dict]) -> list[dict[str, Any]]:
    """One row per rank: ``rank``, ``collectives``, ``negotiate_ms``, ``wire_ms``,
    ``pack_ms`` (the union of those spans), ``span_ms`` (first to last event)."""
    tracks = _track_names(events)
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
        elif _is_wire(e, tracks):
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


# ---- per training step --------------------------------------------------------------------------
STEP_ROWS_SHOWN = 5     # the per-step table prints the first and the last this many steps


class _RankStep:
    """What one rank did inside one step's window (start, end], times in µs."""

    def __init__(self, start: float, end: float) -> None:
        self.start, self.end = start, end
        self.sync_from: float | None = None     # step() began waiting for the reductions
        self.first_grad: float | None = None    # first submission (the first gradient)
        self.neg: list[tuple[float, float]] = []
        self.wire: list[tuple[float, float]] = []

    def clipped(self, intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
        return _union_ms([(max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi])


def _step_windows(events: list[dict], tracks: dict[tuple, str]) -> dict[int, dict[int, _RankStep]]:
    """rank -> step -> its window, from the ``step`` track's ``STEP`` and ``SYNCHRONIZE`` spans."""
    wins: dict[int, dict[int, _RankStep]] = {}
    syncs: dict[tuple[int, int], float] = {}
    for e in events:
        if e.get("ph") != "X" or tracks.get((e.get("pid"), e.get("tid"))) != "step":
            continue
        rank, step = int(e.get("pid", 0)), (e.get("args") or {}).get("step")
        if not isinstance(step, int):
            continue
        if e.get("name") == "STEP":
            ts = float(e["ts"])
            wins.setdefault(rank, {})[step] = _RankStep(ts, ts + float(e["dur"]))
        elif e.get("name") == "SYNCHRONIZE":
            syncs[(rank, step)] = float(e["ts"])
    for (rank, step), ts in syncs.items():
        if step in wins.get(rank, {}):
            wins[rank][step].sync_from = ts
    return wins


def steps(events: list[dict]) -> list[dict[str, Any]]:
    """One row per training step that every rank marked (``DistributedOptimizer.step()``
    writes ``STEP``/``SYNCHRONIZE`` spans on each rank's ``step`` track; a step's window runs
    from the previous step's end to its own, so the first step has no row). Per rank a span
    counts in the windows it overlaps, clipped to them; each time is the union of spans, ms:

    ``step_ms`` window; ``to_grad_ms`` window start -> the step's first submission (with
    DistributedOptimizer its first gradient; before it: the optimizer's update, data, forward,
    the start of backward); ``backward_ms`` first submission -> ``step()`` (both None when a
    rank submitted nothing before ``step()``); ``negotiate_min_ms``/``_max_ms`` and
    their ``_rank`` (``NEGOTIATE`` spans); ``wire_ms``; ``exposed_ms`` the wait in ``step()``
    for the reductions (``SYNCHRONIZE``) — each the slowest rank's except negotiation;
    ``overlap_pct``: the share of all ranks' wire time that ran during their backward."""
    tracks = _track_names(events)
    wins = _step_windows(events, tracks)
    if not wins:
        return []
    complete_until = min((float(e["args"]["complete_until_ts"]) for e in events
                          if e.get("name") == "lightcc_merge"
                          and (e.get("args") or {}).get("complete_until_ts") is not None),
                         default=float("inf"))
    ordered = {r: sorted(w.values(), key=lambda x: x.start) for r, w in wins.items()}
    starts = {r: [x.start for x in ws] for r, ws in ordered.items()}
    for e in events:
        if e.get("ph") != "X" or "dur" not in e or int(e.get("pid", 0)) not in ordered:
            continue
        name = e.get("name")
        kind = "neg" if name == "NEGOTIATE" else "queue" if name == "QUEUE" else \
            "wire" if _is_wire(e, tracks) else None
        if kind is None:
            continue
        rank = int(e["pid"])
        a = float(e["ts"])
        b = a + float(e["dur"])
        ws = ordered[rank]
        i = max(0, bisect.bisect_right(starts[rank], a) - 1)
        if kind == "queue":       # submitted inside (start, step()]: a gradient of this step
            for w in ws[max(0, i - 1):i + 1]:
                if w.start < a <= (w.sync_from if w.sync_from is not None else w.end) and \
                        (w.first_grad is None or a < w.first_grad):
                    w.first_grad = a
            continue
        while i < len(ws) and ws[i].start < b:
            w = ws[i]
            if a < w.end:
                (w.neg if kind == "neg" else w.wire).append((a, b))
            i += 1
    common = set.intersection(*(set(w) for w in wins.values()))
    rows = []
    for step in sorted(common):
        per = {r: wins[r][step] for r in sorted(wins)}
        if any(w.end > complete_until or w.sync_from is None for w in per.values()):
            continue
        rows.append(_step_row(step, per))
    return rows


def _step_row(step: int, per: dict[int, _RankStep]) -> dict[str, Any]:
    neg = {r: w.clipped(w.neg, w.start, w.end) for r, w in per.items()}
    grads = all(w.first_grad is not None for w in per.values())
    wire_total = overlapped = 0.0
    for w in per.values():
        wire_total += w.clipped(w.wire, w.start, w.end)
        if w.first_grad is not None:
            overlapped += w.clipped(w.wire, w.first_grad, w.sync_from)
    low = min(neg, key=lambda r: (neg[r], r))
    high = max(neg, key=lambda r: (neg[r], -r))
    return {"step": step, "ranks": len(per),
            "step_ms": max(w.end - w.start for w in per.values()) / 1000.0,
            "to_grad_ms": max(w.first_grad - w.start for w in per.values()) / 1000.0
            if grads else None,
            "backward_ms": max(w.sync_from - w.first_grad for w in per.values()) / 1000.0
            if grads else None,
            "negotiate_min_ms": neg[low], "negotiate_min_rank": low,
            "negotiate_max_ms": neg[high], "negotiate_max_rank": high,
            "wire_ms": max(w.clipped(w.wire, w.start, w.end) for w in per.values()),
            "exposed_ms": max(w.end - w.sync_from for w in per.values()) / 1000.0,
            "overlap_pct": 100.0 * overlapped / wire_total if wire_total > 0 else None}


def step_table(rows: list[dict[str, Any]], shown: int = STEP_ROWS_SHOWN) -> list[str]:
    """The per-step rows as text lines; more than 2 x ``shown`` steps: the first and last
    ``shown`` and a line saying how many were left out."""
    def ms(v: float | None, width: int) -> str:
        return f"{'-':>{width}}" if v is None else f"{v:>{width}.1f}"

    out = ["step  step ms  to 1st grad ms  backward ms  negotiation wait ms min / max  "
           "wire ms  exposed ms  overlap %"]
    picked = rows if len(rows) <= 2 * shown else rows[:shown] + [None] + rows[-shown:]
    for r in picked:
        if r is None:
            out.append(f"... {len(rows) - 2 * shown} steps left out (the first and last {shown} "
                       f"are shown; the merged file has them all)")
            continue
        neg = (f"{r['negotiate_min_ms']:.1f} (rank {r['negotiate_min_rank']}) / "
               f"{r['negotiate_max_ms']:.1f} (rank {r['negotiate_max_rank']})")
        overlap = "-" if r["overlap_pct"] is None else f"{r['overlap_pct']:.0f}"
        out.append(f"{r['step']:>4}  {r['step_ms']:>7.1f}  {ms(r['to_grad_ms'], 14)}  "
                   f"{ms(r['backward_ms'], 11)}  {neg:>29}  {r['wire_ms']:>7.1f}  "
                   f"{r['exposed_ms']:>10.1f}  {overlap:>9}")
    return out
