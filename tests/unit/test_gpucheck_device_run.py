"""benchmarks/device_run.sh and lightcc.gpucheck.device_run without a GPU: the clean failure,
the preflight, the budget and skip logic, the parsers and report sections, the per-rank core
pinning and the Open MPI 4 shim."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from lightcc.gpucheck import device_run, report, run

ROOT = Path(__file__).resolve().parents[2]
PIN = ROOT / "benchmarks" / "device_pin"


def test_script_without_gpu_fails_in_seconds_naming_what_is_missing(tmp_path):
    shadow = tmp_path / "shadow" / "cupy"           # whatever this machine has: no CuPy
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('no CUDA here')\n")
    t0 = time.monotonic()
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "device_run.sh")],
                          capture_output=True, text=True, timeout=180, cwd=tmp_path,
                          env={"PYTHONPATH": str(shadow.parent), "PYTHON": sys.executable,
                               "OUT": str(tmp_path / "out"), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert time.monotonic() - t0 < 120                  # seconds on a quiet machine
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("device_run: cannot run here: missing CuPy")
    assert "no CUDA here" in lines[0] and "torch with CUDA" in lines[0]
    doc = json.loads((tmp_path / "out" / "device-run" / "report.json").read_text())
    assert doc["verdict"] == "no GPU" and doc["steps"] == []
    assert "cannot run" in (tmp_path / "out" / "device-run" / "report.md").read_text()


def test_script_names_a_missing_python_package(tmp_path):
    shadow = tmp_path / "shadow" / "ml_dtypes"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('gone')\n")
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "device_run.sh")],
                          capture_output=True, text=True, timeout=180,
                          env={"PYTHONPATH": str(shadow.parent), "PYTHON": sys.executable,
                               "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert "missing Python packages: ml_dtypes (ImportError: gone)" in proc.stderr


def _fake_imports(**mods):
    def imp(name):
        if name not in mods or mods[name] is None:
            raise ImportError(f"no {name}")
        return mods[name]
    return imp


def test_preflight_lists_every_missing_piece():
    ns = types.SimpleNamespace
    gpu0 = ns(cuda=ns(runtime=ns(getDeviceCount=lambda: 0)))
    cpu_torch = ns(cuda=ns(is_available=lambda: False))
    got = device_run.preflight(_fake_imports(cupy=gpu0, torch=cpu_torch), lambda: None)
    assert got[0] == "a CUDA GPU (CuPy sees none)"
    assert "NCCL for CuPy (ImportError: no cupy.cuda.nccl)" in got
    assert "torch with CUDA (torch.cuda.is_available() is False)" in got
    assert "mpi4py (ImportError: no mpi4py)" in got and got[-1].startswith("mpirun")
    gpu = ns(cuda=ns(runtime=ns(getDeviceCount=lambda: 1)))
    torch = ns(cuda=ns(is_available=lambda: True),
               distributed=ns(is_nccl_available=lambda: True))
    every = _fake_imports(cupy=gpu, torch=torch, mpi4py=ns(), **{"cupy.cuda.nccl": ns()})
    assert device_run.preflight(every, lambda: "/usr/bin/mpirun") == []
    torch.distributed.is_nccl_available = lambda: False
    assert device_run.preflight(every, lambda: "/usr/bin/mpirun") == ["torch with NCCL"]


def _writer(name: str, payload: object, rc: int = 0) -> list[str]:
    code = (f"import sys; open(sys.argv[1] + '/{name}', 'w').write("
            f"{json.dumps(json.dumps(payload))}); sys.exit({rc})")
    return [sys.executable, "-c", code]


DDP = {"rank": 0, "size": 2, "native": "gloo", "failed": 1, "tensors": 120, "cases": [
    {"case": "ddp lightcc fp16", "ok": True, "seconds": 1.0, "note": "max error 1e-4"},
    {"case": "fsdp2 lightcc fp8 reduce-scatter", "ok": False, "seconds": 1.0,
     "note": "AssertionError: tensor 3"}],
    "timing": [{"hook": "none", "native": "gloo", "native_ms": 10.0, "lightcc_ms": 8.0,
                "ratio": 1.25, "overhead_pct": -20.0}]}
TRAIN = {"rows": [{"model": "resmlp", "phases": {}},
                  {"model": "resmlp", "config": "lightcc", "round": 0, "img_s": 100.0},
                  {"model": "resmlp", "config": "lightcc", "round": 1, "img_s": 300.0},
                  {"model": "resmlp", "config": "ddp", "round": 0, "img_s": 150.0}]}


def test_execute_keeps_the_budget_and_says_why_a_step_did_not_run(tmp_path, monkeypatch):
    out = tmp_path / "rep"
    a = [str(out)]
    plan = [(run.Step("ddp-2rank", "ddp", _writer("d.json", DDP) + a, 20,
                      lambda o: device_run.parse_ddp(o / "d.json")), 5),
            (run.Step("netns-x1", "training x1", _writer("t.json", TRAIN) + a, 20,
                      lambda o: device_run.parse_training(o / "t.json")), 5),
            (run.Step("netns-x2", "training x2", ["true"], 20, lambda o: ("", {})), 5),
            (run.Step("gpu-tests", "tests", ["true"], 20, lambda o: ("", {})), 50)]
    clock = [0.0]
    step = run.run_step

    def run_step(st, out_dir, limit):
        assert limit <= 20
        clock[0] += 30.0
        return step(st, out_dir, limit)

    monkeypatch.setattr(run, "clock", lambda: clock[0])
    monkeypatch.setattr(run, "run_step", run_step)
    rows = device_run.execute(plan, out, 100.0, {"netns-x2": "not possible here: no root"},
                              {"gpu": True, "summary": "test"})
    got = {r["name"]: r for r in rows}
    assert got["ddp-2rank"]["status"] == "ok"
    assert got["ddp-2rank"]["detail"].startswith("1/2 cases ok, 2 rank(s), native gloo")
    assert "none: lightcc 8.00 ms/step vs gloo 10.00 ms (-20.0 %)" in got["ddp-2rank"]["detail"]
    assert got["netns-x1"]["data"]["median_img_s"] == {"resmlp lightcc": 200.0,
                                                       "resmlp ddp": 150.0}
    assert got["netns-x2"]["status"] == "not run" and "no root" in got["netns-x2"]["detail"]
    assert got["gpu-tests"]["status"] == "not run"
    assert got["gpu-tests"]["detail"] == "40 s left in the budget, needs 50"
    md = (out / "report.md").read_text()
    assert "| ddp-2rank | none | gloo: 10.00 | 8.00 | -20.0 % | 1.25 |" in md
    assert "| resmlp lightcc | 200 |" in md
    assert "| fsdp2 lightcc fp8 reduce-scatter | FAIL: AssertionError: tensor 3 |" in md
    assert report.verdict(rows) == "incomplete (2 not run)"


def test_parse_training_without_timed_rows_is_an_error(tmp_path):
    (tmp_path / "t.json").write_text(json.dumps({"rows": [{"model": "m", "phases": {}}]}))
    with pytest.raises(ValueError, match="no timed rows"):
        device_run.parse_training(tmp_path / "t.json")


def test_plan_fits_eight_minutes_and_pins_training(tmp_path, monkeypatch):
    monkeypatch.setattr(run, "find_mpirun", lambda: "/usr/bin/mpirun")
    plan = device_run.plan(tmp_path, per_rank=4, python="/tmp/py")
    assert device_run.BUDGET_S <= 8 * 60 - 60          # a minute left for the machine's start
    assert all(minimum <= st.timeout for st, minimum in plan)
    names = [st.name for st, _ in plan]
    assert names == ["benchmarks", "ddp-1rank", "ddp-2rank", "netns-x1", "netns-x2",
                     "engine-1rank", "engine-2rank", "gpu-tests"]
    x2 = plan[4][0]
    assert x2.cmd[:2] == ["/tmp/py", "benchmarks/training.py"]
    assert x2.cmd[x2.cmd.index("--ranks-per-host") + 1] == "2" and "--netns" in x2.cmd
    assert x2.env["DEVICE_RUN_CORES_PER_RANK"] == "4"
    assert x2.env["PYTHONPATH"].split(os.pathsep)[0] == str(PIN)
    ddp2 = plan[2][0]
    assert ddp2.cmd[ddp2.cmd.index("-np") + 1] == "2" and ddp2.env == {"LCC_BACKEND": "mpi"}


def test_cores_for():
    from importlib.util import module_from_spec, spec_from_file_location

    spec = spec_from_file_location("pin", PIN / "sitecustomize.py")
    pin = module_from_spec(spec)
    spec.loader.exec_module(pin)        # no rank variables in pytest: pins nothing
    cores = list(range(16))
    assert pin.cores_for(0, 4, cores) == [0, 1, 2, 3]
    assert pin.cores_for(3, 4, cores) == [12, 13, 14, 15]
    assert pin.cores_for(4, 4, cores) == []            # not enough cores: leave it alone
    assert pin.cores_for(0, 2, [9, 3, 5, 7], offset=1) == [5, 7]
    assert pin.cores_for(1, 2, [9, 3, 5, 7], offset=1) == []
    assert pin.cores_for(0, 0, cores) == []


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux affinity")
def test_pinning_reaches_a_rank_through_pythonpath(tmp_path):
    avail = sorted(os.sched_getaffinity(0))
    code = "import os; print(sorted(os.sched_getaffinity(0)))"
    env = dict(os.environ, PYTHONPATH=str(PIN), DEVICE_RUN_CORES_PER_RANK="1",
               OMPI_COMM_WORLD_RANK=str(len(avail) - 1),
               DEVICE_RUN_PIN_LOG=str(tmp_path / "pin.txt"))
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=60)
    assert got.stdout.strip() == str([avail[-1]]), got.stderr
    assert (tmp_path / "pin.txt").read_text().endswith(f": cores {avail[-1]}\n")
    env.pop("OMPI_COMM_WORLD_RANK")                      # not a rank: untouched
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=60)
    assert got.stdout.strip() == str(avail)


def test_open_mpi4_shim_rewrites_the_agent_option(tmp_path):
    fake = tmp_path / "fake-mpirun"
    fake.write_text("#!/bin/sh\nfor a in \"$@\"; do echo \"[$a]\"; done\n")
    fake.chmod(0o755)
    py = device_run.open_mpi4_python(tmp_path / "venv", str(fake))
    assert py.exists() and (py.parent / "mpirun").exists()
    got = subprocess.run([str(py.parent / "mpirun"), "-np", "2", "--prtemca", "plm_ssh_agent",
                          "/x/agent.sh", "--mca", "btl", "tcp,self", "a b"],
                         capture_output=True, text=True, timeout=60)
    assert got.stdout.split("\n")[:-1] == ["[-np]", "[2]", "[--mca]", "[plm_rsh_agent]",
                                           "[/x/agent.sh]", "[--mca]", "[btl]", "[tcp,self]",
                                           "[a b]"]
    probe = subprocess.run([str(py), "-c", "import sys, lightcc; print(sys.executable)"],
                           capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert probe.stdout.strip() == str(py), probe.stderr   # its packages: this python's


def test_ddp_check_reference_and_tolerances_catch_a_wrong_gradient():
    """The reference is the mean over ranks of each rank's gradient, computed in-process; a
    missing division by the world size, or fp8-sized errors under the fp16 tolerance, fail."""
    import torch

    from lightcc.gpucheck import ddp_check

    check = ddp_check.Check(torch, rank=0, world=2, width=8, layers=3, cuda=False)
    model = ddp_check.build(torch, 3, 8)
    per_rank = []
    for r in range(2):
        check.rank = r
        per_rank.append([g.clone() for g in check.step(model)])
    mean = [(a + b) / 2 for a, b in zip(*per_rank)]
    assert check.compare(mean, "none").startswith("max error 0")
    with pytest.raises(AssertionError, match="tensor"):
        check.compare([2 * g for g in mean], "fp8")              # summed, not averaged
    fp16 = [g.half().float() for g in mean]
    check.compare(fp16, "fp16")
    fp8 = [g + check.amax * 2.0 ** -5 for g in mean]             # an E4M3-sized error
    check.compare(fp8, "fp8")
    with pytest.raises(AssertionError, match="fp16"):
        check.compare(fp8, "fp16")
    with pytest.raises(AssertionError):
        check.compare([g * float("nan") for g in mean], "fp8")
