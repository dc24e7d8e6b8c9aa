"""lccrun's side of the flight recorder (lightcc/common/observability/flight.py): find the
ranks that registered (``rank<N>.pid``, signalled by supervise.request_records), read
``rank<N>.json`` and print one summary naming the rank that is behind, the collective it never
reached, and where each rank's waiting thread is."""
from __future__ import annotations

import glob
import json
import os
import re

STACK_LINES = 4        # innermost frames outside lightcc printed per rank
#: lightcc's own code: this installation's package folder (not any folder named lightcc: a
#: checkout or a user's project called that holds user code), or an installed copy elsewhere
_LIB = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,
        os.sep + os.path.join("site-packages", "lightcc") + os.sep)
_STDLIB = os.path.dirname(os.__file__) + os.sep


def rank_pids(directory: str | None) -> list[int]:
    """The pids the ranks registered in ``directory`` (``rank<N>.pid``)."""
    pids = []
    for path in glob.glob(os.path.join(directory, "rank*.pid")) if directory else []:
        try:
            with open(path) as f:
                pids.append(int(f.read().strip()))
        except (OSError, ValueError):
            continue
    return pids


def read_records(directory: str | None) -> dict[int, dict]:
    """rank -> its record document (unreadable or half-written files are skipped)."""
    found: dict[int, dict] = {}
    for path in glob.glob(os.path.join(directory or "", "rank*.json")) if directory else []:
        if not re.fullmatch(r"rank\d+\.json", os.path.basename(path)):
            continue
        try:
            with open(path) as f:
                doc = json.load(f)
            found[int(doc["rank"])] = doc
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return found


def _describe(rec: dict) -> str:
    shape = "x".join(str(n) for n in rec["shape"]) or "scalar"
    pset = f", process set {rec['pset']}" if rec["pset"] else ""
    return f"{rec['coll']} '{rec['name']}' ({rec['dtype'] or '?'} {shape}{pset})"


def _waiting_stack(doc: dict, rec: dict | None) -> list[str]:
    """The innermost frames of the thread that submitted ``rec`` (else the main thread)."""
    threads = doc.get("threads", {})
    chosen = threads.get(str(rec["thread"])) if rec else None
    if chosen is None:
        chosen = next((t for t in threads.values() if t.get("name") == "MainThread"), None)
    if chosen is None:
        return []
    frames = list(chosen["stack"])
    user = [i for i, f in enumerate(frames) if not _library(f)]
    if not user:
        return []
    inside = len(frames) - 1 - user[-1]      # lightcc / standard library frames below it
    lines = "".join(frames[:user[-1] + 1][-STACK_LINES:]).rstrip("\n").splitlines()
    more = [f"      ... {inside} frame(s) inside lightcc and the standard library"] \
        if inside else []
    return [f"      {line}" for line in lines] + more


def _library(frame: str) -> bool:
    """Whether a formatted stack entry is lightcc's own code or Python's (not the user's)."""
    path = frame.split('"')[1] if frame.count('"') >= 2 else ""
    return (any(lib in path for lib in _LIB) or path.startswith((_STDLIB, "<frozen"))
            or not path)


def summarize(docs: dict[int, dict], size: int | None = None) -> list[str]:
    """The summary's lines (empty when there is no record at all)."""
    if not docs:
        return []
    size = size or max(int(d.get("size", 0)) for d in docs.values())
    lines = [f"lccrun: flight recorder: records from {len(docs)} of {size} ranks"]
    pending: dict[tuple, list[int]] = {}       # (pset, coll, name) -> ranks waiting in it
    seen: dict[int, set] = {}
    first_pending: dict[int, dict] = {}
    for rank, doc in sorted(docs.items()):
        recs = doc.get("records", [])
        seen[rank] = {(r["pset"], r["coll"], r["name"]) for r in recs}
        waiting = [r for r in recs if r["state"] in ("pending", "stalled")]
        for r in waiting:
            pending.setdefault((r["pset"], r["coll"], r["name"]), []).append(rank)
        last = waiting[0] if waiting else (recs[-1] if recs else None)
        if waiting:
            first_pending[rank] = waiting[0]
            state = f"waiting {waiting[0]['age_s']:.1f} s in {_describe(waiting[0])}"
        elif last is not None:
            state = f"nothing pending; last {_describe(last)} ({last['state']})"
        else:
            state = "no collective recorded"
        lines.append(f"  rank {rank} [{doc.get('reason', '')[:120]}]: {state}")
        lines += _waiting_stack(doc, waiting[0] if waiting else None)
    silent = [r for r in range(size) if r not in docs]
    if silent:
        lines.append(f"  rank(s) {', '.join(map(str, silent))}: no record (dead, stopped, or "
                     f"stuck outside Python)")
    # behind = a rank that never submitted a collective others wait in (oldest such first)
    blamed = False
    late: str | None = None
    for key, waiters in sorted(pending.items(),
                               key=lambda kv: min(first_pending[r]["seq"] for r in kv[1]
                                                  if r in first_pending)):
        members = range(size) if key[0] == 0 else \
            [r for r in docs if any(k[0] == key[0] for k in seen[r])]   # members unknown
        missing = [r for r in members if r not in waiters and
                   (r not in docs or key not in seen.get(r, set()))]
        if not missing:
            late = late or _late_arrival(key, waiters, docs)
            continue
        rec = next(r for r in docs[waiters[0]]["records"]
                   if (r["pset"], r["coll"], r["name"]) == key)
        lines.append(f"lccrun: rank {', '.join(map(str, missing))} is behind: never reached "
                     f"{_describe(rec)}, which rank(s) {', '.join(map(str, waiters))} wait in")
        blamed = True
        break
    if not blamed and late:
        lines.append(late)
    elif not blamed and pending:
        lines.append("lccrun: every rank that wrote a record submitted the collectives others "
                     "wait in (the wait is in the data plane, not a missing rank)")
    return lines


#: a rank that submitted a collective this much later than the first rank is named as late
LATE_S = 1.0


def _late_arrival(key: tuple, waiters: list[int], docs: dict[int, dict]) -> str | None:
    """Every member submitted ``key``, but one long after the others (it was busy elsewhere
    while they waited, e.g. stopped and resumed): the line naming it, or None."""
    when = {}
    for rank in waiters:
        rec = next((r for r in docs[rank]["records"]
                    if (r["pset"], r["coll"], r["name"]) == key), None)
        if rec is not None and rec.get("submitted") is not None:
            when[rank] = float(rec["submitted"])
    if len(when) < 2:
        return None
    first, last = min(when, key=when.get), max(when, key=when.get)
    gap = when[last] - when[first]
    if gap < LATE_S:
        return None
    rec = next(r for r in docs[last]["records"] if (r["pset"], r["coll"], r["name"]) == key)
    return (f"lccrun: rank {last} was late: reached {_describe(rec)} {gap:.1f} s after rank "
            f"{first}, while the others waited in it")


if __name__ == "__main__":       # python -m lightcc.runner.flight_summary DIR (plain mpirun)
    import sys

    if len(sys.argv) != 2:
        sys.exit("usage: python -m lightcc.runner.flight_summary LCC_FLIGHT_DIR")
    print("\n".join(summarize(read_records(sys.argv[1]))) or "no flight records there")
