"""Soak: many mixed collectives on 3 ranks, every result checked, memory and fds sampled.

Long form (docs/reliability.md is generated from it)::

    python benchmarks/soak.py --report docs/reliability.md        # 50,000 ops, ~10-20 min

Short form (what ``tests/stress`` runs in CI)::

    python benchmarks/soak.py --ops 5000 --max-exp 4 --json /tmp/soak.json

Each *round* submits 1-8 collectives (allreduce, allgather, broadcast, alltoall,
reducescatter, grouped allreduce) with random sizes (0 to 100k elements, log-uniform),
dtypes, ops, compressors (``available_compressors()``) and, every 200 rounds, a new
allreduce algorithm (``available_algorithms()``), in a different submission order on every
rank, then checks every result against NumPy: exactly for lossless paths (including
``topk:1``), within a per-format tolerance for fp16/bf16/fp8, for ``topk:0.05`` on tensors
seen once by checking that every entry is the sum of some subset of the ranks' entries
(what sparsification without a residual must give, whatever shares the bucket), and for
every lossy result (PowerSGD included) by finiteness and bitwise agreement of all ranks.
Half of the names are stable (reused every round, as in training), half are seen once:
per-name state must not grow with them.
RSS, open fds and the engine's internal tables are sampled every ``--sample-every`` rounds.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
DTYPES = ["float32", "float64", "float16", "bfloat16", "int32", "int64", "uint8"]
KINDS = ["allreduce", "allreduce", "allreduce", "allgather", "broadcast", "alltoall",
         "reducescatter", "grouped"]
FP_EPS = {"fp16": 2.0 ** -10, "bf16": 2.0 ** -7, "fp8": 2.0 ** -3, "fp8_e5m2": 2.0 ** -2}
WARMUP_FRACTION = 0.2
RSS_GROWTH_BOUND_MB = 48.0     # after warm-up; see docs/reliability.md
#: Open fds may not grow at all after warm-up. Each sample is the least of FD_READS reads
#: FD_READ_GAP_S apart (_settled_fds), so an fd that some thread holds for a moment (a file
#: opened and closed, a connection being set up) when a loaded machine happens to sample it
#: does not count, while a leaked fd stays open and does.
FD_GROWTH_BOUND = 0
FD_READS, FD_READ_GAP_S = 5, 0.02


# ---- worker (one per rank) -------------------------------------------------------------------
def _np_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _data(seed: tuple, rank: int, n: int, dtype: str, distinct: bool = False) -> np.ndarray:
    rng = np.random.default_rng([*seed, rank])
    dt = _np_dtype(dtype)
    if dt.kind in "iu":
        lo = 0 if dt.kind == "u" else -50
        return rng.integers(lo, 50, size=n).astype(dt)
    if distinct:   # no ties in magnitude: TopK's choice is unique
        vals = rng.permutation(n).astype(np.float64) + rng.uniform(0.1, 0.9, size=n)
        return (vals / max(n, 1) * rng.choice([-1, 1], size=n) * 2).astype(dt)
    return rng.uniform(-2, 2, size=n).astype(dt)


def _subset_sums(inputs: list[np.ndarray]) -> np.ndarray:
    """Every sum of a subset of the ranks' inputs, shape (2**ranks, n)."""
    x = np.stack([a.astype(np.float64).reshape(-1) for a in inputs])
    masks = np.array([[(m >> r) & 1 for r in range(len(inputs))]
                      for m in range(2 ** len(inputs))], np.float64)
    return masks @ x


class Checker:
    """Reference results, tolerances and a running digest of lossy results."""

    def __init__(self, n_ranks: int) -> None:
        self.n = n_ranks
        self.checks = 0
        self.lossy_digest = 0
        self.by_kind: dict[str, int] = {}

    def count(self, kind: str) -> None:
        self.checks += 1
        self.by_kind[kind] = self.by_kind.get(kind, 0) + 1

    def allreduce(self, got, inputs, op, dtype, comp, fresh, what) -> None:
        dt = _np_dtype(dtype)
        acc = np.stack([x.astype(np.float64 if dt.kind == "f" or dtype == "bfloat16"
                                  else np.int64) for x in inputs])
        ref = {"sum": acc.sum(0), "average": acc.sum(0) / self.n, "min": acc.min(0),
               "max": acc.max(0)}[op]
        if op == "average" and acc.dtype == np.int64:
            ref = np.trunc(acc.sum(0) / self.n)
        g = np.asarray(got).astype(np.float64).reshape(-1)
        ref = ref.reshape(-1)
        assert g.shape == ref.shape, f"{what}: shape {g.shape} vs {ref.shape}"
        name = (comp or "none").split(":")[0]
        amax = float(np.abs(acc).max()) if acc.size else 0.0
        scale = 1.0 / self.n if op == "average" else 1.0
        if name in ("none", "") or g.size == 0 or comp == "topk:1":
            tol = {"float16": 2e-2, "bfloat16": 5e-2}.get(dtype, 1e-6) * max(1.0, amax * self.n)
            if dt.kind in "iu":
                tol = 0
            assert np.all(np.abs(g - ref) <= tol), f"{what}: max err {np.abs(g - ref).max()}"
        elif name in FP_EPS:
            tol = 4 * self.n * FP_EPS[name] * amax * scale + 1e-6
            if dtype in ("float16", "bfloat16"):
                tol += {"float16": 2e-2, "bfloat16": 5e-2}[dtype] * amax * self.n * scale
            assert np.all(np.abs(g - ref) <= tol), f"{what}: {name} err {np.abs(g - ref).max()}"
        elif name == "topk" and fresh and g.size:
            # a tensor seen once has no residual: each entry is the sum of the entries of the
            # ranks that selected it (whatever else shares its bucket)
            subsets = _subset_sums(inputs) * scale
            err = np.abs(subsets - g[None, :]).min(0)
            rel = {"float16": 2e-3, "bfloat16": 1e-2}.get(dtype, 1e-5)
            assert np.all(err <= rel * (1 + np.abs(g))), f"{what}: topk entry not a subset sum"
        if name not in ("none", ""):
            assert np.all(np.isfinite(g)), f"{what}: {name} produced non-finite values"
            self.lossy_digest = zlib.crc32(np.asarray(got).tobytes(), self.lossy_digest)
        self.count(f"allreduce/{name}")


def worker(args: argparse.Namespace) -> None:
    import psutil

    import lightcc as lcc
    from lightcc.common import api
    from lightcc.common.algorithms import available_algorithms
    from lightcc.common.compression import available_compressors

    lcc.init(fusion_threshold=args.fusion, cycle_time=0.5)
    rank, n = lcc.rank(), lcc.size()
    eng = api.engine()
    proc = psutil.Process()
    comps = [c for c in available_compressors()]
    comp_specs = {"topk": ["topk:0.05", "topk:1"], "powersgd": ["powersgd:2"]}
    algos = [a for a in available_algorithms()]
    chk = Checker(n)
    samples = []
    done_ops = 0
    rnd = 0
    t0 = time.monotonic()
    algo = "auto"
    while done_ops < args.ops:
        plan = np.random.default_rng([args.seed, rnd])
        if rnd % 200 == 0:
            algo = algos[rnd // 200 % len(algos)]
            lcc.barrier()
            eng.executor.apply_settings({"algorithm": algo})   # same value, same point, every rank
        ops = []
        for k in range(int(plan.integers(1, 9))):
            kind = KINDS[int(plan.integers(len(KINDS)))]
            dtype = DTYPES[int(plan.integers(len(DTYPES)))]
            size = 0 if plan.random() < 0.05 else int(10 ** plan.uniform(0, args.max_exp))
            fresh = bool(plan.random() < 0.5)
            name = f"{kind}.{k}.{dtype}" + (f".r{rnd}" if fresh else f".s{size % 7}")
            op = ["sum", "average", "min", "max"][int(plan.integers(4))]
            comp = None
            if kind in ("allreduce", "grouped") and op in ("sum", "average") and \
                    _np_dtype(dtype).kind == "f" and plan.random() < 0.6:
                c = comps[int(plan.integers(len(comps)))]
                options = comp_specs.get(c, [c])
                comp = options[int(plan.integers(len(options)))]
                if c == "topk" and dtype == "float64":
                    comp = None   # KNOWN: topk packs float64 values into float32 slots

            root = int(plan.integers(n))
            ops.append((kind, dtype, size, name, op, comp, fresh, root))
        order = np.random.default_rng([args.seed, rnd, rank]).permutation(len(ops))
        handles = {}
        inputs = {}
        for i in order:
            kind, dtype, size, name, op, comp, fresh, root = ops[i]
            seed = (args.seed, rnd, i)
            distinct = False
            if kind == "allreduce":
                xs = [_data(seed, r, size, dtype, distinct) for r in range(n)]
                handles[i] = lcc.allreduce_async(xs[rank], op=op, name=name, compression=comp)
            elif kind == "grouped":
                sizes = [max(0, size // (j + 1)) for j in range(3)]
                xs = [[_data((*seed, j), r, s, dtype, distinct) for j, s in enumerate(sizes)]
                      for r in range(n)]
                handles[i] = lcc.grouped_allreduce_async(xs[rank], op=op, name=name,
                                                         compression=comp)
            elif kind == "allgather":
                xs = [_data(seed, r, (size // 3 + r) * 3, dtype).reshape(-1, 3)
                      for r in range(n)]
                handles[i] = lcc.allgather_async(xs[rank], name=name)
            elif kind == "broadcast":
                xs = [_data(seed, r, size, dtype) for r in range(n)]
                handles[i] = lcc.broadcast_async(xs[rank], root, name=name)
            elif kind == "alltoall":
                splits = [[int(v) for v in np.random.default_rng([*seed, r]).integers(
                    0, size // n + 2, size=n)] for r in range(n)]
                xs = [(_data(seed, r, sum(splits[r]) * 2, dtype).reshape(-1, 2), splits[r])
                      for r in range(n)]
                handles[i] = lcc.alltoall_async(xs[rank][0], splits=xs[rank][1], name=name)
            else:
                xs = [_data(seed, r, size, dtype) for r in range(n)]
                op = "max" if op in ("min", "max") else op
                ops[i] = (kind, dtype, size, name, op, comp, fresh, root)
                handles[i] = lcc.reducescatter_async(xs[rank], op=op, name=name)
            inputs[i] = xs
        for i in range(len(ops)):
            kind, dtype, size, name, op, comp, fresh, root = ops[i]
            got = handles[i].wait()
            xs = inputs[i]
            what = f"round {rnd} op {i} {kind} {dtype} n={size} {op} {comp} {algo} '{name}'"
            if kind == "allreduce":
                chk.allreduce(got, xs, op, dtype, comp, fresh, what)
            elif kind == "grouped":
                for j in range(3):
                    chk.allreduce(got[j], [x[j] for x in xs], op, dtype, comp, fresh,
                                  f"{what}[{j}]")
            elif kind == "allgather":
                assert np.array_equal(got, np.concatenate(xs)), what
                chk.count(kind)
            elif kind == "broadcast":
                assert np.array_equal(got, xs[root]), what
                chk.count(kind)
            elif kind == "alltoall":
                out, recv = got
                want = np.concatenate([x[sum(s[:rank]):sum(s[:rank + 1])] for x, s in xs])
                assert np.array_equal(out, want) and \
                    list(recv) == [s[rank] for _, s in xs], what
                chk.count(kind)
            else:
                full = np.zeros(size) if not size else None
                stack = np.stack([x.astype(np.float64) for x in xs])
                full = {"sum": stack.sum(0), "average": stack.sum(0) / n,
                        "max": stack.max(0)}[op]
                if op == "average" and _np_dtype(dtype).kind in "iu":
                    full = np.trunc(stack.sum(0) / n)
                counts = [size // n + (1 if j < size % n else 0) for j in range(n)]
                part = full[sum(counts[:rank]):sum(counts[:rank + 1])]
                tol = {"float16": 2e-2, "bfloat16": 5e-2}.get(dtype, 1e-6) * 8
                assert np.allclose(np.asarray(got).astype(np.float64), part, atol=tol), what
                chk.count(kind)
        done_ops += len(ops)
        rnd += 1
        if rnd % args.sample_every == 0 and done_ops < args.ops:
            samples.append(_sample(proc, eng, done_ops, time.monotonic() - t0))
        if rnd % 500 == 0:       # all ranks got bit-identical lossy results so far
            dig = lcc.allgather(np.array([chk.lossy_digest], np.int64), name="soak.digest")
            assert len(set(dig.tolist())) == 1, f"lossy results differ across ranks: {dig}"
    dig = lcc.allgather(np.array([chk.lossy_digest], np.int64), name="soak.digest")
    assert len(set(dig.tolist())) == 1, f"lossy results differ across ranks: {dig}"
    # the last sample after a barrier: before it, a faster rank may already have submitted the
    # next collective, which rank 0's coordinator then rightly holds as pending
    lcc.barrier()
    samples.append(_sample(proc, eng, done_ops, time.monotonic() - t0))
    result = {"rank": rank, "ops": done_ops, "rounds": rnd, "checks": chk.checks,
              "by_kind": chk.by_kind, "seconds": time.monotonic() - t0, "samples": samples,
              "compressors": comps, "algorithms": algos}
    lcc.shutdown()
    if args.json:
        Path(f"{args.json}.rank{rank}").write_text(json.dumps(result))
    print(f"rank {rank}: soak ok {done_ops} ops {chk.checks} checks", flush=True)


def _settled_fds(proc) -> int:
    """Open fds, the least of FD_READS reads (a transient fd is gone by one of them)."""
    counts = []
    for i in range(FD_READS):
        if i:
            time.sleep(FD_READ_GAP_S)
        counts.append(proc.num_fds())
    return min(counts)


def _sample(proc, eng, ops: int, seconds: float) -> dict:
    """RSS (MiB), open fds and the sizes of the engine's per-name tables."""
    state_bytes, state_keys = 0, 0
    for comp in eng.group(0).compressors.values():
        mem = getattr(comp, "memory", None)
        if mem is not None:
            state_keys += len(mem.residuals)
            state_bytes += sum(r.nbytes for r in mem.residuals.values())
        qs = getattr(comp, "qs", None)
        if qs:
            state_keys += len(qs)
            state_bytes += sum(q.nbytes for q in qs.values())
    coord = eng.coordinator
    return {"ops": ops, "s": round(seconds, 2), "rss_mb": proc.memory_info().rss / 2 ** 20,
            "fds": _settled_fds(proc), "cache": len(eng.cache),
            "cache_ids": len(eng.cache._entries),
            "coord_pending": len(coord.pending) if coord else 0,
            "inflight": len(eng.submissions.inflight), "fusion_mb": eng.group(0).fusion.nbytes / 2 ** 20,
            "comp_state_keys": state_keys, "comp_state_mb": state_bytes / 2 ** 20}


# ---- launcher and report ---------------------------------------------------------------------
def run_soak(ops: int, np_: int, seed: int, json_base: str, timeout: float,
             max_exp: float = 5.0) -> list[dict]:
    sys.path.insert(0, str(REPO))
    from tests.mpi_harness import run_mpi

    run_mpi(np_, [str(Path(__file__).resolve()), "--worker", "--ops", str(ops), "--seed",
                  str(seed), "--json", json_base, "--max-exp", str(max_exp)], timeout=timeout)
    return [json.loads(Path(f"{json_base}.rank{r}").read_text()) for r in range(np_)]


def growth(result: dict) -> dict:
    """Growth of RSS / fds / tables from the end of warm-up to the end of the run."""
    s = result["samples"]
    start = next((x for x in s if x["ops"] >= WARMUP_FRACTION * result["ops"]), s[0])
    end = s[-1]
    return {k: end[k] - start[k] for k in ("rss_mb", "fds", "cache", "comp_state_keys",
                                           "comp_state_mb", "fusion_mb")} | \
        {"from_ops": start["ops"], "to_ops": end["ops"], "rss_start": start["rss_mb"],
         "rss_end": end["rss_mb"], "fds_end": end["fds"], "inflight_end": end["inflight"]}


def table(results: list[dict]) -> str:
    rows = ["| rank | ops | checks | seconds | RSS after warm-up → end (MiB) | RSS growth "
            "(MiB) | fds growth | compressor state keys / MiB growth | fusion buffer (MiB) |",
            "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        g = growth(r)
        rows.append(f"| {r['rank']} | {r['ops']} | {r['checks']} | {r['seconds']:.0f} | "
                    f"{g['rss_start']:.0f} → {g['rss_end']:.0f} | {g['rss_mb']:+.1f} | "
                    f"{g['fds']:+d} | {g['comp_state_keys']:+d} / {g['comp_state_mb']:+.1f} | "
                    f"{r['samples'][-1]['fusion_mb']:.1f} |")
    return "\n".join(rows)


def run_checks() -> dict[str, str]:
    """Run the fault, bad-input and thread workers once and return their summary lines."""
    sys.path.insert(0, str(REPO))
    from tests.mpi_harness import run_mpi

    w = "tests/parallel/workers_reliability/"
    out = {}
    out["faults"] = run_mpi(3, [w + "faults_worker.py"], env={"LCC_TEST_FAULT": "",
                                                               "LCC_LOCAL_SIZE": "2"},
                            timeout=300).stdout
    out["badinput"] = run_mpi(3, [w + "badinput_worker.py"], timeout=300).stdout
    out["threads"] = run_mpi(3, [w + "threads_worker.py"], timeout=300).stdout
    return out


def write_report(path: Path, results: list[dict], checks: dict[str, str]) -> None:
    template = path.read_text(encoding="utf-8") if path.exists() else ""
    begin, end = "<!-- soak:begin -->", "<!-- soak:end -->"
    r0 = results[0]
    lines = [begin, "", f"Generated by `python benchmarks/soak.py --report {path}` "
             f"on {time.strftime('%Y-%m-%d')}, {len(results)} ranks, "
             f"compressors {', '.join(r0['compressors'])}, algorithms "
             f"{', '.join(r0['algorithms'])}.", ""]
    kinds = ", ".join(f"{k} {v}" for k, v in sorted(r0["by_kind"].items()))
    faults = next((ln for ln in checks["faults"].splitlines() if "faults ok" in ln), "?")
    handles, _, fired = faults.split("faults ok ")[1].partition(" fired ")
    bad = next((ln for ln in checks["badinput"].splitlines() if "badinput ok" in ln), "?")
    thr = next((ln for ln in checks["threads"].splitlines() if "threads ok" in ln), "?")
    known = sorted({ln.split("KNOWN: ")[1].split(" ")[0] for ln in
                    checks["badinput"].splitlines() if "KNOWN:" in ln})
    stale = "accepted (bug)" if "STALE-PSET-ACCEPTED" in checks["threads"] else "rejected"
    lines += ["| what was tried | count | what happened |", "|---|---|---|",
              f"| mixed collectives, results checked (rank 0) | {r0['ops']} ops, "
              f"{r0['checks']} checks | all correct; lossy results bit-identical on every "
              f"rank ({kinds}) |",
              f"| injected faults (compressor / algorithm / backend, one rank, several ranks, "
              f"all ranks, fused and unfused; algorithms flat, hierarchical, 2d, ring, tree) | "
              f"{handles} handles checked, {fired} faults raised on rank 0 | exactly the "
              f"affected buckets failed on every rank, cause chained on the failing rank; "
              f"the next collective succeeded |",
              f"| bad inputs (types, roots, splits, views, read-only, empty, 0-d, names, "
              f"NaN/Inf with every compressor, large-count paths) | "
              f"{bad.split('badinput ok ')[1]} checks per rank | right result or clear error "
              f"on every rank; known issues: {', '.join(known) or 'none'} |",
              f"| user threads + init/shutdown cycles | {thr.split('threads ok ')[1]} | all "
              f"correct; stale ProcessSet after re-init: {stale} |", "",
              "Memory and file descriptors, from the end of warm-up "
              f"({int(WARMUP_FRACTION * 100)} % of the ops) to the end:", "", table(results),
              "", end]
    block = "\n".join(lines)
    if begin in template and end in template:
        pre, rest = template.split(begin, 1)
        post = rest.split(end, 1)[1]
        text = pre + block + post
    else:
        text = template + "\n" + block + "\n"
    path.write_text(text, encoding="utf-8")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ops", type=int, default=50_000)
    p.add_argument("--np", type=int, default=3)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--fusion", type=int, default=1 << 20, help="fusion threshold, bytes")
    p.add_argument("--max-exp", type=float, default=5.0, help="sizes up to 10**max_exp")
    p.add_argument("--sample-every", type=int, default=50, help="rounds between samples")
    p.add_argument("--json", default="", help="write per-rank results to JSON.rank<N>")
    p.add_argument("--report", default="", help="regenerate this markdown report")
    p.add_argument("--timeout", type=float, default=7200.0)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    base = args.json or f"/tmp/lcc-soak-{os.getpid()}.json"
    results = run_soak(args.ops, args.np, args.seed, base, args.timeout, args.max_exp)
    print(table(results))
    for r in results:
        g = growth(r)
        print(f"rank {r['rank']}: growth after warm-up {g}")
    if args.report:
        write_report(Path(args.report), results, run_checks())
        print(f"wrote {args.report}")


if __name__ == "__main__":
    main()
