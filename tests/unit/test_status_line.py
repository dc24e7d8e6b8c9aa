"""lccrun --status as pure logic: the line from the ranks' reports (hand-written), the watch
that prints it (in place on a terminal, appended otherwise), the registry taking reports, and
the step counter behind steps/s and exposed communication."""
from __future__ import annotations

import io
import socket
import time

from lightcc.common.observability import metrics, reporter
from lightcc.runner import args as rargs, startup, status


def test_status_line_from_reports():
    reports = {0: {"steps": 120, "steps_per_s": 12.5, "bytes_sent_per_s": 3e6,
                   "compression_ratio": 2.0, "exposed_share": 0.2},
               1: {"steps": 117, "steps_per_s": 12.3, "bytes_sent_per_s": 2e6,
                   "compression_ratio": 2.0, "exposed_share": 0.3}}
    assert status.status_line(reports) == ("12.3 steps/s | wire 5.0 MB/s | compression 2.00x "
                                           "| exposed comm 25% | slowest rank 1, 3 steps behind")
    # rank 1 reported 0.5 s after rank 0 (its report is 0.5 s fresher): 117 vs 120 + 6.25
    ages = {0: 0.5, 1: 0.0}
    assert status.status_line(reports, ages).endswith("slowest rank 1, 9 steps behind")
    assert status.status_line({0: {"collectives": 3}}) == \
        "- steps/s | wire 0.0 MB/s | compression - | exposed comm -"
    assert status.status_line({}) == "no rank has reported yet"
    even = {r: {"steps": 5} for r in range(3)}
    assert status.status_line(even).endswith("| ranks in step")


class _Registry:
    def __init__(self):
        self.got = {}

    def reports(self):
        return dict(self.got)


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_watch_rewrites_on_a_terminal_and_appends_otherwise():
    reg = _Registry()
    for stream in (io.StringIO(), _Tty()):
        watch = status.StatusWatch(reg, 2.0, stream=stream, now=0.0)
        reg.got = {0: (0.5, {"steps": 1})}
        watch.poll(1.0)                           # not due yet
        watch.poll(2.0)
        watch.poll(4.0)                           # nothing new: no line
        reg.got = {0: (3.5, {"steps": 9})}
        watch.poll(6.0)
        watch.finish()
        text = stream.getvalue()
        if isinstance(stream, _Tty):
            assert text.count("\r\x1b[K") == 2 and text.endswith("\n") and text.count("\n") == 1
        else:
            assert text.splitlines() == ["lccrun: status: - steps/s | wire 0.0 MB/s | "
                                         "compression - | exposed comm -"] * 2


def test_registry_keeps_the_latest_report_per_rank_and_drops_bad_ones():
    reg = startup.Registry(["127.0.0.1"])
    try:
        where = reg.env()[startup.ADDR_ENV]
        assert reporter.send(where, reg.token, 1, {"steps": 4})
        assert reporter.send(where, reg.token, 1, {"steps": 5})
        assert reporter.send(where, "not-the-token", 0, {"steps": 99})
        with socket.create_connection(("127.0.0.1", reg.port)) as s:
            s.sendall(f"status {reg.token} 0 not-json\n".encode())
        for _ in range(300):
            if reg.strangers == 2 and reg.reports().get(1, (0, {}))[1].get("steps") == 5:
                break
            time.sleep(0.01)
        assert {r: rep for r, (_, rep) in reg.reports().items()} == {1: {"steps": 5}}
        assert reg.strangers == 2
    finally:
        reg.close()


def test_steps_give_steps_per_second_and_the_exposed_share(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(metrics.time, "monotonic", lambda: clock[0])
    steps = metrics.Steps()
    for _ in range(11):                      # a step every 0.5 s, waiting 0.1 s of it
        steps.note(0.1)
        clock[0] += 0.5
    rates = steps.rates(clock[0] - 0.5)      # at the last step: 10 steps in 5 s
    assert abs(rates["steps_per_s"] - 2.0) < 1e-9
    assert abs(rates["exposed_share"] - 0.2) < 1e-9
    assert reporter.summary({"steps": 3, "collectives": 9, "compression_ratio": 1.0,
                             "payload_bytes": 5, "rates": {"steps_per_s": 2.0,
                                                           "buckets_per_s": 1.0}}) == \
        {"steps": 3, "collectives": 9, "compression_ratio": 1.0, "steps_per_s": 2.0}


def test_status_flag_takes_an_optional_number():
    ns = rargs.parse_args(["-np", "2", "--status", "python", "t.py"])
    assert ns.status == 5.0 and ns.command == ["python", "t.py"]
    ns = rargs.parse_args(["-np", "2", "--status", "2.5", "python", "t.py"])
    assert ns.status == 2.5
    assert rargs.to_spec(ns, {}).status_period == 2.5
    assert rargs.to_spec(rargs.parse_args(["-np", "1", "python", "t.py"]), {}).status_period \
        is None
