"""Run ``mpirun`` under supervision and say which rank failed.

Open MPI 5's ``prterun`` already ends the job when a rank exits non-zero or dies from a signal,
and prints a banner naming it. lccrun builds on that:

* ``mpirun`` runs in its own session, so a terminal Ctrl-C reaches only lccrun, which forwards
  SIGINT to ``prterun`` (it kills every rank) and, if the job is still there after a grace
  period, SIGKILLs ``prterun`` and every process below it;
* its stderr passes through lccrun, which keeps the tail to read prterun's banner;
* Python ranks run under :mod:`~lightcc.runner._rankwrap`, which writes the exit code and
  exception of a failing rank to a status directory before aborting;
* a watchdog ends the job if a rank failed (status record or prterun banner) but the job is
  still running 3 s later (e.g. a rank's child process keeps prterun's output pipes open);
  records that only report another rank's failure (consequences) count after the
  ``CONSEQUENCE_WAIT_S`` their ranks wait for the cause.

The last line lccrun prints names the failed rank: ``lccrun: rank 1 exited with code 3`` or
``lccrun: rank 0 killed by signal 9 (SIGKILL)``.
"""
from __future__ import annotations

import collections
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

from .._exit import CONSEQUENCE_WAIT_S
from .flight_summary import rank_pids, read_records, summarize

TAIL_BYTES = 64 * 1024
INTERRUPT_GRACE_S = 4.0     # after forwarding Ctrl-C, wait this long before SIGKILL
USR1_SUMMARY_WAIT_S = 2.0   # SIGUSR1 to lccrun: the ranks' records are read this much later
FAILURE_GRACE_S = 3.0       # a rank failed: stop the job if it is still running then
TERM_GRACE_S = 1.5          # after SIGTERM to mpirun, wait this long before SIGKILL
SCAN_INTERVAL_S = 2.0       # how often to note the processes below mpirun


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


# ---------------------------------------------------------------- reading what happened
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
        what = [f"{verb} {_ranks(rec.get(key) or [])}" for key, verb in
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


def _ranks(ranks: list[int]) -> str:
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


# ---------------------------------------------------------------- process tree
def _stat(pid: int | str) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of a process, from /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), int(fields[19])


def descendants(pid: int) -> dict[int, int]:
    """Every process below ``pid`` -> its start time (Linux /proc; empty elsewhere)."""
    children: dict[int, list[tuple[int, int]]] = collections.defaultdict(list)
    try:
        entries = os.listdir("/proc")
    except OSError:
        return {}
    for entry in entries:
        if entry.isdigit():
            st = _stat(entry)
            if st is not None:
                children[st[0]].append((int(entry), st[1]))
    out: dict[int, int] = {}
    todo = [pid]
    while todo:
        for child, start in children.get(todo.pop(), []):
            out[child] = start
            todo.append(child)
    return out


def kill_tree(pid: int | None, known: dict[int, int] | None = None) -> list[int]:
    """SIGKILL ``pid`` (None: already reaped), every process below it, and the ``known``
    (pid -> start time) ones that still exist; returns the pids signalled."""
    targets = {**(known or {}), **(descendants(pid) if pid is not None else {})}
    if pid is not None:
        _signal(pid, signal.SIGKILL)
    return signal_verified(targets, signal.SIGKILL)


def signal_verified(targets: dict[int, int], sig: int) -> list[int]:
    """Send ``sig`` to each pid of ``targets`` (pid -> start time) that is still that process;
    returns the pids signalled."""
    hit = []
    for target, start in targets.items():
        st = _stat(target)
        if st is None or st[1] != start:
            continue  # gone, or the pid now belongs to an unrelated process
        try:
            os.kill(target, sig)
            hit.append(target)
        except (ProcessLookupError, PermissionError):
            pass
    return hit


def request_records(directory: str | None, known: dict[int, int]) -> list[int]:
    """SIGUSR1 to every rank process that registered in the flight recorder's ``directory``
    (``rank<N>.pid``) and is one of lccrun's descendants (``known``); the pids signalled."""
    return signal_verified({pid: known[pid] for pid in rank_pids(directory) if pid in known},
                           signal.SIGUSR1)


def become_subreaper() -> bool:
    """Adopt orphaned descendants (Linux PR_SET_CHILD_SUBREAPER), so that a rank's child
    that outlives its rank is still found and stopped when the job fails."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER = 36
    except (OSError, AttributeError):
        return False


def _reap(pids: list[int]) -> None:
    """Collect the exit status of adopted processes we killed (no zombies left behind)."""
    deadline = time.monotonic() + 1.0
    pending = set(pids)
    while pending and time.monotonic() < deadline:
        for pid in list(pending):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:   # not our child: init or its parent reaps it
                pending.discard(pid)
                continue
            if done:
                pending.discard(pid)
        if pending:
            time.sleep(0.02)


# ---------------------------------------------------------------- running
class _Tail:
    """Copy a pipe to our stderr while keeping its last bytes."""

    def __init__(self, stream) -> None:
        self.buf: collections.deque[bytes] = collections.deque()
        self.size = self.total = 0
        self._checked = 0
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._pump, args=(stream,), daemon=True)
        self.thread.start()

    def _pump(self, stream) -> None:
        out = getattr(sys.stderr, "buffer", None)
        fd = stream.fileno()
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            try:
                if out is not None:
                    out.write(chunk)
                    out.flush()
                else:
                    sys.stderr.write(chunk.decode(errors="replace"))
            except (OSError, ValueError):
                pass
            with self.lock:
                self.buf.append(chunk)
                self.size += len(chunk)
                self.total += len(chunk)
                while self.size > TAIL_BYTES and len(self.buf) > 1:
                    self.size -= len(self.buf.popleft())

    def text(self) -> str:
        with self.lock:
            return b"".join(self.buf).decode(errors="replace")

    def ends_with_newline(self) -> bool:
        with self.lock:
            return not self.buf or self.buf[-1].endswith(b"\n")

    def reports_failure(self) -> bool:
        """Whether prterun has printed a banner naming a failed rank (checked on new output)."""
        if self.total == self._checked:
            return False
        self._checked = self.total
        return bool(parse_mpirun_output(self.text()))


def supervise(argv: list[str], env: dict[str, str], status_dir: str | None,
              interrupt_grace_s: float = INTERRUPT_GRACE_S,
              failure_grace_s: float = FAILURE_GRACE_S, flight_dir: str | None = None,
              discovery=None) -> int:
    """Run ``argv``; return lccrun's exit code after printing the failure summary if any."""
    received: list[int] = []

    def on_signal(signum, _frame) -> None:
        received.append(signum)

    asked: list[float] = []      # SIGUSR1 to lccrun: when each summary was asked for

    def on_usr1(_signum, _frame) -> None:
        asked.append(time.monotonic())

    handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in handled:
            previous[sig] = signal.signal(sig, on_signal)
        if flight_dir:
            previous[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, on_usr1)
    become_subreaper()
    before = set(descendants(os.getpid()))  # our own, unrelated children are never touched
    try:
        proc = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, start_new_session=True)
    except OSError as exc:
        _restore(previous)
        print(f"lccrun: cannot start {argv[0]}: {exc}", file=sys.stderr)
        return 127
    tail = _Tail(proc.stderr)
    known: dict[int, int] = {}   # processes seen below mpirun: pid -> start time
    forwarded = 0
    interrupted_at = failed_at = termed_at = consequence_at = None
    next_scan = time.monotonic() + 1.0
    changes: set[str] = set()     # elastic membership records already reported
    try:
        while True:
            for line in membership_lines(status_dir, changes) + (
                    discovery.poll() if discovery is not None else []):
                print(line, file=sys.stderr, flush=True)
            try:
                returncode = proc.wait(timeout=0.1)
                break
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            if now >= next_scan or len(received) > forwarded:
                known.update(descendants(proc.pid))
                next_scan = now + SCAN_INTERVAL_S
            if len(received) > forwarded:          # Ctrl-C / SIGTERM / SIGHUP to lccrun
                _signal(proc.pid, signal.SIGINT)
                forwarded = len(received)
                interrupted_at = interrupted_at or now
                if forwarded > 1:                  # second Ctrl-C: no more patience
                    kill_tree(proc.pid, known)
            if asked and asked[0] > 0:               # SIGUSR1 to lccrun: records, then summary
                known.update(descendants(proc.pid))
                request_records(flight_dir, known)
                asked[0] = -(now + USR1_SUMMARY_WAIT_S)
            elif asked and now >= -asked[0]:
                asked.clear()
                for line in summarize(read_records(flight_dir)):
                    print(line, file=sys.stderr, flush=True)
            if interrupted_at and now - interrupted_at > interrupt_grace_s:
                kill_tree(proc.pid, known)
            if failed_at is None:
                records = read_statuses(status_dir)
                if any(not r.get("consequence") for r in records) or tail.reports_failure():
                    failed_at = now
                elif records:      # only consequences: their ranks wait for the cause first
                    consequence_at = consequence_at or now
                    if now - consequence_at > CONSEQUENCE_WAIT_S:
                        failed_at = now
                if failed_at is not None:      # ask the ranks still there for their records
                    known.update(descendants(proc.pid))
                    request_records(flight_dir, known)
            if failed_at and termed_at is None and now - failed_at > failure_grace_s:
                _signal(proc.pid, signal.SIGTERM)
                termed_at = now
            if termed_at and now - termed_at > TERM_GRACE_S:
                kill_tree(proc.pid, known)
    finally:
        _restore(previous)
        if proc.poll() is None:  # lccrun itself is dying (e.g. an exception): take it all down
            kill_tree(proc.pid, known)
            proc.wait()
    if returncode != 0 or received:  # leftovers of a failed or interrupted job
        adopted = {p: t for p, t in descendants(os.getpid()).items() if p not in before}
        _reap(kill_tree(None, {**known, **adopted}))
    tail.thread.join(timeout=2.0)
    for line in membership_lines(status_dir, changes):
        print(line, file=sys.stderr)
    if not tail.ends_with_newline():
        sys.stderr.write("\n")  # prterun's last banner ends without a newline
    for line in summarize(read_records(flight_dir)) if returncode != 0 else []:
        print(line, file=sys.stderr)
    return _summarise(returncode, tail.text(), read_statuses(status_dir), received)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _restore(previous: dict) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)


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
