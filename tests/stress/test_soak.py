"""Short soak for CI (marker ``stress``): 5,000 mixed collectives on 3 ranks, every result
checked against NumPy, then memory / fd / per-name-state growth after warm-up under bounds.
The long form is ``python benchmarks/soak.py`` (50,000 ops; docs/reliability.md)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("lcc_soak", REPO / "benchmarks" / "soak.py")
soak = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(soak)


@pytest.mark.stress
def test_short_soak_results_correct_and_memory_bounded(tmp_path):
    results = soak.run_soak(5000, 3, seed=7, json_base=str(tmp_path / "soak.json"), timeout=120,
                            max_exp=4.0)
    assert len(results) == 3
    for r in results:
        assert r["ops"] >= 5000 and r["checks"] >= r["ops"], r
        g = soak.growth(r)
        assert g["rss_mb"] < soak.RSS_GROWTH_BOUND_MB, f"rank {r['rank']}: RSS grew {g}"
        assert g["fds"] <= soak.FD_GROWTH_BOUND, f"rank {r['rank']}: fds grew {g}"
        assert g["inflight_end"] == 0, g
        last = r["samples"][-1]
        assert last["cache"] <= 1024 and last["cache_ids"] <= 4 * 1024, last
        assert last["coord_pending"] == 0, last
