"""Real multi-process runs of the core NumPy API.

The worker scripts of workers_core/ run as cases of one mpirun job per rank count
(workers_core/cases.py: each script in turn, with its own LCC_* variables, its output kept
apart), not one launch each: 4 launches instead of 38 for the same checks. Each test checks
its case's output; a case that fails aborts its job, and the tests of the cases after it
fail too, naming the case that did. The jobs with GPU doubles (which replace modules for the
rest of the process) keep a launch of their own.
"""
from __future__ import annotations

import pytest

from tests.mpi_harness import Cases, run_mpi

W = "tests/parallel/workers_core/"
STALL = {"LCC_STALL_CHECK_TIME": "1", "LCC_STALL_SHUTDOWN_TIME": "3"}
pytestmark = pytest.mark.timeout(900)           # the first test of a rank count runs its job


def _cases(folder) -> Cases:
    c = Cases(folder)
    for np_ in (2, 3, 4):
        c.add(np_, f"collectives-{np_}", "collectives.py")
    for np_ in (2, 3):
        c.add(np_, f"errors-{np_}", "errors.py")
        c.add(np_, f"persistent-{np_}", "persistent.py")
        c.add(np_, f"door-{np_}", "door.py")
    (folder / "stall_events").mkdir()
    c.add(3, "stall", "stall.py", env={**STALL, "LCC_TEST_EVENTS": str(folder / "stall_events")})
    c.add(2, "diverge", "diverge.py", env=STALL)
    for np_, fanout in ((2, "4"), (3, "1"), (4, "2"), (8, "2")):
        c.add(np_, f"steady-{np_}-{fanout}", "steady.py", env={"LCC_CONTROL_FANOUT": fanout})
    for np_, fanout in ((4, "1"), (8, "2")):
        c.add(np_, f"steady_stall-{np_}-{fanout}", "steady_stall.py",
              env={"LCC_CONTROL_FANOUT": fanout, **STALL})
    c.add(4, "relay", "relay_shutdown.py", env={"LCC_CONTROL_FANOUT": "1"})
    for np_, overlap in ((2, "0"), (3, "1")):
        c.add(np_, f"ordered-{np_}-{overlap}", "ordered.py", env={"LCC_OVERLAP": overlap})
    for np_, overlap in ((2, "1"), (3, "0")):
        c.add(np_, f"pump-{np_}-{overlap}", "pump.py", env={"LCC_OVERLAP": overlap})
    for np_, overlap in ((2, "0"), (3, "1"), (4, "auto")):
        c.add(np_, f"direct-{np_}-{overlap}", "direct.py", env={"LCC_OVERLAP": overlap})
    for np_, overlap, local in ((3, "0", "0"), (4, "1", "2")):
        c.add(np_, f"mixed-{np_}-{overlap}-{local}", "direct_mixed.py",
              env={"LCC_OVERLAP": overlap, "LCC_LOCAL_SIZE": local})
    # the ranks order their steps with files in the events folder, so load cannot reorder them
    events = folder / "direct_stall_events"
    events.mkdir()
    c.add(3, "direct_stall", "direct_stall.py",
          env={"LCC_STALL_CHECK_TIME": "1", "LCC_STALL_SHUTDOWN_TIME": "2",
               "LCC_TEST_EVENTS": str(events)})
    for overlap in ("0", "1"):
        c.add(2, f"background-{overlap}", "background_only.py", env={"LCC_OVERLAP": overlap})
    for np_, fusion in ((2, "4096"), (3, "0"), (4, "67108864")):
        c.add(np_, f"random-{np_}-{fusion}", "randomized.py",
              env={"LCC_TEST_FUSION": fusion, "LCC_TEST_SEQUENCES": "200" if np_ < 4 else "60"})
    c.add(3, "readme", code="import lightcc as lcc, numpy as np; lcc.init(); "
                            "print(lcc.allreduce(np.ones(5)*lcc.rank(), op=lcc.Sum))")
    c.add(2, "bad_env", code="import lightcc as lcc\n"
                             "try:\n    lcc.init()\n"
                             "except lcc.ConfigError as e:\n    print('CONFIG', e)\n",
          env={"LCC_FUSION_THRESHOLD": "-5"})
    for np_, local, transport, _ in COMPRESSED:
        c.add(np_, f"compression-{np_}-{local}-{transport}", "engine_compression.py",
              env={"LCC_LOCAL_SIZE": local, "LCC_OVERLAP": "0", "LCC_CROSS_TRANSPORT": transport})
    return c


COMPRESSED = [(2, "0", "auto", ""), (3, "2", "auto", "cross"), (4, "2", "auto", "cross"),
              (4, "2", "mpi", ""), (3, "1", "tcp", "world,cross")]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> Cases:
    return _cases(tmp_path_factory.mktemp("core_cases"))


@pytest.mark.parametrize("np_", [2, 3, 4])
def test_every_collective_dtype_op_shape(jobs, np_):
    out = jobs.output(np_, f"collectives-{np_}")
    assert out.count("checks passed") == np_, out


@pytest.mark.parametrize("np_", [2, 3])
def test_mismatches_fail_on_every_rank_and_engine_recovers(jobs, np_):
    out = jobs.output(np_, f"errors-{np_}")
    assert out.count("errors ok") == np_, out


def test_stall_warning_names_tensor_and_missing_ranks_then_stall_error(jobs):
    out = jobs.output(3, "stall")
    assert "stall: allreduce 'only.rank0'" in out and "missing ranks [1, 2]" in out, out
    assert "StallError" in out and out.count("stall ok") == 3, out


def test_diverged_ranks_fail_with_stall_errors_naming_what_each_waits_in(jobs):
    out = jobs.output(2, "diverge")
    assert out.count("diverge ok") == 2, out


@pytest.mark.parametrize("np_,fanout", [(2, "4"), (3, "1"), (4, "2"), (8, "2")])
def test_steady_state_is_agreed_in_the_control_tree(jobs, np_, fanout):
    """Named, unnamed and ordered calls, a process set, mismatches, changed allgather sizes
    and join, in the steady state of the control tree (fanout 1: a chain; 8 ranks with fanout
    2: two levels of relays)."""
    out = jobs.output(np_, f"steady-{np_}-{fanout}")
    assert out.count("steady ok") == np_, out


@pytest.mark.parametrize("np_,fanout", [(4, "1"), (8, "2")])
def test_stall_in_the_steady_state_names_missing_ranks_and_what_they_wait_in(jobs, np_,
                                                                           fanout):
    out = jobs.output(np_, f"steady_stall-{np_}-{fanout}")
    assert f"missing rank {np_ - 1}; rank {np_ - 1} waits in barrier" in out, out
    assert out.count("steady stall ok") == np_, out


def test_a_relay_that_shuts_down_keeps_relaying_for_its_subtree(jobs):
    out = jobs.output(4, "relay")
    assert out.count("relay ok") == 4, out


@pytest.mark.parametrize("np_,overlap", [(2, "0"), (3, "1")])
def test_ordered_streams_unnamed_and_shared(jobs, np_, overlap):
    out = jobs.output(np_, f"ordered-{np_}-{overlap}")
    assert out.count("ordered ok") == np_, out


@pytest.mark.parametrize("np_,overlap", [(2, "1"), (3, "0")])
def test_negotiation_continues_during_a_long_exchange(jobs, np_, overlap):
    out = jobs.output(np_, f"pump-{np_}-{overlap}")
    assert out.count("pump ok") == np_, out


@pytest.mark.parametrize("np_,overlap", [(2, "0"), (3, "1"), (4, "auto")])
def test_direct_path_of_small_unnamed_allreduces(jobs, np_, overlap):
    out = jobs.output(np_, f"direct-{np_}-{overlap}")
    assert out.count("direct ok") == np_, out


@pytest.mark.parametrize("np_", [2, 3])
def test_persistent_allreduce_and_its_mpi3_fallback(jobs, np_):
    """The direct path's persistent requests (MPI_Allreduce_init), the fallback for MPI
    libraries without them, and 150 payload shapes through a 64-entry cache (NumPy refs)."""
    out = jobs.output(np_, f"persistent-{np_}")
    for what in ("persistent", "fallback", "shapes"):
        assert out.count(f"OK {what}") == np_, out[-4000:]


@pytest.mark.parametrize("np_,overlap,local", [(3, "0", "0"), (4, "1", "2")])
def test_direct_and_engine_paths_interleaved_at_random(jobs, np_, overlap, local):
    out = jobs.output(np_, f"mixed-{np_}-{overlap}-{local}")
    assert out.count("mixed ok") == np_, out


def test_direct_path_stalls_and_shutdowns_end_in_errors_on_every_rank(jobs):
    out = jobs.output(3, "direct_stall")
    assert "stall: unnamed allreduce #1" in out and "has waited" in out, out
    assert "rank 1: ShutdownError" in out and "rank 2 shut down" in out, out
    assert out.count("direct stall ok") == 3, out


@pytest.mark.parametrize("overlap", ["0", "1"])
def test_background_thread_alone_completes_without_missed_wakeups(jobs, overlap):
    out = jobs.output(2, f"background-{overlap}")
    assert out.count("background ok") == 2, out


def test_stall_shutdown_is_finite_by_default():
    from lightcc.common import config

    assert config.load({}, environ={}).stall_shutdown_time == 600.0


@pytest.mark.parametrize("np_,fusion", [(2, "4096"), (3, "0"), (4, "67108864")])
def test_random_sequences_in_random_order(jobs, np_, fusion):
    out = jobs.output(np_, f"random-{np_}-{fusion}")
    assert out.count("random collectives") == np_, out


def test_readme_example_prints_threes(jobs):
    out = jobs.output(3, "readme")
    assert out.count("[3. 3. 3. 3. 3.]") == 3, out


def test_invalid_env_value_is_reported_on_every_rank(jobs):
    out = jobs.output(2, "bad_env")
    assert out.count("CONFIG LCC_FUSION_THRESHOLD=-5: must be >= 0") == 2, out


@pytest.mark.parametrize("np_,local,transport,links", COMPRESSED)
def test_compressed_allreduce_through_engine_every_algorithm(jobs, np_, local, transport, links):
    # against sim.py's simulation of each compressor; LCC_OVERLAP=0: each rank sends a step's
    # tensors in one message when it starts waiting, so they share one batch and one bucket,
    # which the simulation of the hierarchical/2d shards on 2 x 2 simulated nodes assumes (a
    # shard cuts a bucket, not a tensor; compressors are per tensor otherwise). The simulated
    # nodes' point-to-point traffic goes over lightcc's TCP links (LCC_CROSS_TRANSPORT) where
    # ``links`` names communicators; 3 ranks on 2 nodes give rank 2's node one rank, so only
    # the cross communicator of local rank 0 (ranks 0 and 2) has links there
    out = jobs.output(np_, f"compression-{np_}-{local}-{transport}")
    assert out.count("engine compression ok") == np_, out
    assert f"rank 0: tcp links on {links}\n" in out, out


@pytest.mark.parametrize("np_,backend", [(1, "nccl"), (2, "mpi")])
def test_device_path_through_engine_with_gpu_doubles(np_, backend):
    """CuPy/NCCL/torch.cuda doubles (tests/doubles): one rank over the fake NCCL, two ranks
    over real MPI with pinned staging; every algorithm, compressor and collective."""
    out = run_mpi(np_, [W + "device_doubles.py"], env={"LCC_BACKEND": backend},
                  timeout=400).stdout
    for what in ("algorithms x compressors", "collectives", "torch"):
        assert out.count(f"ok {what}") == np_, out
    assert np_ > 1 or "ok no host sync, errors" in out, out


def test_gpu_compressor_check_runs_on_the_gpu_doubles():
    """tests/gpu/compressors_worker.py (the GPU suite's two-rank compressor check, every
    compressor against NumPy simulations) with the CuPy doubles: its logic keeps working where
    no GPU is, so it cannot rot between the runs on a GPU machine."""
    out = run_mpi(2, ["tests/gpu/compressors_worker.py"],
                  env={"LCC_BACKEND": "mpi", "LCC_TEST_DOUBLES": "1"}, timeout=300).stdout
    assert out.count("gpu compressors ok") == 2, out


@pytest.mark.parametrize("np_", [2, 3])
def test_public_door_prepared_compressor_psets_wake_and_p2p(jobs, np_):
    """lightcc.common.api's door for the torch layer and backends.mpi's bootstrap and
    point-to-point calls, errors included (workers_core/door.py)."""
    out = jobs.output(np_, f"door-{np_}")
    assert out.count("door ok") == np_, out
