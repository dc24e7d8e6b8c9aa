"""Timeline and autotuner on real ``mpirun`` jobs (workers in ``workers_tune/``).

The timeouts only turn a hang into a failure: sized for a loaded 2-core machine, where starting
two ranks (Python, NumPy, numba, optuna) alone can take tens of seconds; nothing is timed."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from tests.mpi_harness import Cases

WORKERS = Path(__file__).parent / "workers_tune"


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The three runs as cases of one ``mpirun -np 2`` job (workers_core/cases.py), in order:
    the timeline, the autotuner tuning, the autotuner reading the cache the tuning wrote."""
    base = tmp_path_factory.mktemp("tune_cases")
    files = {"timeline": base / "timeline.json", "cache": base / "autotune.json",
             "log": base / "samples.csv"}
    c = Cases(base, timeout=540)
    c.add(2, "timeline", str(WORKERS / "check_timeline.py"), args=[str(files["timeline"])],
          env={"LCC_TIMELINE": str(files["timeline"])})
    env = {"LCC_AUTOTUNE": "1", "LCC_AUTOTUNE_CACHE": str(files["cache"]),
           "LCC_AUTOTUNE_LOG": str(files["log"]), "LCC_LOG_LEVEL": "warning"}
    c.add(2, "tune", str(WORKERS / "check_autotune.py"), args=["tune", "320"], env=env)
    c.add(2, "cached", str(WORKERS / "check_autotune.py"), args=["cached", "5"],
          env={**env, "LCC_AUTOTUNE_LOG": ""})
    return c, files


@pytest.mark.timeout(600)
def test_timeline_file_parses_nests_and_names_every_tensor(job) -> None:
    c, files = job
    out = c.output(2, "timeline")
    path = files["timeline"]
    assert out.count("OK rank") == 2, out[-3000:]
    assert not Path(str(path) + ".rank1").exists()   # only rank 0 writes by default
    assert json.loads(path.read_text())[-1]["name"] == "lightcc_summary"


@pytest.mark.timeout(600)
def test_autotune_same_settings_everywhere_then_cache_hit(job) -> None:
    c, files = job
    out = c.output(2, "tune")
    assert out.count("OK rank") == 2 and "STATE done" in out, out[-3000:]
    assert out.count("autotune: settled after") == 1, out[-3000:]
    rows = list(csv.DictReader(files["log"].open()))
    assert rows[0]["phase"] == "baseline" and rows[0]["fusion_threshold"] == "4096"
    assert len(json.loads(files["cache"].read_text())["entries"]) == 1
    out = c.output(2, "cached")
    assert out.count("OK rank") == 2 and "STATE cached" in out, out[-3000:]
    assert out.count("autotune: using the cached setting") == 1, out[-3000:]
