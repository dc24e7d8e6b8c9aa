"""compression=auto on 2 and 3 MPI ranks (workers_compression/auto_worker.py).

Every step's reduced gradients are compared with a single-process torch reference built from
every rank's batch (exact mean where auto chose none, the two-phase fp16 simulation where it
chose fp16); the ranks' choices must be equal, the decision logged once by rank 0 and shown
in the timeline. With the probe measuring this machine (one host: uncompressed expected, but
any choice is checked against its own reference) and with the probe's result replaced by a
1 Gbit link's (fp16 through the engine). Bad input: ranks that ask for different accuracies
fail on every rank; an unknown LCC_COMPRESSION_ACCURACY fails init() on every rank.
"""
import json
from pathlib import Path

import pytest

from tests.mpi_harness import run_mpi

WORKER = Path(__file__).resolve().parent / "workers_compression" / "auto_worker.py"
ENV = {"NUMBA_NUM_THREADS": "1"}


@pytest.mark.parametrize("np_", [2, 3])
@pytest.mark.parametrize("mode", ["train", "train-slow"])
def test_auto_ranks_agree_and_train_like_the_reference(np_, mode, tmp_path):
    pytest.importorskip("torch")
    timeline = tmp_path / "timeline.json"
    env = {**ENV, "LCC_AUTOTUNE_CACHE": str(tmp_path / "cache.json"),
           "LCC_TIMELINE": str(timeline)}
    out = run_mpi(np_, [str(WORKER), mode], env=env, timeout=300).stdout
    assert out.count(f"OK auto {mode}") == np_, out[-4000:]
    assert out.count("compression auto:lossless on world") == 1, out[-4000:]
    if mode == "train-slow":
        assert "chose fp16 2 tensors" in out, out[-4000:]
    assert "AUTO_COMPRESSION" in timeline.read_text()
    entries = json.loads((tmp_path / "cache.json").read_text())["entries"]
    assert len(entries) == 1


def test_init_autotune_cache_argument_is_where_auto_keeps_its_decision(tmp_path):
    """``init(autotune_cache=...)`` wins over LCC_AUTOTUNE_CACHE for auto's decision cache
    (the decision was kept at the environment's path before)."""
    pytest.importorskip("torch")
    env = {**ENV, "LCC_AUTOTUNE_CACHE": str(tmp_path / "env.json"),
           "LCC_TEST_INIT_CACHE": str(tmp_path / "init.json")}
    out = run_mpi(2, [str(WORKER), "train"], env=env, timeout=300).stdout
    assert out.count("OK auto train") == 2, out[-4000:]
    assert len(json.loads((tmp_path / "init.json").read_text())["entries"]) == 1
    assert not (tmp_path / "env.json").exists()


def test_the_ddp_auto_hook_matches_the_reference(tmp_path):
    """DDP on the lightcc backend with ddp_hooks' auto hook, the probe's result replaced by a
    1 Gbit link's: fp16 per parameter, every step against the reference."""
    pytest.importorskip("torch")
    env = {**ENV, "LCC_AUTOTUNE_CACHE": str(tmp_path / "cache.json")}
    out = run_mpi(2, [str(WORKER), "ddp-slow"], env=env, timeout=300).stdout
    assert out.count("OK auto ddp-slow") == 2, out[-4000:]


def test_ranks_that_disagree_on_auto_all_fail():
    pytest.importorskip("torch")
    out = run_mpi(3, [str(WORKER), "disagree"], env=ENV, timeout=300).stdout
    assert out.count("OK disagree") == 3, out[-4000:]


def test_an_unknown_accuracy_fails_on_every_rank():
    pytest.importorskip("torch")
    out = run_mpi(2, [str(WORKER), "badknob"], env=ENV, timeout=300).stdout
    assert out.count("OK badknob") == 2, out[-4000:]
