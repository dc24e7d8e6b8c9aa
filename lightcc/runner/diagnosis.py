"""What ended a job: prterun's banners and the rank wrappers' records, read into the
:class:`Failure` lccrun's last line names, and the elastic membership lines the ranks record."""
from __future__ import annotations

import json
import os
import re
import signal
import sys
from dataclasses import dataclass, replace
from pathlib import Path


@dataclass(frozen=True)
class Failure:
    """Why one rank ended the job."""

    rank: int
    kind: str          # "exit", "signal", "abort", "improper"
    code: int = 0      # exit code, signal number or MPI_Abort error code
    detail: str = ""   # e.g. "uncaught RuntimeError: boom"
    host: str = ""

    def describe(self) -> str:
        if self.kind == "signal":
            try:
                name = signal.Signals(self.code).name
            except ValueError:
                name = "unknown signal"
            text = f"rank {self.rank} killed by signal {self.code} ({name})"
        elif self.kind == "abort":
            text = f"rank {self.rank} called MPI_Abort with error code {self.code}"
        elif self.kind == "improper":
            text = f"rank {self.rank} exited without calling MPI finalize"
        else:
            text = f"rank {self.rank} exited with code {self.code}"
        if self.detail:
            text += f" ({self.detail})"
        if self.host:
            text += f" on host {self.host}"
        return text


_SIGNAL_RE = re.compile(r"process rank (\d+) with PID \d+ on node (\S+) exited on signal (\d+)")
_EXIT_RE = re.compile(r"The first process to do so was: Process name: \[[^\]]*?[,.](\d+)\] "
                      r"Exit code: (\d+)")
_ABORT_RE = re.compile(r"MPI_ABORT was invoked on rank (\d+) in communicator \S+ .*?"
                       r"Errorcode: (-?\d+)")
_IMPROPER_RE = re.compile(r"process rank (\d+) with PID \d+ on node (\S+) exiting improperly")


def parse_mpirun_output(text: str) -> list[tuple[int, Failure]]:
    """Failures named in prterun's banners, as (position in the text, failure)."""
    flat = " ".join(text.split())
    found: list[tuple[int, Failure]] = []
    for m in _SIGNAL_RE.finditer(flat):
        found.append((m.start(), Failure(int(m.group(1)), "signal", int(m.group(3)),
                                         host=m.group(2))))
    for m in _EXIT_RE.finditer(flat):
        found.append((m.start(), Failure(int(m.group(1)), "exit", int(m.group(2)))))
    for m in _ABORT_RE.finditer(flat):
        found.append((m.start(), Failure(int(m.group(1)), "abort", int(m.group(2)))))
    for m in _IMPROPER_RE.finditer(flat):
        found.append((m.start(), Failure(int(m.group(1)), "improper", host=m.group(2))))
    return sorted(found, key=lambda item: item[0])


def read_statuses(directory: str | None) -> list[dict]:
    """Status records the rank wrappers wrote, oldest first."""
    if not directory or not os.path.isdir(directory):
        return []
    records = []
    for path in Path(directory).glob("rank-*.json"):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return sorted(records, key=lambda r: r.get("time", 0.0))


def membership_lines(directory: str | None, seen: set[str]) -> list[str]:
    """One line per elastic membership change the ranks recorded (``elastic-<n>.json``, written
    by the new rank 0 after the survivors re-formed the group) and not yet in ``seen``."""
    if not directory or not os.path.isdir(directory):
        return []
    lines = []
    for path in sorted(Path(directory).glob("elastic-*.json"),
                       key=lambda p: int(p.stem.split("-")[1]) if p.stem.split("-")[1].isdigit()
                       else 0):
        if path.name in seen:
            continue
        try:
            rec = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        seen.add(path.name)
        took = f"group re-formed in {rec.get('seconds', 0):.2f} s"
        what = [f"{verb} {ranks_text(rec.get(key) or [])}" for key, verb in
                (("lost", "lost"), ("removed", "removed (host left)"), ("joined", "joined"))
                if rec.get(key)]
        if not what:
            lines.append(f"lccrun: elastic: hosts updated; the same {rec.get('size')} ranks "
                         f"continue, {took}")
            continue
        banned = "".join(f"; host {h} blacklisted after {rec.get('failures')} failed "
                         f"rank(s)" for h in rec.get("blacklisted") or [])
        lines.append(f"lccrun: elastic: {', '.join(what)} (launch numbering); "
                     f"{rec.get('size')} ranks continue, {took}{banned}")
    return lines


def ranks_text(ranks: list[int]) -> str:
    """``rank 3`` or ``ranks 3, 4``."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _from_status(record: dict) -> Failure:
    what = record.get("what", "")
    if record.get("signal"):
        return Failure(int(record["rank"]), "signal", int(record["signal"]))
    return Failure(int(record["rank"]), "exit", int(record["code"]),
                   detail="" if what == "sys.exit" else what)


def _launch_numbering(banners: list[Failure], statuses: list[dict]) -> list[Failure]:
    """prterun names a process that joined an elastic job (``MPI_Comm_spawn``) by its rank in
    its own spawned job; its wrapper's record (``job_rank``) gives its launch number. A banner
    rank that only a joined process's record explains is renamed to that launch number."""
    joined = {int(r["job_rank"]): int(r["rank"]) for r in statuses
              if "job_rank" in r and "rank" in r}
    launched = {int(r["rank"]) for r in statuses if "job_rank" not in r and "rank" in r}
    return [replace(f, rank=joined[f.rank])
            if f.rank in joined and f.rank not in launched else f for f in banners]


def diagnose(returncode: int, stderr_tail: str, statuses: list[dict]) -> list[Failure]:
    """Failures, the one that ended the job last. Empty if nothing failed.

    The rank named is one that failed on its own: a death by signal first, then the first rank
    in prterun's banners (the exits it saw first) whose wrapper did not record a mere
    *consequence* (an error saying another rank died), then the oldest record of a failure of
    its own; consequences only when nothing else is known. Which abort reached prterun first is
    a race under load; the records decide instead. A wrapper's record for the named rank adds
    its real exit code and exception.
    """
    by_rank = {int(r["rank"]): r for r in statuses if "rank" in r and "code" in r}
    secondary = {rank for rank, r in by_rank.items() if r.get("consequence")}
    banners = _launch_numbering([f for _, f in parse_mpirun_output(stderr_tail)], statuses)
    own = [r for r in statuses if int(r.get("rank", -1)) in by_rank and not r.get("consequence")]
    first = next((f for f in banners if f.kind == "signal"), None) or \
        next((f for f in banners if f.rank not in secondary), None)
    primary: Failure | None = None
    if first is None and own:
        primary = _from_status(own[0])
    elif first is None and banners:
        first = banners[0]
    if first is not None:
        if first.rank in by_rank and (first.kind != "signal" or "signal" in by_rank[first.rank]):
            primary = _from_status(by_rank[first.rank])
        else:
            primary = first
    elif primary is None and by_rank:
        primary = _from_status(statuses[0])
    if primary is None:
        return []
    others = [_from_status(r) for r in statuses if int(r["rank"]) != primary.rank]
    return [*others, primary]


def _summarise(returncode: int, tail: str, statuses: list[dict], received: list[int]) -> int:
    if received:
        name = signal.Signals(received[0]).name
        print(f"lccrun: interrupted by {name}; all ranks were stopped", file=sys.stderr)
        return 128 + received[0]
    failures = diagnose(returncode, tail, statuses)
    if returncode == 0 and not failures:
        return 0
    if not failures:
        print(f"lccrun: mpirun exited with code {returncode} and named no failed rank "
              f"(see its messages above)", file=sys.stderr)
        return returncode if returncode > 0 else 1
    for extra in failures[:-1]:
        print(f"lccrun: also {extra.describe()}", file=sys.stderr)
    print(f"lccrun: {failures[-1].describe()}", file=sys.stderr)
    if returncode > 0:
        return returncode
    return 128 - returncode if returncode < 0 else 1
