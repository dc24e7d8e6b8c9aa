"""End-to-end training throughput: lightcc against what users would run instead, in one run.

One command prints one table (images/s over all ranks, and ratios to a baseline column)::

    python benchmarks/training.py                         # 2 ranks on this machine
    python benchmarks/training.py --models resmlp --configs lightcc,ddp --rounds 5
    sudo python benchmarks/training.py --netns            # 2 simulated hosts, 1 Gbit link
    sudo python benchmarks/training.py --netns --ranks-per-host 2   # 2 hosts x 2 ranks

Columns (``--configs``, comma separated):

- ``lightcc`` / ``lightcc:fp16`` / ``:bf16`` / ``:fp8`` / ``:topk`` / ``:auto`` /
  ``:auto-lossy``: ``lightcc.torch``'s ``DistributedOptimizer`` with that compressor
  (``auto-lossy``: ``Compression.auto(accuracy="lossy")``);
- ``cross_barrier`` / ``cross_barrier:fp16`` / ...: the same with ``cross_barrier=True``
  (docs/cross-barrier.md): each module's update is applied just before its next forward;
- ``ddp`` / ``ddp:fp16`` / ``ddp:bf16``: ``DistributedDataParallel`` on gloo, plain or with
  torch's own ``fp16_compress_hook`` / ``bf16_compress_hook`` (torch 2.13 refuses its bf16
  hook without CUDA/NCCL, so ``ddp:bf16`` runs only on GPU builds and is not a default);
- ``ddp-lcc`` / ``ddp-lcc:fp16`` / ``:bf16`` / ``:fp8`` / ``:topk`` / ``:powersgd`` / ``:auto``:
  ``DistributedDataParallel`` on the torch.distributed backend ``lightcc``, plain or with
  that ``lightcc.torch.ddp_hooks`` hook;
- ``fsdp`` / ``fsdp:reduce-bf16``: FSDP2 (``fully_shard`` per child module) on gloo, plain
  or with torch's ``MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)``;
  ``fsdp-lcc`` / ``fsdp-lcc:reduce-bf16`` / ``:fp16`` / ``:bf16`` / ``:fp8``: FSDP2 on the
  ``lightcc`` backend, plain, with torch's bf16 reduction, or with
  ``lightcc.torch.fsdp.compress`` in that format;
- ``local``: the same loop with no communication at all (every rank trains alone): the
  ceiling no library can pass, which shows how much of a step communication costs at all;
- ``sync``: ``local`` plus a barrier (MPI) after every step: what waiting for the slower rank
  costs, before any bytes move.

Models (``--models``): ``mlp`` (6 large tensors), ``resmlp`` (164 small tensors), ``cnn``
(29 tensors, compute-bound), ``transformer`` (embedding + 12 uniform encoder blocks; not a
default); see benchmarks/models.py. Every rank trains the same model on
synthetic MNIST-shaped data, SGD with momentum, ``--batch-size`` samples per rank, one torch
thread per rank (``--threads``). Columns run one after the other inside the same processes and
alternate for ``--rounds`` rounds; a round's figure is the median step of the slowest rank, the
table shows the best round and the median over rounds. With ``--cpu`` the table adds the
lightcc engine thread's share of one core during the timed steps (rank 0).

Per model the worker first measures, with no communication, the forward time F and the
backward time B (medians), and the link rate (a pairwise MPI exchange of 8 MB, both
directions at once, with a partner on another host when there are several; every rank of a
host exchanges at once, so the host's link rate is the sum); a second table gives, per lightcc
column, the wire time W (bytes that cross a link per step, 2 (n-1)/n x the gradient bytes
after compression, n = the hosts, or the ranks on one machine, / that rate), the barrier bound F + max(B, W) (the wire can start during backward, forward cannot
start before the last gradient arrived), the cross-barrier bound max(F + B, W), and the
measured step as a fraction of each (bound / step).

``--engine-cost`` prints the per-tensor cost of lightcc's engine on a single rank: 164 small
in-place allreduces through ``lightcc.torch`` per step, µs per tensor.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for p in (str(REPO), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

DEFAULT_CONFIGS = "lightcc,cross_barrier,ddp,ddp-lcc"
NETNS_CONFIGS = ("lightcc,lightcc:fp16,lightcc:bf16,lightcc:fp8,lightcc:topk,cross_barrier,"
                 "cross_barrier:fp16,cross_barrier:fp8,ddp,ddp:fp16,"
                 "ddp-lcc,ddp-lcc:fp16,ddp-lcc:topk")
ENGINE_CONFIGS = ("lightcc", "ddp-lcc", "cross_barrier")   # columns running lightcc's engine
# bytes on the wire per gradient byte, per compressor (TopK/PowerSGD: depends on the bucket)
WIRE_FACTOR = {"none": 1.0, "fp16": 0.5, "bf16": 0.5, "fp8": 0.25}


# ---- worker (runs on every rank under mpirun) -------------------------------------------------
def _thread_cpu_seconds(native_id: int | None) -> float:
    """CPU seconds (user + system) used so far by one thread of this process (Linux)."""
    if native_id is None:
        return 0.0
    try:
        with open(f"/proc/self/task/{native_id}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except OSError:
        return 0.0


def _engine_thread_id() -> int | None:
    import threading

    for t in threading.enumerate():
        if t.name == "lightcc-engine":
            return t.native_id
    return None


class Worker:
    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        import lightcc  # noqa: F401  (before MPI starts: its Open MPI settings, as for users)
        from mpi4py import MPI

        self.args = args
        self.comm = MPI.COMM_WORLD
        self.rank, self.world = self.comm.Get_rank(), self.comm.Get_size()
        torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // self.world))
        g = torch.Generator().manual_seed(1000 + self.rank)
        self.data = [(torch.rand(args.batch_size, 1, 28, 28, generator=g),
                      torch.randint(0, 10, (args.batch_size,), generator=g)) for _ in range(8)]
        self._lcc = None
        self._ddp_ready = False
        self._lcc_group = None
        self._keep: list = []   # DDP objects: freeing a Reducer can deadlock with gloo threads

    # -- frameworks -------------------------------------------------------------------------
    def lightcc(self):
        if self._lcc is None:
            import lightcc.torch as lcc

            lcc.init()
            self._lcc = lcc
        return self._lcc

    def _ddp_init(self) -> None:
        import torch.distributed as dist

        if not self._ddp_ready:
            os.environ.setdefault("MASTER_ADDR", os.environ.get("LCC_BENCH_MASTER", "127.0.0.1"))
            os.environ.setdefault("MASTER_PORT", str(self.args.port))
            dist.init_process_group("gloo", rank=self.rank, world_size=self.world)
            self._ddp_ready = True

    def lightcc_group(self):
        """A torch.distributed group of all ranks on the ``lightcc`` backend (made once)."""
        import torch.distributed as dist

        import lightcc.torch  # noqa: F401 - registers the backend

        self._ddp_init()
        if self._lcc_group is None:
            self._lcc_group = dist.new_group(backend="lightcc")
        return self._lcc_group

    def make(self, model_name: str, config: str):
        """(model, optimizer) for one column."""
        import torch

        import models

        framework, _, option = config.partition(":")
        torch.manual_seed(0)
        model = models.build(model_name)
        if framework in ("lightcc", "cross_barrier"):
            lcc = self.lightcc()
            opt = _sgd(model)
            lcc.broadcast_parameters(model.state_dict(), root_rank=0)
            comp = _compression(lcc, option or "none")
            xbar = framework == "cross_barrier"
            opt = lcc.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                           compression=comp, cross_barrier=xbar,
                                           model=model if xbar else None)
            return model, opt
        if framework == "ddp":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
            import torch.distributed as dist

            self._ddp_init()
            model = torch.nn.parallel.DistributedDataParallel(model)
            if option:
                hook = {"fp16": default_hooks.fp16_compress_hook,
                        "bf16": default_hooks.bf16_compress_hook}.get(option)
                if hook is None:
                    raise SystemExit(f"ddp:{option}: torch has no such hook (fp16, bf16)")
                model.register_comm_hook(dist.group.WORLD, hook)
            opt = _sgd(model)
            self._keep.append((model, opt))
            return model, opt
        if framework == "local":
            return model, _sgd(model)
        if framework == "sync":
            return model, _Synced(_sgd(model), self.comm)
        if framework == "ddp-lcc":
            from lightcc.torch import ddp_hooks

            group = self.lightcc_group()
            model = torch.nn.parallel.DistributedDataParallel(model, process_group=group)
            if option:
                if option not in ddp_hooks.HOOKS:
                    raise SystemExit(f"ddp-lcc:{option}: no such lightcc hook "
                                     f"({', '.join(ddp_hooks.HOOKS)})")
                ddp_hooks.register(model, option, process_group=group)
            opt = _sgd(model)
            self._keep.append((model, opt))
            return model, opt
        if framework in ("fsdp", "fsdp-lcc"):
            model = self._fsdp(model, framework, option)
            opt = _sgd(model)
            self._keep.append((model, opt))
            return model, opt
        raise SystemExit(f"unknown framework in config {config!r}")

    def _fsdp(self, model, framework: str, option: str):
        """FSDP2 (``fully_shard`` on every child with parameters, then the root) on gloo or the
        lightcc group; ``reduce-bf16``: torch's MixedPrecisionPolicy(reduce_dtype=bfloat16);
        ``fp16``/``bf16``/``fp8``: lightcc.torch.fsdp.compress with that format."""
        import torch
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if framework == "fsdp-lcc":
            group = self.lightcc_group()
        else:
            self._ddp_init()
            group = dist.group.WORLD
        kw = {"mesh": DeviceMesh.from_group(group, "cpu")}
        if option == "reduce-bf16":
            kw["mp_policy"] = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)
        elif option not in ("", "fp16", "bf16", "fp8"):
            raise SystemExit(f"{framework}:{option}: not an FSDP option "
                             f"(reduce-bf16, fp16, bf16, fp8)")
        for child in model.children():
            if any(True for _ in child.parameters()):
                fully_shard(child, **kw)
        fully_shard(model, **kw)
        if option in ("fp16", "bf16", "fp8"):
            import lightcc
            import lightcc.torch.fsdp

            lightcc.torch.fsdp.compress(model, _compression(lightcc, option))
        return model

    def barrier(self) -> None:
        self.comm.Barrier()

    # -- measurement --------------------------------------------------------------------------
    def run(self, model_name: str, config: str) -> dict:
        import torch.nn.functional as F

        model, opt = self.make(model_name, config)
        args = self.args
        tid = _engine_thread_id() if config.startswith(ENGINE_CONFIGS) else None
        times: list[float] = []
        cpu0 = wall0 = 0.0
        for i in range(args.warmup + args.iters):
            if i == args.warmup:
                self.barrier()
                cpu0, wall0 = _thread_cpu_seconds(tid), time.perf_counter()
            x, y = self.data[i % len(self.data)]
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            opt.step()
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
        share = (_thread_cpu_seconds(tid) - cpu0) / max(time.perf_counter() - wall0, 1e-9)
        if hasattr(opt, "synchronize"):
            opt.synchronize()       # cross_barrier: apply the last step's pending updates
        self.barrier()
        slowest = self.comm.allreduce(statistics.median(times), op=_max())
        return {"img_s": args.batch_size * self.world / slowest, "engine_cpu": share}


    def phases(self, model_name: str) -> dict:
        """Forward and backward seconds (medians, no communication; the slowest rank's), the
        model's gradient bytes and the link rate (bytes/s one way, each rank exchanging 8 MB
        with a partner in both directions at once, median of 5)."""
        import numpy as np
        import torch
        import torch.nn.functional as F

        import models

        torch.manual_seed(0)
        model = models.build(model_name)
        opt = _sgd(model)
        fwd, bwd = [], []
        for i in range(self.args.warmup + self.args.iters):
            x, y = self.data[i % len(self.data)]
            opt.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            loss = F.cross_entropy(model(x), y)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            opt.step()
            if i >= self.args.warmup:
                fwd.append(t1 - t0)
                bwd.append(t2 - t1)
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        rate = 0.0
        # a partner on another host when there are several (ranks of a host are consecutive);
        # every rank of a host exchanges at once, so the host's link carries local x the rate
        local = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", "1") or 1)
        hosts = self.world // local if local < self.world and self.world % local == 0 else 1
        if hosts > 1:
            partner = self.rank + local if (self.rank // local) % 2 == 0 else self.rank - local
        else:
            partner, local = self.rank ^ 1, 1
        if partner < self.world:
            buf, got = np.ones(8 << 20, np.uint8), np.empty(8 << 20, np.uint8)
            times = []
            for _ in range(5):
                self.comm.Sendrecv(buf[:1024], partner, recvbuf=got[:1024], source=partner)
                t0 = time.perf_counter()
                self.comm.Sendrecv(buf, partner, recvbuf=got, source=partner)
                times.append(time.perf_counter() - t0)
            rate = buf.nbytes / statistics.median(times)
        self.barrier()
        return {"F": self.comm.allreduce(statistics.median(fwd), op=_max()),
                "B": self.comm.allreduce(statistics.median(bwd), op=_max()),
                "grad_bytes": nbytes, "link_Bps": local * self.comm.allreduce(rate, op=_min()),
                "world": self.world, "hosts": hosts, "batch": self.args.batch_size}


def _sgd(model):
    """The optimizer every column trains with (the same one, so columns compare)."""
    import torch

    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


class _Synced:
    """An optimizer whose step ends with a barrier of all ranks (the ``sync`` column)."""

    def __init__(self, opt, comm) -> None:
        self.opt, self.comm = opt, comm

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.opt.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        self.opt.step()
        self.comm.Barrier()


def _max():
    from mpi4py import MPI

    return MPI.MAX


def _min():
    from mpi4py import MPI

    return MPI.MIN


def _compression(lcc, name: str):
    if name == "none":
        return lcc.Compression.none
    if name == "auto-lossy":
        return lcc.Compression.auto(accuracy="lossy")
    value = getattr(lcc.Compression, name)
    return value() if callable(value) else value


def engine_cost(args: argparse.Namespace) -> dict:
    """µs per gradient per step of DistributedOptimizer's path through the engine on one rank:
    the post-accumulate-grad hook of each of resmlp's 164 parameters, then ``synchronize()``
    (what a training step adds to backward, without the backward itself)."""
    import torch

    import lightcc.torch as lcc
    import models

    lcc.init()
    model = models.build("resmlp")
    opt = lcc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    params = [p for p in model.parameters()]
    for p in params:
        p.grad = torch.randn_like(p)
    per_step, cpu = [], []
    for step in range(args.iters + args.warmup):
        t0, c0 = time.perf_counter(), time.process_time()
        for p in params:
            opt._on_grad(p)          # what autograd's hook calls (registered only on > 1 rank)
        opt.synchronize()
        if step >= args.warmup:
            per_step.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    lcc.shutdown()
    n = len(params)
    return {"us_per_tensor": statistics.median(per_step) / n * 1e6,
            "cpu_us_per_tensor": statistics.median(cpu) / n * 1e6}


def worker_main(args: argparse.Namespace) -> None:
    if args.engine_cost_only:
        print("ROW " + json.dumps({"engine_cost": engine_cost(args)}), flush=True)
        return
    w = Worker(args)
    for model_name in args.models.split(","):
        ph = w.phases(model_name)
        if w.rank == 0:
            print("ROW " + json.dumps({"model": model_name, "phases": ph}), flush=True)
        for rnd in range(args.rounds):
            for config in args.configs.split(","):
                res = w.run(model_name, config)
                if w.rank == 0:
                    print("ROW " + json.dumps({"model": model_name, "config": config,
                                               "round": rnd, **res}), flush=True)
    if w._lcc is not None:
        w._lcc.shutdown()


# ---- driver -----------------------------------------------------------------------------------
def _mpirun_local(np_: int) -> list[str]:
    from tests.mpi_harness import mpirun_base

    return mpirun_base(np_)


def launch(args: argparse.Namespace, extra: list[str], np_: int) -> list[dict]:
    """Run this file as a worker on ``np_`` ranks (or across simulated hosts); parse rows."""
    cmd_tail = [sys.executable, str(Path(__file__).resolve()), "--worker", *extra]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
    env["PYTHONUNBUFFERED"] = "1"
    if args.netns:
        from tests.netns.simhosts import SimHosts, unavailable_reason

        reason = unavailable_reason()
        if reason:
            raise SystemExit(f"--netns: {reason}")
        with SimHosts(np_, args.rate) as sim:
            env["LCC_BENCH_MASTER"] = sim.addrs[0]
            env["GLOO_SOCKET_IFNAME"] = "lcc0"
            env.update(sim.env())
            # two TCP connections per pair of ranks, as lccrun launches a job (and as
            # lcc.init() sets for plain mpirun when it starts MPI itself): on one connection
            # Open MPI's rendezvous replies queue behind a rank's own outgoing data
            # ranks of one simulated host share memory (btl sm), as on a real node
            per_host = args.ranks_per_host
            cmd = sim.mpirun_cmd(per_host, num_links=2,
                                 btl="tcp,sm,self" if per_host > 1 else "tcp,self") + cmd_tail
            out = _run(cmd, env, args.timeout)
    else:
        out = _run(_mpirun_local(np_) + cmd_tail, env, args.timeout)
    rows = []
    for line in out.splitlines():
        if line.startswith("ROW "):
            rows.append(json.loads(line[4:]))
        elif args.verbose or "Error" in line or "error" in line:
            print(line, file=sys.stderr)
    return rows


def _run(cmd: list[str], env: dict, timeout: float) -> str:
    """Run the job; print a progress line per finished row (stderr) while it runs."""
    import threading

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)
    timer = threading.Timer(timeout, proc.kill)
    timer.start()
    lines: list[str] = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("ROW "):
                row = json.loads(line[4:])
                if "img_s" in row:
                    print(f"  {row['model']:>7} {row['config']:<16} round {row['round'] + 1}: "
                          f"{row['img_s']:.0f} img/s", file=sys.stderr, flush=True)
        proc.wait()
    finally:
        timer.cancel()
    out = "".join(lines)
    if proc.returncode != 0:
        sys.stderr.write(out[-6000:])
        why = f"killed after --timeout {timeout:g} s" if proc.returncode == -9 else \
            f"exit code {proc.returncode}"
        raise SystemExit(f"benchmark job failed ({why})")
    return out


def table(rows: list[dict], configs: list[str], baselines: list[str], cpu: bool) -> str:
    """Markdown table: best / median img/s per model and config, ratios to each baseline."""
    lines = []
    gloo = [c for c in configs if c in ("ddp", "fsdp") or c.startswith(("ddp:", "fsdp:"))]
    pairs = [(c, b) for b in baselines for c in configs if c not in gloo]
    head = ["model"] + [f"{c} img/s" for c in configs] + [f"{c} / {b}" for c, b in pairs]
    if cpu:
        head += [f"{c} engine CPU" for c in configs if c.startswith(ENGINE_CONFIGS)]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" * len(head))
    for model in dict.fromkeys(r["model"] for r in rows):
        by_cfg = {c: [r for r in rows if r["model"] == model and r["config"] == c]
                  for c in configs}
        cells = [model]
        for c in configs:
            vals = [r["img_s"] for r in by_cfg[c]]
            cells.append(f"{max(vals):.0f} ({statistics.median(vals):.0f})" if vals else "-")
        for c, base in pairs:
            ratios = [x["img_s"] / y["img_s"] for x, y in zip(by_cfg[c], by_cfg[base])]
            cells.append(f"{statistics.median(ratios):.2f}x" if ratios else "-")
        if cpu:
            for c in configs:
                if c.startswith(ENGINE_CONFIGS):
                    vals = [r["engine_cpu"] for r in by_cfg[c]]
                    cells.append(f"{100 * statistics.median(vals):.0f} %" if vals else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def bounds_table(rows: list[dict], configs: list[str]) -> str:
    """Per model and lightcc column: F, B, W and the two bounds (ms), and the measured step
    as a fraction of each (bound / median step)."""
    lines = ["| model | column | F ms | B ms | W ms | step ms | barrier bound F+max(B,W) ms "
             "| step vs barrier bound | cross-barrier bound max(F+B,W) ms "
             "| step vs cross-barrier bound |", "|" + "---|" * 10]
    phases = {r["model"]: r["phases"] for r in rows if "phases" in r}
    for model, ph in phases.items():
        # bytes that cross a link per step: the world's ring on one host, the hosts' exchange
        # (any hierarchical scheme, DDP's ring alike) across several
        n = ph.get("hosts", 1) if ph.get("hosts", 1) > 1 else ph["world"]
        for c in configs:
            framework, _, option = c.partition(":")
            if framework not in ("lightcc", "cross_barrier"):
                continue
            vals = [r["img_s"] for r in rows if r.get("model") == model and r.get("config") == c]
            factor = WIRE_FACTOR.get(option or "none")
            if not vals or factor is None or not ph["link_Bps"]:
                continue
            step = _median_step(ph, vals)
            f, b = ph["F"], ph["B"]
            w = 2 * (n - 1) / n * ph["grad_bytes"] * factor / ph["link_Bps"]
            barrier, xbar = f + max(b, w), max(f + b, w)
            lines.append(f"| {model} | {c} | {1e3 * f:.0f} | {1e3 * b:.0f} | {1e3 * w:.0f} | "
                         f"{1e3 * step:.0f} | {1e3 * barrier:.0f} | {barrier / step:.0%} | "
                         f"{1e3 * xbar:.0f} | {xbar / step:.0%} |")
    return "\n".join(lines)


def _median_step(ph: dict, img_s: list[float]) -> float:
    """The median step (s) of a column from its img/s over rounds."""
    return ph["batch"] * ph["world"] / statistics.median(img_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,resmlp,cnn")
    parser.add_argument("--configs", default=None,
                        help=f"default: {DEFAULT_CONFIGS} (with --netns: {NETNS_CONFIGS})")
    parser.add_argument("--baseline", default=None, help="columns to take ratios to, comma "
                        "separated (default: ddp, and ddp:fp16 when it runs)")
    parser.add_argument("-np", "--np", dest="np_", type=int, default=2, help="ranks")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per rank")
    parser.add_argument("--iters", type=int, default=30, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--netns", action="store_true",
                        help="--np simulated hosts behind --rate links (--ranks-per-host)")
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--ranks-per-host", type=int, default=1,
                        help="with --netns: ranks on each simulated host (shared memory)")
    parser.add_argument("--cpu", action="store_true", help="add the engine's CPU share")
    parser.add_argument("--engine-cost", action="store_true",
                        help="also print the per-tensor engine cost (single rank)")
    parser.add_argument("--port", type=int, default=29533)
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--json", default=None, help="write every row here")
    parser.add_argument("--verbose", action="store_true", help="show the ranks' output")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--engine-cost-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.configs is None:
        args.configs = NETNS_CONFIGS if args.netns else DEFAULT_CONFIGS
    if args.worker:
        worker_main(args)
        return
    configs = args.configs.split(",")
    baselines = [b for b in (args.baseline or "ddp,ddp:fp16").split(",") if b in configs] \
        or [configs[-1]]
    passthrough = [f"--models={args.models}", f"--configs={args.configs}",
                   f"--batch-size={args.batch_size}", f"--iters={args.iters}",
                   f"--warmup={args.warmup}", f"--rounds={args.rounds}",
                   f"--threads={args.threads}", f"--port={args.port}"]
    if args.ranks_per_host < 1 or (args.ranks_per_host > 1 and not args.netns):
        parser.error("--ranks-per-host must be >= 1 and needs --netns")
    where = (f"{args.np_} simulated hosts x {args.ranks_per_host} rank(s), {args.rate} links"
             if args.netns
             else f"{args.np_} ranks on one machine")
    print(f"# training throughput, {where}; batch {args.batch_size}/rank, {args.threads} torch "
          f"thread(s)/rank, {args.iters} timed steps x {args.rounds} rounds; img/s best "
          f"(median); ratios: median of per-round ratios", flush=True)
    rows = launch(args, passthrough, args.np_)
    print(table([r for r in rows if "img_s" in r], configs, baselines, args.cpu))
    print()
    print(bounds_table(rows, configs))
    result: dict = {"rows": rows}
    if args.engine_cost:
        args.netns = False
        cost = launch(args, [f"--iters={args.iters * 10}", f"--warmup={args.warmup}",
                             "--engine-cost-only"], 1)
        got = cost[0]["engine_cost"]
        print(f"\nper-tensor engine cost (1 rank, resmlp's 164 gradients through "
              f"DistributedOptimizer's hook and synchronize()): {got['us_per_tensor']:.1f} us "
              f"per tensor per step ({got['cpu_us_per_tensor']:.1f} us of CPU, all threads)")
        result["engine_cost"] = got
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    if "--worker" in sys.argv:
        main()
        sys.stdout.flush()
        from mpi4py import MPI

        MPI.COMM_WORLD.Barrier()
        MPI.Finalize()
        os._exit(0)     # skip DDP/gloo teardown, which can deadlock at interpreter exit
    main()
