"""Control-plane CPU per training step at 2 ... 4,096 simulated ranks, before and after.

One process, no MPI, no network: every rank's negotiation logic runs here, its messages passed
as the bytes the real control plane would carry (encoded and decoded at each end). One step is
a 164-tensor model in the steady state (every tensor in the response cache, the ranks submit
all of them).

* **star** (the design before issue 31, run from a git revision of lightcc): every rank sends
  rank 0 a pickled ``RankMessage`` with its 164 cache ids; rank 0's ``Coordinator`` decodes and
  matches every (rank, tensor) pair, ``tick()``s and encodes the batch. Cost: rank 0's.
* **slow** (this checkout's coordinator fed the same messages): what rank 0 does today while
  ranks have joined or left (the slow mode), and the work a stall or a change costs once.
* **tree** (this checkout): each rank runs its :class:`~lightcc.common.control.negotiator.Negotiator`:
  cache lookups, its node's bit vectors, its children's reports, and the batch; rank 0 also the
  coordinator's tick and the batch's encoding. Cost per rank; the table shows rank 0's and the
  highest of any rank.
* **over sockets** (``--transport``, this checkout): the tree again, each rank a thread with its
  own control plane (TCP on loopback, frames, ``select``): socket calls count too.
* ``--engine-pairs N``: the real engine on 2 ranks (mpirun), before and after alternated: 164
  four-byte named allreduces per step, one fused bucket, so negotiation is most of the step.

    python benchmarks/control_scale.py --slow --transport 2,8,32,128,512,1024
    python benchmarks/control_scale.py --sizes 2,8,64 --before none
    python benchmarks/control_scale.py --engine-pairs 6      # the real engine, 2 ranks

Times are CPU time (``time.thread_time``) per step, median over the timed steps (per rank in the
tree), with the garbage collector paused while a step is timed. ``--before REV`` runs the
star on the lightcc of git revision REV (default: the last commit before the control tree).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
#: CPU time of this thread: what the control plane costs the rank, without the time other
#: processes of a shared machine take from it (the result of ``time.perf_counter`` varied 10x
#: between runs on the loaded 2-core development machine)
_clock = time.thread_time
BEFORE_REV = "f4e327f"      # main before issue 31 (the star)
TENSORS = 164
SIZES = [2, 8, 32, 128, 512, 1024, 4096]


def model_requests(n: int = TENSORS) -> list:
    from lightcc.common.control.messages import Coll, Request

    shapes = [(512, 512), (512,), (2048, 512), (2048,)]
    return [Request(Coll.ALLREDUCE, f"layer{i // 4}.p{i % 4}", "float32", shapes[i % 4], "sum")
            for i in range(n)]


# ---- the star: rank 0's coordinator matches every pair --------------------------------------
def star(size: int, steps: int) -> dict:
    """Rank 0's ms per step with ``size`` ranks sending their cache ids (any lightcc version
    with ``Coordinator(size, capacity, cycle, threshold)`` and ``RankMessage(cached=...)``)."""
    from lightcc.common.control.controller import Coordinator
    from lightcc.common.control.messages import RankMessage

    reqs = model_requests()
    coord = Coordinator(size, 4 * TENSORS, 0.0, 1 << 40)
    for r in range(size):
        coord.receive(r, RankMessage(requests=list(reqs)))
    batch = coord.tick()
    ids = [coord.cache.lookup(q) if hasattr(coord.cache, "lookup") else i
           for i, q in enumerate(reqs)]
    worker = type(coord.cache)(4 * TENSORS)
    for item in batch.items:
        worker.add(item, 0)
    ids = [worker.lookup(q) for q in reqs]
    assert min(ids) >= 0, "warm-up did not cache the model"
    msgs = [RankMessage(cached=list(ids)).encode() for _ in range(size)]
    times = []
    for _ in range(steps):
        gc.collect()
        gc.disable()
        t0 = _clock()
        for r in range(size):
            coord.receive(r, RankMessage.decode(msgs[r]))
        out = coord.tick()
        out.encode()
        times.append(_clock() - t0)
        gc.enable()
        assert len(out.items) == TENSORS
    return {"rank0_ms": 1e3 * statistics.median(times)}


# ---- the tree: every rank's negotiator ---------------------------------------------------------
def tree(size: int, steps: int, fanout: int) -> dict:
    """Per-rank ms per step in the steady state; see module docstring."""
    from lightcc.common.control.controller import Coordinator
    from lightcc.common.control.messages import Batch
    from lightcc.common.control.negotiator import Negotiator

    reqs = model_requests()
    coord = Coordinator(size, 4 * TENSORS, 0.0, 1 << 40)
    negs = [Negotiator(r, size, 4 * TENSORS, fanout, coordinator=coord if r == 0 else None)
            for r in range(size)]

    def step(timed: bool) -> list[float]:
        cost = [0.0] * size
        inbox: list[list] = [[] for _ in range(size)]
        for r in reversed(range(size)):           # children have higher ranks than parents
            neg = negs[r]
            t0 = _clock()
            for q in reqs:
                neg.submit_named(q)
            for child, data in inbox[r]:
                neg.from_child(child, data)
            data = neg.outgoing()
            cost[r] += _clock() - t0
            if data is not None:
                inbox[neg.parent].append((r, data))
        t0 = _clock()
        batch = coord.tick()
        data = batch.encode()
        cost[0] += _clock() - t0
        assert len(batch.items) == TENSORS, len(batch.items)
        shared = None if timed else Batch.decode(data)    # warm-up: share the decoded objects
        for r in range(size):
            t0 = _clock()
            negs[r].absorb(Batch.decode(data) if timed else shared)
            negs[r].outgoing()                             # nothing to send: checks that
            cost[r] += _clock() - t0
        return cost

    step(False)                                            # full requests, then cached
    assert coord.slow_pairs == size * TENSORS
    per_rank: list[list[float]] = [[] for _ in range(size)]
    for _ in range(steps):
        gc.collect()
        gc.disable()           # collections are paid per allocation, not per rank: not timed
        costs = step(True)
        gc.enable()
        for r, c in enumerate(costs):
            per_rank[r].append(c)
    assert coord.slow_pairs == size * TENSORS, "the steady state went rank by rank"
    med = [statistics.median(c) for c in per_rank]
    worst = max(range(size), key=lambda r: med[r])
    return {"rank0_ms": 1e3 * med[0], "max_ms": 1e3 * med[worst], "max_rank": worst,
            "depth": _depth(negs)}


def _depth(negs) -> int:
    depth = 0
    for neg in negs:
        d, p = 0, neg.parent
        while p is not None:
            d, p = d + 1, negs[p].parent
        depth = max(depth, d)
    return depth


def star_now(size: int, steps: int) -> dict:
    return star(size, steps)


# ---- the tree over the real control plane: ranks as threads, TCP on loopback --------------------
def transport(size: int, steps: int, fanout: int) -> dict:
    """Per-rank CPU ms per step with each rank a thread that runs its negotiator over its own
    :class:`~lightcc.common.control.transport.ControlPlane` (real sockets, frames, ``select``), as the
    engine does; no MPI and no execution. Socket calls count, waiting does not."""
    import threading

    from lightcc.common.control.controller import Coordinator
    from lightcc.common.control.messages import Batch
    from lightcc.common.control.negotiator import Negotiator
    from lightcc.common.control.transport import ControlPlane
    from tests.doubles.fake_nccl import ThreadMPIComm, _Group

    reqs = model_requests()
    group, barrier = _Group(size), threading.Barrier(size)
    per_rank: list[list[float]] = [[] for _ in range(size)]
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            plane = ControlPlane(ThreadMPIComm(group, r), ["h"] * size, fanout=fanout)
            coord = Coordinator(size, 4 * TENSORS, 0.0, 1 << 40) if r == 0 else None
            neg = Negotiator(r, size, 4 * TENSORS, fanout, coordinator=coord)

            def up() -> None:
                data = neg.outgoing()
                if data is not None:
                    plane.send(neg.parent, data)

            def apply(data: bytes) -> int:
                for child in neg.children:
                    plane.send(child, data)
                batch = Batch.decode(data)
                neg.absorb(batch)
                up()
                return len(batch.items)

            for s in range(steps + 2):          # full requests, one warm step, timed steps
                barrier.wait(120)
                t0 = _clock()
                for q in reqs:
                    neg.submit_named(q)
                up()
                got = 0
                while got < TENSORS:
                    if coord is not None:
                        batch = coord.tick()
                        if batch is not None:
                            got += apply(batch.encode())
                            continue
                    for src, data in plane.poll(1.0):
                        if src == neg.parent:
                            got += apply(data)
                        else:
                            neg.from_child(src, data)
                    up()
                if s >= 2:
                    per_rank[r].append(_clock() - t0)
            barrier.wait(120)
            plane.close()
        except BaseException as exc:   # noqa: BLE001 - reported below
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    gc.disable()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    gc.enable()
    if errors:
        raise errors[0]
    med = [statistics.median(c) for c in per_rank]
    worst = max(range(size), key=lambda r: med[r])
    return {"rank0_ms": 1e3 * med[0], "max_ms": 1e3 * med[worst], "max_rank": worst}


# ---- the real engine, before and after: a negotiation-bound step on 2 ranks ----------------------
def engine_worker(blocks: int) -> None:
    """Under mpirun: 164 four-byte named allreduces per step (one fused bucket), submitted
    then waited for; prints rank 0's wall and process CPU (all threads) ms per step, medians
    over blocks of 20 steps."""
    import numpy as np

    import lightcc as lcc

    lcc.init()
    xs = [np.ones(1, np.float32) for _ in range(TENSORS)]
    names = [f"p{i}" for i in range(TENSORS)]

    def step() -> None:
        for h in [lcc.allreduce_async(x, name=n) for x, n in zip(xs, names)]:
            lcc.synchronize(h)

    for _ in range(20):
        step()
    walls, cpus = [], []
    for _ in range(blocks):
        lcc.barrier()
        w0, c0 = time.perf_counter(), time.process_time()
        for _ in range(20):
            step()
        walls.append((time.perf_counter() - w0) / 20e-3)
        cpus.append((time.process_time() - c0) / 20e-3)
    if lcc.rank() == 0:
        print(json.dumps({"wall_ms": statistics.median(walls),
                          "cpu_ms": statistics.median(cpus)}), flush=True)
    lcc.shutdown()


def engine_ab(rev: str, pairs: int, blocks: int) -> list[tuple[dict, dict]]:
    """``pairs`` runs of :func:`engine_worker` on 2 ranks, before (``rev``) and after (this
    checkout) alternated, the order swapped every pair (drift on a shared machine cancels)."""
    sys.path.insert(0, str(REPO))
    from tests.mpi_harness import mpirun_base

    out = []
    with _checkout(rev) as old:
        for i in range(pairs):
            got = {}
            for which in (("before", "after") if i % 2 == 0 else ("after", "before")):
                env = dict(os.environ, PYTHONPATH=old if which == "before" else str(REPO))
                res = subprocess.run(mpirun_base(2) + [sys.executable, __file__,
                                                       "--child-engine", str(blocks)],
                                     env=env, capture_output=True, text=True, timeout=600,
                                     check=True)
                got[which] = json.loads(res.stdout.strip().splitlines()[-1])
            out.append((got["before"], got["after"]))
    return out


# ---- the before column, from a git revision ----------------------------------------------------
class _checkout:
    """``with _checkout(rev) as path``: lightcc of git revision ``rev`` in a temporary dir."""

    def __init__(self, rev: str) -> None:
        self.rev = rev
        self.tmp = tempfile.TemporaryDirectory()

    def __enter__(self) -> str:
        tar = Path(self.tmp.name) / "src.tar"
        subprocess.run(["git", "-C", str(REPO), "archive", "-o", str(tar), self.rev,
                        "lightcc"], check=True)
        with tarfile.open(tar) as tf:
            tf.extractall(self.tmp.name, filter="data")
        return self.tmp.name

    def __exit__(self, *exc) -> None:
        self.tmp.cleanup()


def before(rev: str, sizes: list[int], steps: int, limit_s: float) -> dict[int, dict]:
    """Run :func:`star` on the lightcc of ``rev`` (extracted with git archive) in a child."""
    out: dict[int, dict] = {}
    with _checkout(rev) as tmp:
        env = dict(os.environ, PYTHONPATH=tmp)
        for size in sizes:
            n = steps if size <= 512 else 1
            try:
                res = subprocess.run([sys.executable, __file__, "--child-star", str(size),
                                      "--steps", str(n)], env=env, capture_output=True,
                                     text=True, timeout=limit_s, check=True)
                out[size] = json.loads(res.stdout.strip().splitlines()[-1])
            except subprocess.TimeoutExpired:
                out[size] = {"rank0_ms": float("nan")}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)))
    ap.add_argument("--steps", type=int, default=5, help="timed steps per size")
    ap.add_argument("--fanout", type=int, default=None, help="default: LCC_CONTROL_FANOUT's")
    ap.add_argument("--before", default=BEFORE_REV, help="git revision for the star, or none")
    ap.add_argument("--slow", action="store_true", help="also time the slow mode (star, now)")
    ap.add_argument("--transport", default="", help="also run these sizes with ranks as "
                    "threads over the real control plane, e.g. 2,8,32,128")
    ap.add_argument("--before-limit", type=float, default=600.0, help="s per size")
    ap.add_argument("--json", default="", help="write the rows here too")
    ap.add_argument("--engine-pairs", type=int, default=0, help="instead: this many "
                    "before/after pairs of a negotiation-bound step in the real engine, 2 ranks")
    ap.add_argument("--child-star", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--child-engine", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_star:
        print(json.dumps(star(args.child_star, args.steps)))
        return
    if args.child_engine:
        engine_worker(args.child_engine)
        return
    if args.engine_pairs:
        pairs = engine_ab(args.before, args.engine_pairs, 10)
        print(f"engine, 2 ranks, {TENSORS} four-byte named allreduces per step: rank 0's ms "
              f"per step, before ({args.before}) / after, pairs alternated")
        print("| pair | before wall | after wall | after / before | before CPU | after CPU | "
              "after / before |")
        print("|---|---|---|---|---|---|---|")
        for i, (b, a) in enumerate(pairs, 1):
            print(f"| {i} | {b['wall_ms']:.2f} | {a['wall_ms']:.2f} | "
                  f"{a['wall_ms'] / b['wall_ms']:.2f} | {b['cpu_ms']:.2f} | {a['cpu_ms']:.2f} | "
                  f"{a['cpu_ms'] / b['cpu_ms']:.2f} |")
        wr = statistics.median(a["wall_ms"] / b["wall_ms"] for b, a in pairs)
        cr = statistics.median(a["cpu_ms"] / b["cpu_ms"] for b, a in pairs)
        print(f"median after / before: wall {wr:.2f}, CPU {cr:.2f}")
        return
    sys.path.insert(0, str(REPO))
    from lightcc.common.control.tree import DEFAULT_FANOUT

    fanout = args.fanout or DEFAULT_FANOUT
    sizes = [int(s) for s in args.sizes.split(",")]
    old = before(args.before, sizes, args.steps, args.before_limit) \
        if args.before != "none" else {}
    real = [int(s) for s in args.transport.split(",") if s]
    rows = []
    for size in sorted(set(sizes) | set(real)):
        row = {"ranks": size}
        if size in sizes:
            row["tree"] = tree(size, args.steps, fanout)
        if size in real:
            row["sockets"] = transport(size, args.steps, fanout)
        if args.slow and size in sizes:
            row["slow"] = star_now(size, args.steps if size <= 512 else 1)
        if size in old:
            row["star"] = old[size]
        rows.append(row)
        print(f"# {size} ranks done", file=sys.stderr, flush=True)
    base = rows[0]["tree"]["rank0_ms"] if rows and "tree" in rows[0] and rows[0]["ranks"] == 2 \
        else None
    print(f"control-plane CPU per step, {TENSORS} cached tensors, fanout {fanout} "
          f"(median of {args.steps} steps; before = star at {args.before})")
    head = "| ranks | before: rank 0 ms | before: µs per rank |"
    head += " slow mode now: rank 0 ms |" if args.slow else ""
    head += " after: rank 0 ms | after: µs per rank | after: max of any rank ms | " \
            "max / 2-rank rank 0 | tree depth |"
    head += " over sockets: rank 0 ms | over sockets: max ms |" if real else ""
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    nan = {"rank0_ms": float("nan"), "max_ms": float("nan"), "max_rank": "-", "depth": "-"}
    for row in rows:
        n, t = row["ranks"], row.get("tree", nan)
        b = row.get("star", {}).get("rank0_ms", float("nan"))
        line = f"| {n:,} | {b:,.1f} | {1e3 * b / n:,.0f} |"
        if args.slow:
            line += f" {row.get('slow', nan)['rank0_ms']:,.1f} |"
        ratio = f"{t['max_ms'] / base:.2f}" if base else "-"
        line += (f" {t['rank0_ms']:.3f} | {1e3 * t['rank0_ms'] / n:,.2f} | {t['max_ms']:.3f} "
                 f"(rank {t['max_rank']}) | {ratio} | {t['depth']} |")
        if real:
            k = row.get("sockets", nan)
            line += f" {k['rank0_ms']:.3f} | {k['max_ms']:.3f} (rank {k['max_rank']}) |"
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
