"""Timeline and autotuner on real ``mpirun`` jobs (workers in ``workers_tune/``).

The timeouts only turn a hang into a failure: sized for a loaded 2-core machine, where starting
two ranks (Python, NumPy, numba, optuna) alone can take tens of seconds; nothing is timed."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from tests.mpi_harness import run_mpi

WORKERS = Path(__file__).parent / "workers_tune"


@pytest.mark.timeout(240)
def test_timeline_file_parses_nests_and_names_every_tensor(tmp_path: Path) -> None:
    path = tmp_path / "timeline.json"
    out = run_mpi(2, [str(WORKERS / "check_timeline.py"), str(path)],
                  env={"LCC_TIMELINE": str(path)}, timeout=200).stdout
    assert out.count("OK rank") == 2, out[-3000:]
    assert not Path(str(path) + ".rank1").exists()   # only rank 0 writes by default
    assert json.loads(path.read_text())[-1]["name"] == "lightcc_summary"


@pytest.mark.timeout(480)
def test_autotune_same_settings_everywhere_then_cache_hit(tmp_path: Path) -> None:
    cache = tmp_path / "autotune.json"
    log = tmp_path / "samples.csv"
    env = {"LCC_AUTOTUNE": "1", "LCC_AUTOTUNE_CACHE": str(cache),
           "LCC_AUTOTUNE_LOG": str(log), "LCC_LOG_LEVEL": "warning"}
    out = run_mpi(2, [str(WORKERS / "check_autotune.py"), "tune", "320"], env=env,
                  timeout=300).stdout
    assert out.count("OK rank") == 2 and "STATE done" in out, out[-3000:]
    assert out.count("autotune: settled after") == 1, out[-3000:]
    rows = list(csv.DictReader(log.open()))
    assert rows[0]["phase"] == "baseline" and rows[0]["fusion_threshold"] == "4096"
    assert len(json.loads(cache.read_text())["entries"]) == 1
    out = run_mpi(2, [str(WORKERS / "check_autotune.py"), "cached", "5"],
                  env={**env, "LCC_AUTOTUNE_LOG": ""}, timeout=150).stdout
    assert out.count("OK rank") == 2 and "STATE cached" in out, out[-3000:]
    assert out.count("autotune: using the cached setting") == 1, out[-3000:]
