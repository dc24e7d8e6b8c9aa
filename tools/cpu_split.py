"""Where the CPU goes while a job runs: user / system / idle of the machine, and per thread of
the job's processes (Linux ``/proc``), over one window.

    python tools/cpu_split.py --match "training.py --worker" --delay 40 --window 5

waits ``--delay`` seconds, then samples ``/proc/stat`` and ``/proc/PID/task/TID/stat`` of every
process whose command line contains ``--match`` at the start and the end of ``--window``
seconds, and prints the machine's split (% of all cores) and each thread's user and system
time (% of one core). With ``--names`` each thread is named by ``py-spy dump`` (Python thread
name and its innermost frame; needs py-spy and root). Used for docs/profile-1gbit.md.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def machine() -> list[int]:
    """user, nice, system, idle, iowait, irq, softirq, steal ticks of all cores."""
    with open("/proc/stat") as fh:
        return [int(x) for x in fh.readline().split()[1:9]]


def procs(match: str) -> list[int]:
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if match in cmd and "cpu_split.py" not in cmd:
            found.append(int(d.name))
    return sorted(found)


def threads(pid: int) -> dict[int, tuple[str, int, int]]:
    """tid -> (comm, utime ticks, stime ticks)."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as fh:
                raw = fh.read()
        except OSError:
            continue
        comm = raw[raw.index("(") + 1:raw.rindex(")")]
        f = raw.rsplit(")", 1)[1].split()
        out[int(tid)] = (comm, int(f[11]), int(f[12]))
    return out


def py_names(pid: int) -> dict[int, str]:
    """tid -> 'thread name: innermost function' from ``py-spy dump`` (empty if unavailable)."""
    try:
        txt = subprocess.run(["py-spy", "dump", "--pid", str(pid)], capture_output=True,
                             text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    names: dict[int, str] = {}
    tid = None
    for line in txt.splitlines():
        m = re.match(r'Thread (0x[0-9A-Fa-f]+|\d+) \((\w+)\): "([^"]*)"', line)
        if m:
            label = m.group(3)
            # py-spy prints the native id (decimal) on Linux, else the pthread id (hex)
            tid = int(m.group(1), 16) if m.group(1).startswith("0x") else int(m.group(1))
            names[tid] = label
            continue
        if tid is not None and line.strip() and names[tid].count(":") == 0:
            names[tid] += ": " + line.strip().split(" (")[0]
    return names


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--match", required=True, help="substring of the processes' command line")
    ap.add_argument("--delay", type=float, default=0.0, help="seconds to wait first")
    ap.add_argument("--window", type=float, default=5.0, help="seconds sampled")
    ap.add_argument("--names", action="store_true", help="name threads with py-spy dump")
    ap.add_argument("--label", default="", help="printed in the header")
    args = ap.parse_args()
    time.sleep(args.delay)
    pids = procs(args.match)
    if not pids:
        print(f"cpu_split: no process matches {args.match!r}", file=sys.stderr)
        return 1
    m0, t0 = machine(), {p: threads(p) for p in pids}
    w0 = time.monotonic()
    time.sleep(args.window)
    m1, t1 = machine(), {p: threads(p) for p in pids}
    wall = time.monotonic() - w0
    load = open("/proc/loadavg").read().split()[:3]
    d = [b - a for a, b in zip(m0, m1)]
    tot = sum(d) or 1
    print(f"## {args.label} window {wall:.1f} s, load average {' '.join(load)}")
    print(f"machine: user {100 * (d[0] + d[1]) / tot:.1f} %, system "
          f"{100 * (d[2] + d[5] + d[6]) / tot:.1f} % (softirq {100 * d[6] / tot:.1f}), idle "
          f"{100 * (d[3] + d[4]) / tot:.1f} %")
    for p in pids:
        names = py_names(p) if args.names else {}
        rows = []
        for tid, (comm, u1, s1) in t1[p].items():
            _, u0, s0 = t0[p].get(tid, (comm, 0, 0))
            u, s = (u1 - u0) / TICK / wall, (s1 - s0) / TICK / wall
            if u + s >= 0.005:
                rows.append((u + s, tid, comm, u, s))
        tu = sum(r[3] for r in rows)
        ts = sum(r[4] for r in rows)
        print(f"pid {p}: user {100 * tu:.0f} %, system {100 * ts:.0f} % of one core")
        for _, tid, comm, u, s in sorted(rows, reverse=True):
            print(f"  tid {tid:>7} {comm:<15} user {100 * u:5.1f} %  sys {100 * s:5.1f} %  "
                  f"{names.get(tid, '')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
