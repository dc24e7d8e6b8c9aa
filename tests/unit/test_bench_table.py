"""The training benchmark's tables (benchmarks/benchtable.py) from hand-made rows: the min /
median / max column, ratios per round, the best DDP bucket, the bounds with O, peak RSS."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import benchtable as bt  # noqa: E402


def _rows(model, config, values, rss=None):
    return [{"model": model, "config": config, "round": i, "img_s": v, "engine_cpu": 0.1,
             "rss_mb": rss or [100.0, 110.0]} for i, v in enumerate(values)]


def test_spread_shows_a_bimodal_column_as_one():
    assert bt.spread([100.0, 300.0, 310.0, 120.0, 305.0]) == "100 / 300 / 310"
    assert bt.spread([7.25, 7.5, 8.0]) == "7.25 / 7.50 / 8.00"
    assert bt.spread([12.25, 0.234]) == "0.23 / 6.24 / 12.2"
    assert bt.spread([]) == "-"


def test_split_reads_framework_option_and_bucket():
    assert bt.split("ddp:fp16@2") == ("ddp", "fp16", 2.0)
    assert bt.split("ddp") == ("ddp", "", None)
    assert bt.split("cross_barrier:fp8") == ("cross_barrier", "fp8", None)
    assert bt.split("lightcc:fp16+watch") == ("lightcc", "fp16", None)   # training.py's switch
    assert bt.split("lightcc+bare") == ("lightcc", "", None)


def test_ratios_pair_rounds_and_best_ddp_is_the_best_median():
    rows = (_rows("m", "lightcc", [100, 200, 150]) + _rows("m", "ddp", [50, 100, 100])
            + _rows("m", "ddp@4", [100, 120, 300]) + _rows("m", "ddp@1", [90, 95, 99]))
    assert bt.ratios(rows, "m", "lightcc", "ddp") == [2.0, 2.0, 1.5]
    configs = ["lightcc", "ddp", "ddp@4", "ddp@1"]
    assert bt.best_of(rows, "m", "ddp", configs) == "ddp@4"          # median 120 vs 100, 95
    assert bt.ratio_cell([2.0, 2.0, 1.5]) == "2.00x (1.50-2.00)"
    table = bt.throughput_table(rows, configs, ["ddp"])
    head, _, line = table.splitlines()
    cells = {k.strip(): v.strip() for k, v in zip(head.strip("|").split("|"),
                                                 line.strip("|").split("|"))}
    assert cells["lightcc img/s"].strip() == "100 / 150 / 200"
    assert cells["lightcc / ddp"].strip() == "2.00x (1.50-2.00)"
    assert cells["lightcc / best ddp"].strip() == "1.00x (0.50-1.67)"
    assert cells["best ddp"].strip() == "4 MB"


def test_bounds_use_o_from_the_step_without_communication():
    ph = {"F": 0.040, "B": 0.080, "step": 0.150, "grad_bytes": 100e6, "link_Bps": 100e6,
          "world": 2, "hosts": 2, "batch": 32}
    assert bt.host_work(ph) == pytest.approx(0.030)
    assert bt.wire_seconds(ph, "") == pytest.approx(1.0)         # 2 (n-1)/n x 100 MB / 100 MB/s
    assert bt.wire_seconds(ph, "fp16") == pytest.approx(0.5)
    assert bt.wire_seconds(ph, "topk") is None
    barrier, xbar = bt.bounds(ph, 0.5)
    assert barrier == pytest.approx(0.040 + 0.5 + 0.030)
    assert xbar == pytest.approx(0.5)
    barrier, xbar = bt.bounds(ph, 0.01)
    assert (barrier, xbar) == (pytest.approx(0.150), pytest.approx(0.150))
    rows = [{"model": "m", "phases": ph}] + _rows("m", "lightcc:fp16", [64.0])
    line = bt.bounds_table(rows, ["lightcc:fp16"]).splitlines()[-1]
    # step = 32 x 2 / 64 img/s = 1000 ms; barrier bound 570 ms -> 57 %; cross-barrier 500 -> 50 %
    assert "| 1000 | 570 | 57% | 500 | 50% |" in line


def test_rss_table_compares_the_largest_rank_with_ddp():
    rows = _rows("m", "ddp", [1, 1], rss=[100.0, 200.0]) + \
        _rows("m", "lightcc", [1, 1], rss=[150.0, 230.0])
    out = bt.rss_table(rows, ["lightcc", "ddp"], "ddp")
    assert "| m | lightcc | 150 / 230 | 1.15x |" in out


def test_plot_bounds_are_images_per_second_at_the_uncompressed_bounds():
    # hand-worked: F 40 + B 80 + O 30 ms, W = 2 (2-1)/2 x 100 MB / 100 MB/s = 1 s (uncompressed)
    ph = {"F": 0.040, "B": 0.080, "step": 0.150, "grad_bytes": 100e6, "link_Bps": 100e6,
          "world": 2, "hosts": 2, "batch": 32}
    marks = bt.plot_bounds([{"model": "m", "phases": ph}] + _rows("m", "lightcc", [64.0]))
    assert marks == {"m": {"barrier bound": pytest.approx(64 / 1.070),
                           "cross-barrier bound": pytest.approx(64 / 1.0)}}
    ph["link_Bps"] = 1e12                                   # W ~ 0: both bounds are F + B + O
    marks = bt.plot_bounds([{"model": "m", "phases": ph}])
    assert marks == {"m": {"bound (barrier = cross-barrier)": pytest.approx(64 / 0.150)}}
