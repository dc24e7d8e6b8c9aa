"""Injected faults at every site fail exactly the affected bucket on every rank, with the
cause chained on the failing rank, and the next collective succeeds (mpirun -np 3).

Runs with ``LCC_TEST_FAULT=""`` (injection on, no fault yet) and ``LCC_LOCAL_SIZE=2`` (or 1,
with ``LCC_CROSS_TRANSPORT=tcp``: every rank its own host, the agreement over TCP links); the
worker switches specs with ``faults.set_spec`` on every rank while nothing is in flight.
Prints ``faults ok <count>`` per rank.
"""
from __future__ import annotations

import sys

import numpy as np

import lightcc as lcc
from lightcc import CollectiveError
from lightcc.common.observability import faults
from lightcc.common.observability.faults import InjectedFault
from tests.mpi_harness import tcp_links_line

ALGOS = (sys.argv[1].split(",") if len(sys.argv) > 1
         else ["flat", "hierarchical", "2d", "ring", "tree"])
count = 0


def check_failed(exc: BaseException, victims: list[int], tag: str) -> None:
    assert isinstance(exc, CollectiveError), f"{tag}: {type(exc).__name__}: {exc}"
    where = f"rank {victims[0]}" if len(victims) == 1 else f"ranks {victims}"
    assert where in str(exc), f"{tag}: {where!r} not in {exc}"
    if R in victims:
        assert isinstance(exc.__cause__, InjectedFault), f"{tag}: cause {exc.__cause__!r}"
    else:
        assert exc.__cause__ is None, f"{tag}: unexpected cause {exc.__cause__!r}"


def run_case(site: str, algo: str, victims: list[int] | None, coll: str, tag: str,
             mode: str = "end") -> None:
    """One fault: tensor 'victim.<tag>' fails everywhere, 'ok.<tag>.*' succeed."""
    global count
    expected = sorted(set(range(N) if victims is None else victims) & runs_site(site, algo))
    ranks = "*" if victims is None else "+".join(map(str, victims))
    lcc.barrier()
    faults.set_spec(f"{site}:victim.{tag}:{ranks}:{mode}")
    comp = "fp16" if site == "compressor" else None
    n = 3000                                   # 12 KB float32: above LCC_MIN_COMPRESS_BYTES
    x = np.arange(n, dtype=np.float32) * (R + 1)
    want_sum = np.arange(n, dtype=np.float64) * sum(r + 1 for r in range(N))
    handles = {}
    for name in (f"ok.{tag}.0", f"victim.{tag}", f"ok.{tag}.1"):
        if coll == "allreduce":
            handles[name] = lcc.allreduce_async(x, op=lcc.Sum, name=name, compression=comp)
        elif coll == "allgather":
            handles[name] = lcc.allgather_async(x[:10 + R], name=name)
        elif coll == "broadcast":
            handles[name] = lcc.broadcast_async(x[:7], root_rank=1, name=name)
        elif coll == "alltoall":
            handles[name] = lcc.alltoall_async(x[:3 * N], name=name)
        else:
            handles[name] = lcc.reducescatter_async(x[:9], op=lcc.Sum, name=name)
    for name, h in handles.items():
        try:
            got = lcc.synchronize(h)
        except Exception as exc:       # noqa: BLE001 - checked below
            assert name.startswith("victim"), f"{tag}: {name} failed: {exc!r}"
            check_failed(exc, expected, tag)
            count += 1
            continue
        assert not name.startswith("victim"), f"{tag}: {name} did not fail"
        if coll == "allreduce":
            tol = 2e-3 * np.abs(want_sum).max() if comp else 1e-6
            assert np.allclose(got, want_sum, atol=tol), f"{tag}: {name} wrong"
        count += 1
    faults.set_spec("")
    # the next collective (same collective type and algorithm) succeeds everywhere
    got = lcc.allreduce(x, op=lcc.Sum, name=f"next.{tag}", compression=comp)
    tol = 2e-3 * np.abs(want_sum).max() if comp else 1e-6
    assert np.allclose(got, want_sum, atol=tol), f"{tag}: next collective wrong"


def runs_site(site: str, algo: str) -> set[int]:
    """Ranks that run ``site`` for an allreduce: with LCC_LOCAL_SIZE=2 on 3 ranks the nodes
    are {0, 1} and {2}, and hierarchical and 2d compress only between the leaders 0 and 2."""
    if site == "compressor" and algo in ("hierarchical", "2d"):
        return {0, 2}
    return set(range(N))


for algo in ALGOS:
    lcc.init(fusion_threshold=0, algorithm=algo)   # one bucket per tensor
    R, N = lcc.rank(), lcc.size()
    if algo == ALGOS[0]:     # which communicators carry their messages over lightcc's TCP links
        print(tcp_links_line(R), flush=True)
    for site in ("compressor", "algorithm", "backend"):
        for victims in ([2], None, [0, 1]):
            run_case(site, algo, victims, "allreduce", f"{algo}.{site}.{victims}")
    if algo == "flat":   # the same fault on every rank before any communication: recovers
        for site in ("compressor", "algorithm", "backend"):
            run_case(site, algo, None, "allreduce", f"early.{site}", mode="early")
    if algo == ALGOS[0]:
        for coll in ("allgather", "broadcast", "alltoall", "reducescatter"):
            for victims in ([2], None):
                run_case("backend", algo, victims, coll, f"{coll}.{victims}")
    lcc.shutdown()

# fusion on: the whole bucket holding the victim fails on every rank, other buckets succeed
lcc.init(fusion_threshold=1 << 20, cycle_time=50.0)
R, N = lcc.rank(), lcc.size()
lcc.barrier()
faults.set_spec("algorithm:victim.fused:1")
hs = {f"a.{i}": lcc.allreduce_async(np.full(4, float(R)), op=lcc.Sum, name=f"a.{i}")
      for i in range(5)}
hs["victim.fused"] = lcc.allreduce_async(np.full(4, float(R)), op=lcc.Sum, name="victim.fused")
hs["other.dtype"] = lcc.allreduce_async(np.full(4, R, np.int32), op=lcc.Sum, name="other.dtype")
failed = []
for name, h in hs.items():
    try:
        got = lcc.synchronize(h)
        assert np.allclose(got, sum(range(N))), (name, got)
    except CollectiveError as exc:
        check_failed(exc, [1], name)
        failed.append(name)
assert "victim.fused" in failed and "other.dtype" not in failed, failed
# every rank saw the same set of failures
seen = lcc.allgather(np.array([len(failed)]), name="failed.count")
assert len(set(seen.tolist())) == 1, seen
faults.set_spec("")
assert np.allclose(lcc.allreduce(np.ones(3), op=lcc.Sum, name="after.fused"), N)
count += len(hs)
print(f"rank {R}: faults ok {count} fired {len(faults.fired)}", flush=True)
lcc.shutdown()
