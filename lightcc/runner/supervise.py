"""Run ``mpirun`` under supervision and say which rank failed.

Open MPI 5's ``prterun`` already ends the job when a rank exits non-zero or dies from a signal,
and prints a banner naming it. lccrun builds on that:

* ``mpirun`` runs in its own session, so a terminal Ctrl-C reaches only lccrun, which forwards
  SIGINT to ``prterun`` (it kills every rank) and, if the job is still there after a grace
  period, SIGKILLs ``prterun`` and every process below it;
* its stderr passes through lccrun, which keeps the tail to read prterun's banner;
* Python ranks run under :mod:`~lightcc.runner._rankwrap`, which writes the exit code and
  exception of a failing rank to a status directory before aborting;
* until every rank has reported to lccrun's start-up registry, a progress line every few
  seconds names the hosts still missing, and ``--start-timeout`` ends the job
  (:mod:`~lightcc.runner.startup`);
* a watchdog ends the job if a rank failed (status record or prterun banner) but the job is
  still running 3 s later (e.g. a rank's child process keeps prterun's output pipes open);
  records that only report another rank's failure (consequences) count after the
  ``CONSEQUENCE_WAIT_S`` their ranks wait for the cause.

Reading what failed is :mod:`~lightcc.runner.diagnosis`; finding and stopping the processes
below lccrun is :mod:`~lightcc.runner.proctree`. The last line lccrun prints names the failed rank: ``lccrun: rank 1 exited with code 3`` or
``lccrun: rank 0 killed by signal 9 (SIGKILL)``.
"""
from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import threading
import time

from .._exit import CONSEQUENCE_WAIT_S
from .diagnosis import (Failure, _summarise, diagnose, membership_lines,  # noqa: F401
                        parse_mpirun_output, read_statuses)
from .flight_summary import read_records, summarize
from .proctree import (_reap, _signal, become_subreaper, descendants, kill_tree,  # noqa: F401
                       request_records, signal_verified)
from .startup import START_TIMEOUT_EXIT

TAIL_BYTES = 64 * 1024
INTERRUPT_GRACE_S = 4.0     # after forwarding Ctrl-C, wait this long before SIGKILL
USR1_SUMMARY_WAIT_S = 2.0   # SIGUSR1 to lccrun: the ranks' records are read this much later
FAILURE_GRACE_S = 3.0       # a rank failed: stop the job if it is still running then
TERM_GRACE_S = 1.5          # after SIGTERM to mpirun, wait this long before SIGKILL
SCAN_INTERVAL_S = 2.0       # how often to note the processes below mpirun


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
              discovery=None, startup=None, status=None) -> int:
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
    start_error = None            # the --start-timeout line, printed last
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
            if startup is not None and start_error is None:
                lines, start_error = startup.poll(now)
                for line in lines:
                    print(line, file=sys.stderr, flush=True)
                if start_error is not None and termed_at is None:
                    _signal(proc.pid, signal.SIGTERM)
                    termed_at = now
            if status is not None:
                status.poll(now)
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
    if status is not None:
        status.finish()
    for line in membership_lines(status_dir, changes):
        print(line, file=sys.stderr)
    if not tail.ends_with_newline():
        sys.stderr.write("\n")  # prterun's last banner ends without a newline
    if start_error is not None:
        print(start_error, file=sys.stderr)
        return START_TIMEOUT_EXIT
    for line in summarize(read_records(flight_dir)) if returncode != 0 else []:
        print(line, file=sys.stderr)
    return _summarise(returncode, tail.text(), read_statuses(status_dir), received)


def _restore(previous: dict) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)

