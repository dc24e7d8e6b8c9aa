"""benchmarks/plots.py: the PNG exists with the documented size, and the points drawn are the
table's values, computed here independently (bus bandwidth = 2(n-1)/n * bytes / seconds)."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("matplotlib")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import plots  # noqa: E402

ROWS = [(1024, {"lightcc": 2e-5, "mpi4py": 4e-5, "gloo": 1e-4}, {}),
        (1 << 20, {"lightcc": 1e-3, "mpi4py": 2e-3, "gloo": 4e-3}, {}),
        (16 << 20, {"lightcc": 1e-2, "mpi4py": 1.5e-2}, {})]


def _png(path: Path) -> np.ndarray:
    import matplotlib.image

    return matplotlib.image.imread(str(path))


def test_allreduce_plot_draws_the_table(tmp_path):
    out = tmp_path / "bw.png"
    drawn = plots.plot_allreduce(ROWS, 4, str(out))
    img = _png(out)
    assert img.shape[:2] == (500, 800)                     # 5 x 8 in at 100 dpi
    assert img[..., :3].std() > 0.01                        # not a blank canvas
    factor = 2 * 3 / 4
    assert set(drawn) == {"lightcc", "mpi4py", "gloo"}
    for col in drawn:
        want = [(b, factor * b / res[col] / 1e9) for b, res, _ in ROWS if col in res]
        assert [p[0] for p in drawn[col]] == [w[0] for w in want]
        np.testing.assert_allclose([p[1] for p in drawn[col]], [w[1] for w in want])
    assert len(drawn["gloo"]) == 2                          # a missing size is not drawn


def test_allreduce_plot_reads_back_from_the_saved_lines(tmp_path, monkeypatch):
    """The figure's own Line2D data (what matplotlib rasterises) equals the table."""
    import matplotlib.pyplot as plt

    seen = {}
    real_close = plt.close

    def keep(fig):
        seen["lines"] = {ln.get_label(): ln.get_xydata().tolist() for ln in fig.axes[0].lines}
        real_close(fig)

    monkeypatch.setattr(plt, "close", keep)
    plots.plot_allreduce(ROWS, 2, str(tmp_path / "x.png"))
    assert seen["lines"]["mpi4py"] == [[1024, 1024 / 4e-5 / 1e9], [1 << 20, (1 << 20) / 2e-3 / 1e9],
                                       [16 << 20, (16 << 20) / 1.5e-2 / 1e9]]


def test_training_plot_bars_are_the_median_over_rounds(tmp_path):
    rows = [{"model": "mlp", "config": "lightcc", "round": r, "img_s": v}
            for r, v in enumerate([100.0, 300.0, 200.0])]
    rows += [{"model": "mlp", "config": "ddp", "round": 0, "img_s": 150.0},
             {"model": "mlp", "phases": {}}]
    out = tmp_path / "t.png"
    drawn = plots.plot_training(rows, str(out), bounds={"mlp": {"barrier bound": 400.0}})
    assert drawn == {"mlp": {"lightcc": 200.0, "ddp": 150.0}}
    assert _png(out).shape[:2] == (500, 800)


@pytest.mark.parametrize("name", ["allreduce-busbw.png", "training-throughput.png"])
def test_the_plots_in_the_docs_are_the_commands_pngs_and_are_shown(name):
    repo = Path(__file__).resolve().parents[2]
    assert _png(repo / "docs" / "img" / name).shape[:2] == (500, 800)   # as plots.py draws
    assert f"](img/{name})" in (repo / "docs" / "benchmarks.md").read_text()
