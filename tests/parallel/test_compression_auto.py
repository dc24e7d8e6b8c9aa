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

from tests.mpi_harness import Cases

WORKER = Path(__file__).resolve().parent / "workers_compression" / "auto_worker.py"
ENV = {"NUMBA_NUM_THREADS": "1"}
pytestmark = pytest.mark.timeout(900)        # the first test of a rank count runs its job


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """The worker's modes as cases of one mpirun job per rank count (workers_core/cases.py):
    2 launches instead of 8. Each case has a folder of its own for its cache and timeline."""
    pytest.importorskip("torch")
    base = tmp_path_factory.mktemp("auto_cases")
    c, dirs = Cases(base, env=ENV), {}

    def add(np_, id_, mode, files):
        """``files``: variable -> the name of a file in the case's folder."""
        dirs[id_] = base / id_
        dirs[id_].mkdir()
        c.add(np_, id_, str(WORKER), args=[mode],
              env={var: str(dirs[id_] / name) for var, name in files.items()})

    for np_ in (2, 3):
        for mode in ("train", "train-slow"):
            add(np_, f"{mode}-{np_}", mode, {"LCC_AUTOTUNE_CACHE": "cache.json",
                                             "LCC_TIMELINE": "timeline.json"})
    add(2, "init-cache", "train", {"LCC_AUTOTUNE_CACHE": "env.json",
                                   "LCC_TEST_INIT_CACHE": "init.json"})
    add(2, "ddp-slow", "ddp-slow", {"LCC_AUTOTUNE_CACHE": "cache.json"})
    add(3, "disagree", "disagree", {})
    add(2, "badknob", "badknob", {})
    return c, dirs


@pytest.mark.parametrize("np_", [2, 3])
@pytest.mark.parametrize("mode", ["train", "train-slow"])
def test_auto_ranks_agree_and_train_like_the_reference(jobs, np_, mode):
    c, dirs = jobs
    out = c.output(np_, f"{mode}-{np_}")
    assert out.count(f"OK auto {mode}") == np_, out[-4000:]
    assert out.count("compression auto:lossless on world") == 1, out[-4000:]
    if mode == "train-slow":
        assert "chose fp16 2 tensors" in out, out[-4000:]
    assert "AUTO_COMPRESSION" in (dirs[f"{mode}-{np_}"] / "timeline.json").read_text()
    entries = json.loads((dirs[f"{mode}-{np_}"] / "cache.json").read_text())["entries"]
    assert len(entries) == 1


def test_init_autotune_cache_argument_is_where_auto_keeps_its_decision(jobs):
    """``init(autotune_cache=...)`` wins over LCC_AUTOTUNE_CACHE for auto's decision cache
    (the decision was kept at the environment's path before)."""
    c, dirs = jobs
    out = c.output(2, "init-cache")
    assert out.count("OK auto train") == 2, out[-4000:]
    assert len(json.loads((dirs["init-cache"] / "init.json").read_text())["entries"]) == 1
    assert not (dirs["init-cache"] / "env.json").exists()


def test_the_ddp_auto_hook_matches_the_reference(jobs):
    """DDP on the lightcc backend with ddp_hooks' auto hook, the probe's result replaced by a
    1 Gbit link's: fp16 per parameter, every step against the reference."""
    out = jobs[0].output(2, "ddp-slow")
    assert out.count("OK auto ddp-slow") == 2, out[-4000:]


def test_ranks_that_disagree_on_auto_all_fail(jobs):
    out = jobs[0].output(3, "disagree")
    assert out.count("OK disagree") == 3, out[-4000:]


def test_an_unknown_accuracy_fails_on_every_rank(jobs):
    out = jobs[0].output(2, "badknob")
    assert out.count("OK badknob") == 2, out[-4000:]
