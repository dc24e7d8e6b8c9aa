"""``python -m lightcc.gpucheck`` without a GPU: it says so at once; and its runner and report
with stand-in steps (budget, timeouts, failures, the Markdown and JSON it writes)."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from lightcc.gpucheck import report, run

ROOT = Path(__file__).resolve().parents[2]


def test_no_gpu_exits_quickly_with_a_clear_message(tmp_path):
    shadow = tmp_path / "shadow" / "cupy"          # whatever this machine has: no CuPy
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('no CUDA here')\n")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "lightcc.gpucheck", "--out",
                           str(tmp_path / "rep")], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={"PYTHONPATH": f"{shadow.parent}:{ROOT}",
                                         "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert time.monotonic() - t0 < 60
    assert "no GPU to check here" in proc.stderr and "no CUDA here" in proc.stderr
    doc = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert doc["verdict"] == "no GPU" and doc["steps"] == []


ENGINE = {"rank": 0, "size": 1, "failed": 1, "cases": [
    {"case": "allreduce flat none", "ok": True, "seconds": 0.1, "note": "backend nccl"},
    {"case": "allreduce flat topk", "ok": False, "seconds": 0.1, "note": "AssertionError: x"}]}
BENCH = {"device": "H100", "size_mb": 64, "reps": 5, "ranks": 1, "kernels": [
    {"kernel": "fp16 cast", "lightcc_gbs": 1900.0, "torch_gbs": 1936.0, "ratio": 0.98,
     "target": 0.9, "verdict": "ok"},
    {"kernel": "topk 1% (exact k)", "lightcc_gbs": 500.0, "torch_gbs": 178.0, "ratio": 2.8,
     "target": 5.0, "verdict": "MISS"}],
    "allreduce": [{"mb": 64, "raw_ms": 0.02, "comm_ms": 0.03, "comm_overhead_pct": 50.0,
                   "engine_ms": 0.09, "engine_overhead_pct": 350.0}]}


def _writer(name: str, payload: object, rc: int = 0, sleep: float = 0.0) -> list[str]:
    code = (f"import json, sys, time; time.sleep({sleep}); "
            f"open(sys.argv[1] + '/{name}', 'w').write({json.dumps(json.dumps(payload))}); "
            f"print('step output'); sys.exit({rc})")
    return [sys.executable, "-c", code]


def test_runner_reports_every_step(tmp_path, monkeypatch, capsys):
    out = tmp_path / "rep"

    def steps(out_dir: Path, quick: bool) -> list[run.Step]:
        a = [str(out_dir)]
        return [
            run.Step("engine-1rank", "engine", _writer("e.json", ENGINE) + a, 20,
                     lambda o: run.engine_result(o / "e.json")),
            run.Step("benchmarks", "bench", _writer("b.json", BENCH) + a, 20,
                     lambda o: run.bench_result(o / "b.json")),
            run.Step("broken", "a crash", _writer("x.json", {}, rc=3) + a, 20,
                     lambda o: run._mnist(o / "x.json")),
            run.Step("source", "needs files", ["true"], 20, lambda o: ("", {}),
                     needs=("no/such/file",)),
            run.Step("slow", "too slow", _writer("s.json", {}, sleep=30) + a, 1,
                     lambda o: run._mnist(o / "s.json")),
            run.Step("late", "never started", _writer("l.json", {}) + a, 20,
                     lambda o: run._mnist(o / "l.json")),
        ]

    monkeypatch.setattr(run, "probe", lambda: {"gpu": True, "summary": "1 x H100"})
    monkeypatch.setattr(run, "steps", steps)
    monkeypatch.setattr(run, "MIN_STEP_S", 0.5)
    clock = [0.0]
    step = run.run_step

    def run_step(st: run.Step, out_dir: Path, limit: float) -> dict:
        clock[0] += 10.0 if st.name != "slow" else 100.0     # "slow" spends the budget
        return step(st, out_dir, limit)

    monkeypatch.setattr(run, "clock", lambda: clock[0])
    monkeypatch.setattr(run, "run_step", run_step)
    rc = run.main(["--out", str(out), "--budget-s", "50"])
    assert rc == 1
    doc = json.loads((out / "report.json").read_text())
    got = {s["name"]: s for s in doc["steps"]}
    assert got["engine-1rank"]["status"] == "ok" and "1/2 cases ok (backend nccl)" in \
        got["engine-1rank"]["detail"]
    assert got["benchmarks"]["status"] == "ok" and "missed: topk" in got["benchmarks"]["detail"]
    assert got["broken"]["status"] == "FAIL" and "rc 3" in got["broken"]["detail"]
    assert got["slow"]["status"] == "FAIL" and "timed out" in got["slow"]["detail"]
    assert got["late"]["status"] == "not run" and "budget" in got["late"]["detail"]
    assert "source checkout" in got["source"]["detail"]
    assert (out / "logs" / "broken.log").read_text().endswith("\nstep output\n")
    md = (out / "report.md").read_text()
    assert "| topk 1% (exact k) | 500 | 178 | 2.80 | >= 5x | MISS |" in md
    assert "| 64 | 0.020 | 0.030 | 50.0 % | 0.090 | 350.0 % | n/a: 1 rank |" in md
    assert "| allreduce flat topk | FAIL: AssertionError: x |" in md
    assert "Verdict: **fail**" in md and md in capsys.readouterr().out


def test_verdict():
    ok = {"status": "ok"}
    assert report.verdict([ok, ok]) == "pass"
    assert report.verdict([ok, {"status": "not run"}]) == "incomplete (1 not run)"
    assert report.verdict([ok, {"status": "FAIL"}, {"status": "not run"}]) == "fail"
    assert report.verdict([{"status": "not run"}]) == "incomplete (1 not run)"
    assert report.verdict([]) == "incomplete (nothing ran)"
    assert report.verdict([], gpu=False) == "no GPU"


def test_missing_launcher_fails_the_step_and_the_run_goes_on(tmp_path, monkeypatch):
    """A step whose program cannot start (no mpirun on the machine) is a FAIL with the reason;
    the steps after it still run, the report is written and --tar packs it into one file."""
    out = tmp_path / "rep"

    def steps(out_dir: Path, quick: bool) -> list[run.Step]:
        return [run.Step("engine-2rank", "two ranks", ["/no/such/mpirun", "-np", "2"], 20,
                         lambda o: run.engine_result(o / "e.json")),
                run.Step("engine-1rank", "one rank", _writer("e.json", ENGINE) + [str(out_dir)],
                         20, lambda o: run.engine_result(o / "e.json"))]

    monkeypatch.setattr(run, "probe", lambda: {"gpu": True, "summary": "1 x H100"})
    monkeypatch.setattr(run, "steps", steps)
    rc = run.main(["--out", str(out), "--tar", str(tmp_path / "gc.tgz")])
    assert rc == 1
    doc = json.loads((out / "report.json").read_text())
    first, second = doc["steps"]
    assert first["status"] == "FAIL" and "could not start '/no/such/mpirun'" in first["detail"]
    assert "No such file" in first["detail"]
    assert second["status"] == "ok"
    import tarfile

    with tarfile.open(tmp_path / "gc.tgz") as tar:
        names = set(tar.getnames())
    assert {"rep/report.md", "rep/report.json", "rep/logs/engine-2rank.log"} <= names


def test_one_rank_steps_use_mpirun_when_there_is_one(monkeypatch, tmp_path):
    monkeypatch.setattr(run, "find_mpirun", lambda: "/usr/bin/mpirun")
    cmds = {s.name: s.cmd for s in run.steps(tmp_path, quick=True)}
    assert all(c[0] == "/usr/bin/mpirun" and c[c.index("-np") + 1] in ("1", "2")
               for c in cmds.values())
    monkeypatch.setattr(run, "find_mpirun", lambda: None)
    cmds = {s.name: s.cmd for s in run.steps(tmp_path, quick=True)}
    assert cmds["engine-1rank"][0] == sys.executable          # singleton start as a fallback
    assert cmds["engine-2rank"][0] == "mpirun"                 # fails to start, reported
