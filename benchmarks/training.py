"""End-to-end training throughput: lightcc against what users would run instead, in one run.

One command prints one table (images/s over all ranks, and ratios to a baseline column)::

    python benchmarks/training.py                         # 2 ranks on this machine
    python benchmarks/training.py --models resmlp --configs lightcc,ddp --rounds 5
    sudo python benchmarks/training.py --netns            # 2 simulated hosts, 1 Gbit link
    sudo python benchmarks/training.py --netns --ranks-per-host 2   # 2 hosts x 2 ranks
    python benchmarks/training.py --models resnet50,bert,gpt2 --batch-size 2 \
        --configs lightcc,ddp --ddp-buckets 1,2,4,8              # real size, best DDP bucket
    python benchmarks/training.py --compute device --models gpt2 --batch-size 8  # device time

Columns (``--configs``, comma separated):

- ``lightcc`` / ``lightcc:fp16`` / ``:bf16`` / ``:fp8`` / ``:topk`` / ``:auto`` /
  ``:auto-lossy``: ``lightcc.torch``'s ``DistributedOptimizer`` with that compressor
  (``auto-lossy``: ``Compression.auto(accuracy="lossy")``);
- ``lightcc-tcp`` / ``lightcc-tcp:fp16`` / ...: the same on lightcc's MPI-free plane (the
  transport lightcc runs under torchrun or srun: store rendezvous and lightcc's TCP links,
  ``LCC_TRANSPORT=tcp`` with torchrun's variables set from MPI's ranks); MPI stays in the
  process only for this benchmark's own barriers. Its own job per (round, column);
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
default); see benchmarks/models.py; they train on synthetic MNIST-shaped data. Real size
(benchmarks/realmodels.py, parameter counts and tensor shapes of the published models):
``resnet50`` (25.6 M parameters, 102 MB of gradients; ``--image-size`` pixels, default 64),
``bert`` (BERT-base, 109.5 M; ``--seq-len`` tokens, default 64) and ``gpt2`` (GPT-2 small,
124.4 M, tied head). Every column trains SGD with momentum, ``--batch-size`` samples per rank,
one torch thread per rank (``--threads``). Columns run one after the other and alternate for
``--rounds`` rounds; a round's figure is the median step of the slowest rank; the table shows
min / median / max over rounds (so a bimodal column shows as one) and the median and range of
the per-round ratios. With real-size models (or ``--isolate yes``) every (round, column) runs
in an mpirun job of its own: nothing of an earlier column stays in memory, and the peak RSS per
rank printed for each column is that column's alone (in one shared job it is the peak since the
column started, earlier columns' live memory included). With ``--cpu`` the table adds the
lightcc engine thread's share of one core during the timed steps (rank 0).

A lightcc or cross_barrier column may end in ``+watch`` or ``+bare`` (issue 38's cost target:
what watching a job costs): ``+watch`` turns on everything a user watches with, as
``lccrun --status 1`` and a TensorBoard logger would: the rank's status reporter (every 1 s, to
a listener in the same process standing in for lccrun), ``lightcc.torch.metrics_writer`` called
every step (a writer that drops the scalars, so TensorBoard's own cost is not counted) and the
torch.profiler range sites installed (no profiler recording); ``+bare`` turns off what is on by
default: the engine's metrics listener and the range sites. The plain column is the library's
default (listener and range sites, nothing else). ``--configs lightcc+bare,lightcc+watch
--baseline lightcc+bare`` gives the cost as a ratio, alternated in one run.

A DDP column may end in ``@MB``: its ``bucket_cap_mb`` (``ddp@4``, ``ddp:fp16@1``);
``--ddp-buckets 1,2,4,8`` adds those for ``ddp`` (and ``ddp:fp16`` when it runs), and the table
adds each lightcc column's ratio to the best of them and DDP's default 25 MB ("best ddp"),
measured in the same run.

Compute (``--compute``): ``cpu`` (default) runs the model on the CPU, where compute competes
with communication for the cores; ``device`` keeps the real parameters, autograd graph, hooks,
optimizer, compressors and gradient sizes but replaces each layer's compute by its device time
(benchmarks/devicetime.py): ``--cpu-share`` of it (default 0.1) busy on the CPU, the rest
asleep with the CPU released; times from benchmarks/profiles/<model>.json for the real-size
models (scaled linearly to ``--batch-size``), or ``--device-f-ms``/``--device-b-ms`` (default 40
and 80 ms) spread over a synthetic model's layers by parameter count. docs/benchmarks.md
explains both modes and their bias.

Per model the worker first measures, with no communication, the forward time F, the backward
time B and the whole step (medians; O = the step - F - B: optimizer, zeroing, host work), the
asked F and B in device mode, and the link rate (a pairwise MPI exchange of 8 MB, both
directions at once, with a partner on another host when there are several; every rank of a
host exchanges at once, so the host's link rate is the sum); a second table gives, per column,
the wire time W (bytes that cross a link per step, 2 (n-1)/n x the gradient bytes after
compression, n = the hosts, or the ranks on one machine, / that rate), the barrier bound
F + max(B, W) + O (the wire can start during backward, forward cannot start before the last
gradient arrived), the cross-barrier bound max(F + B + O, W), and each bound / the measured
median step. A third table gives the peak RSS per rank.

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

import benchtable  # noqa: E402

DEFAULT_CONFIGS = "lightcc,cross_barrier,ddp,ddp-lcc"
NETNS_CONFIGS = ("lightcc,lightcc:fp16,lightcc:bf16,lightcc:fp8,lightcc:topk,cross_barrier,"
                 "cross_barrier:fp16,cross_barrier:fp8,ddp,ddp:fp16,"
                 "ddp-lcc,ddp-lcc:fp16,ddp-lcc:topk")
REAL_MODELS = ("resnet50", "bert", "gpt2")       # benchmarks/realmodels.py


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
        self._data: dict = {}
        self.clock = None
        if args.compute == "device":
            import devicetime

            self.clock = devicetime.DeviceClock(cpu_share=args.cpu_share)
        self._lcc = None
        self._ddp_ready = False
        self._lcc_group = None
        self._keep: list = []   # DDP objects: freeing a Reducer can deadlock with gloo threads
        self._status_stop = None   # ends the +watch column's status reporter
        self._sink: str | None = None

    # -- frameworks -------------------------------------------------------------------------
    def lightcc(self):
        if self._lcc is None:
            import lightcc.torch as lcc

            if os.environ.get("LCC_TRANSPORT") == "tcp":
                # a ``lightcc-tcp`` column: lightcc starts its MPI-free plane from torchrun's
                # variables, as under torchrun (MPI stays for this benchmark's own barriers)
                os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world),
                                  LOCAL_RANK=str(self.comm.Split_type(
                                      _shared_type()).Get_rank()),
                                  MASTER_ADDR=os.environ.get("LCC_BENCH_MASTER", "127.0.0.1"),
                                  MASTER_PORT=str(self.args.port + 1))
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

    def observe(self, mode: str):
        """Set what a lightcc column observes (``+watch``, ``+bare``, "": the default again;
        module docstring); returns the per-step metrics logger of ``+watch``, else None."""
        import threading

        from lightcc.common.api import state
        from lightcc.common.observability import metrics, ranges, reporter
        from lightcc.torch import profiler_ranges

        lcc = self.lightcc()
        eng = state._get()
        m = metrics.attach(eng)
        if self._status_stop is not None:
            self._status_stop.set()      # the reporter's next collect() ends its thread
            self._status_stop = None
        if mode == "bare":
            if m.on_event in eng.listeners:
                eng.listeners.remove(m.on_event)
            ranges.install(None, None, lambda: False)
            return None
        if m.on_event not in eng.listeners:
            eng.listeners.append(m.on_event)
        profiler_ranges.install()
        if mode != "watch":
            return None
        stop = self._status_stop = threading.Event()

        def collect() -> dict:
            if stop.is_set():
                raise RuntimeError("the column ended")
            return metrics.collect(eng, state.stats())

        reporter.start(self.rank, collect, {reporter.STATUS_ENV: "1", reporter.TOKEN_ENV: "b",
                                            reporter.ADDR_ENV: self._status_sink()})
        return lcc.metrics_writer(_DroppingWriter())

    def _status_sink(self) -> str:
        """``addr:port`` of a listener that reads and drops status reports (lccrun's part)."""
        import socket
        import threading

        if self._sink is None:
            srv = socket.create_server(("127.0.0.1", 0))

            def serve() -> None:
                while True:
                    conn, _ = srv.accept()
                    with conn:
                        while conn.recv(65536):
                            pass

            threading.Thread(target=serve, name="status-sink", daemon=True).start()
            self._sink = f"127.0.0.1:{srv.getsockname()[1]}"
        return self._sink

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

        from benchtable import split

        framework, option, bucket = split(config)
        model = self.build(model_name)
        if framework in ("lightcc", "cross_barrier", "lightcc-tcp"):
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
            model = torch.nn.parallel.DistributedDataParallel(model, **_bucket_kw(bucket))
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
            model = torch.nn.parallel.DistributedDataParallel(model, process_group=group,
                                                              **_bucket_kw(bucket))
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

    # -- models and data ----------------------------------------------------------------------
    def build(self, model_name: str):
        """The model of one column: real-size or synthetic, and in device-time mode its
        device-time twin (the same parameters; benchmarks/devicetime.py)."""
        import torch

        import models
        import realmodels

        torch.manual_seed(0)
        real = model_name in REAL_MODELS
        model = realmodels.REAL_MODELS[model_name]() if real else models.build(model_name)
        if self.args.compute != "device":
            return model
        import devicetime

        return devicetime.convert(model, self.layers(model_name, model), self.clock)

    def layers(self, model_name: str, model) -> list:
        import devicetime

        profile = devicetime.load_profile(model_name) if model_name in REAL_MODELS else None
        return devicetime.plan(model, profile, self.args.batch_size, self.args.device_f_ms,
                               self.args.device_b_ms)

    def batches(self, model_name: str) -> list:
        """Eight (input, target) batches of ``--batch-size`` for this rank (made once)."""
        import torch

        if model_name not in self._data:
            g = torch.Generator().manual_seed(1000 + self.rank)
            n = self.args.batch_size
            if self.args.compute == "device":       # the input only gives the batch size
                self._data[model_name] = [(torch.zeros(n, 1), None)]
            elif model_name in REAL_MODELS:
                import realmodels

                self._data[model_name] = [realmodels.sample(
                    model_name, n, g, self.args.image_size, self.args.seq_len)
                    for _ in range(4)]
            else:
                self._data[model_name] = [(torch.rand(n, 1, 28, 28, generator=g),
                                           torch.randint(0, 10, (n,), generator=g))
                                          for _ in range(8)]
        return self._data[model_name]

    def loss(self, out, target):
        import realmodels

        if self.args.compute == "device":
            return out.sum()
        return realmodels.loss(out, target)

    # -- measurement --------------------------------------------------------------------------
    def run(self, model_name: str, config: str) -> dict:
        import gc

        gc.collect()
        _reset_peak_rss()
        config, _, mode = config.partition("+")
        if mode not in ("", "watch", "bare") or (mode and not config.startswith(
                ("lightcc", "cross_barrier"))):
            raise SystemExit(f"{config}+{mode}: only lightcc and cross_barrier columns take "
                             f"+watch or +bare")
        model, opt = self.make(model_name, config)
        log = self.observe(mode) if mode else None
        data = self.batches(model_name)
        args = self.args
        tid = _engine_thread_id() if config.startswith(benchtable.ENGINE_CONFIGS) else None
        times: list[float] = []
        cpu0 = wall0 = 0.0
        for i in range(args.warmup + args.iters):
            if i == args.warmup:
                self.barrier()
                cpu0, wall0 = _thread_cpu_seconds(tid), time.perf_counter()
            x, y = data[i % len(data)]
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            self.loss(model(x), y).backward()
            opt.step()
            if log is not None:
                log(i)
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
        share = (_thread_cpu_seconds(tid) - cpu0) / max(time.perf_counter() - wall0, 1e-9)
        if mode:
            self.observe("")            # the library's default again for the next column
        if hasattr(opt, "synchronize"):
            opt.synchronize()       # cross_barrier: apply the last step's pending updates
        self.barrier()
        slowest = self.comm.allreduce(statistics.median(times), op=_max())
        rss = self.comm.allgather(_peak_rss_mb())
        return {"img_s": args.batch_size * self.world / slowest, "engine_cpu": share,
                "rss_mb": rss}


    def phases(self, model_name: str) -> dict:
        """Forward and backward seconds (medians, no communication; the slowest rank's), the
        model's gradient bytes and the link rate (bytes/s one way, each rank exchanging 8 MB
        with a partner in both directions at once, median of 5)."""
        import numpy as np

        model = self.build(model_name)
        opt = _sgd(model)
        data = self.batches(model_name)
        fwd, bwd, steps = [], [], []
        for i in range(self.args.warmup + self.args.iters):
            x, y = data[i % len(data)]
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            t1 = time.perf_counter()
            loss = self.loss(model(x), y)
            t2 = time.perf_counter()
            loss.backward()
            t3 = time.perf_counter()
            opt.step()
            t4 = time.perf_counter()
            if i >= self.args.warmup:
                fwd.append(t2 - t1)
                bwd.append(t3 - t2)
                steps.append(t4 - t0)
        asked_f = asked_b = None
        if self.clock is not None:
            layers = [m for m in model.modules() if hasattr(m, "fwd_s")]
            asked_f = sum(m.fwd_s for m in layers)
            asked_b = sum(m.bwd_s for m in layers)
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        params = sum(p.numel() for p in model.parameters())
        del model, opt
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
                "step": self.comm.allreduce(statistics.median(steps), op=_max()),
                "asked_F": asked_f, "asked_B": asked_b, "params": params,
                "compute": self.args.compute, "grad_bytes": nbytes, "link_Bps": local * self.comm.allreduce(rate, op=_min()),
                "world": self.world, "hosts": hosts, "batch": self.args.batch_size}


def _bucket_kw(bucket: float | None) -> dict:
    """DDP keyword for a column's ``@bucket`` (MB); DDP's default (25 MB) without one."""
    return {} if bucket is None else {"bucket_cap_mb": bucket}


def _reset_peak_rss() -> None:
    """Reset this process's peak RSS (VmHWM) to its current RSS (Linux: clear_refs 5), so each
    column's peak is its own; earlier columns' memory still alive counts in it."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        pass


def _peak_rss_mb() -> float:
    """This process's peak resident set (VmHWM) in MB since the last reset."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class _DroppingWriter:
    """A SummaryWriter stand-in that drops the scalars (the +watch column's logger)."""

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        pass


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


def _shared_type():
    from mpi4py import MPI

    return MPI.COMM_TYPE_SHARED


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
            opt.on_gradient(p)       # what autograd's hook calls (registered only on > 1 rank)
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
        if args.job != "runs":
            ph = w.phases(model_name)
            if w.rank == 0:
                print("ROW " + json.dumps({"model": model_name, "phases": ph}), flush=True)
        if args.job == "phases":
            continue
        for rnd in range(args.rounds):
            for config in args.configs.split(","):
                res = w.run(model_name, config)
                if w.rank == 0:
                    print("ROW " + json.dumps({"model": model_name, "config": config,
                                               "round": rnd + args.first_round, **res}),
                          flush=True)
    if w._lcc is not None:
        w._lcc.shutdown()


# ---- driver -----------------------------------------------------------------------------------
def _mpirun_local(np_: int) -> list[str]:
    from tests.mpi_harness import mpirun_base

    return mpirun_base(np_)


def launch(args: argparse.Namespace, extra: list[str], np_: int,
           env_extra: dict | None = None) -> list[dict]:
    """Run this file as a worker on ``np_`` ranks (or across simulated hosts); parse rows."""
    port = args.port or _free_port()
    cmd_tail = [sys.executable, str(Path(__file__).resolve()), "--worker", *extra,
                f"--port={port}"]
    env = dict(os.environ)
    env.update(env_extra or {})
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    # How an MPI wait idles is lightcc's own choice (LCC_MPI_IDLE_SLEEP_US, auto: Open MPI's
    # spinning wait for ranks on one machine), as under lccrun. This used to force
    # mpi_yield_when_idle=1 on every job, which users' jobs do not get: with any other
    # runnable thread on the machine each idle turn of MPI's progress loop handed the core
    # away, and ResNet-50's 97 MB allreduce + SGD step took 340-480 ms instead of 90-150 ms
    # (2 ranks, one machine, background work at nice 19; measured 2026-11-29).
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
                          f"{benchtable.num(row['img_s'])} img/s", file=sys.stderr,
                          flush=True)
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


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", default="mlp,resmlp,cnn",
                        help="synthetic: mlp, resmlp, cnn, transformer (models.py); real size: "
                        "resnet50, bert, gpt2 (realmodels.py)")
    parser.add_argument("--configs", default=None,
                        help=f"default: {DEFAULT_CONFIGS} (with --netns: {NETNS_CONFIGS}); a "
                        "DDP column may end in @MB: its bucket_cap_mb (ddp@4, ddp:fp16@1)")
    parser.add_argument("--ddp-buckets", default="",
                        help="comma-separated MB: add ddp@MB (and ddp:fp16@MB when ddp:fp16 "
                        "runs) for each; the table adds ratios to the best of them and of "
                        "DDP's default 25 MB (e.g. 1,2,4,8)")
    parser.add_argument("--baseline", default=None, help="columns to take ratios to, comma "
                        "separated (default: ddp, and ddp:fp16 when it runs)")
    parser.add_argument("-np", "--np", dest="np_", type=int, default=2, help="ranks")
    parser.add_argument("--batch-size", type=int, default=32, help="samples per rank")
    parser.add_argument("--iters", type=int, default=30, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--compute", choices=("cpu", "device"), default="cpu",
                        help="cpu: the model computes on the CPU; device: each layer takes its "
                        "device time (profiles/*.json, or --device-f-ms/--device-b-ms)")
    parser.add_argument("--cpu-share", type=float, default=0.1,
                        help="--compute device: share of each layer's device time spent busy "
                        "on the CPU (kernel launches)")
    parser.add_argument("--device-f-ms", type=float, default=40.0,
                        help="--compute device, synthetic models: forward device time per step")
    parser.add_argument("--device-b-ms", type=float, default=80.0,
                        help="--compute device, synthetic models: backward device time per step")
    parser.add_argument("--image-size", type=int, default=64,
                        help="resnet50 input pixels (CPU mode)")
    parser.add_argument("--seq-len", type=int, default=64, help="bert/gpt2 tokens (CPU mode)")
    parser.add_argument("--isolate", choices=("auto", "yes", "no"), default="auto",
                        help="run every (round, column) in a job of its own, so peak RSS is the "
                        "column's alone and no earlier column's memory stays; auto: yes for "
                        "real-size models")
    parser.add_argument("--netns", action="store_true",
                        help="--np simulated hosts behind --rate links (--ranks-per-host)")
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--ranks-per-host", type=int, default=1,
                        help="with --netns: ranks on each simulated host (shared memory)")
    parser.add_argument("--cpu", action="store_true", help="add the engine's CPU share")
    parser.add_argument("--engine-cost", action="store_true",
                        help="also print the per-tensor engine cost (single rank)")
    parser.add_argument("--port", type=int, default=0, help="torch.distributed's rendezvous "
                        "port; 0 (default): a free one for every job")
    parser.add_argument("--timeout", type=float, default=3600, help="per job, s")
    parser.add_argument("--json", default=None, help="write every row here")
    parser.add_argument("--plot", default=None, metavar="FILE.png",
                        help="also draw images/s per model and configuration (median over "
                             "rounds; benchmarks/plots.py, matplotlib)")
    parser.add_argument("--verbose", action="store_true", help="show the ranks' output")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--engine-cost-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--job", choices=("all", "phases", "runs"), default="all",
                        help=argparse.SUPPRESS)
    parser.add_argument("--first-round", type=int, default=0, help=argparse.SUPPRESS)


def expand_configs(configs: str, ddp_buckets: str) -> list[str]:
    """The columns, with ``ddp@MB`` (and ``ddp:fp16@MB``) added after each swept family."""
    out = configs.split(",")
    for mb in filter(None, ddp_buckets.split(",")):
        for fam in ("ddp", "ddp:fp16"):
            if fam in out and f"{fam}@{mb}" not in out:
                out.append(f"{fam}@{mb}")
    return out


def _free_port() -> int:
    """A TCP port free on this machine now (a fixed one collides with other jobs)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def collect(args: argparse.Namespace, configs: list[str]) -> list[dict]:
    """Every row: one job for everything, or (``--isolate``) a phases job per model and a job
    per model, round and column (columns alternate inside each round)."""
    common = [f"--batch-size={args.batch_size}", f"--iters={args.iters}",
              f"--warmup={args.warmup}", f"--threads={args.threads}",
              f"--compute={args.compute}", f"--cpu-share={args.cpu_share}",
              f"--device-f-ms={args.device_f_ms}", f"--device-b-ms={args.device_b_ms}",
              f"--image-size={args.image_size}", f"--seq-len={args.seq_len}"]
    models = args.models.split(",")
    tcp = [c for c in configs if benchtable.split(c)[0] == "lightcc-tcp"]
    if tcp and args.isolate == "no":
        raise SystemExit(f"{tcp[0]} runs in a job of its own (its transport is chosen at "
                         f"init): drop --isolate no")
    isolate = args.isolate == "yes" or bool(tcp) or (args.isolate == "auto" and
                                                     any(m in REAL_MODELS for m in models))
    if not isolate:
        return launch(args, common + [f"--models={args.models}", f"--configs={','.join(configs)}",
                                      f"--rounds={args.rounds}"], args.np_)
    rows: list[dict] = []
    for model in models:
        rows += launch(args, common + [f"--models={model}", "--configs=local", "--rounds=1",
                                       "--job=phases"], args.np_)
        for rnd in range(args.rounds):
            for config in configs:
                env = {"LCC_TRANSPORT": "tcp"} if config in tcp else None
                rows += launch(args, common + [f"--models={model}", f"--configs={config}",
                                               "--rounds=1", "--job=runs",
                                               f"--first-round={rnd}"], args.np_, env)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _add_arguments(parser)
    args = parser.parse_args()
    if args.configs is None:
        args.configs = NETNS_CONFIGS if args.netns else DEFAULT_CONFIGS
    if args.worker:
        worker_main(args)
        return
    if not 0.0 <= args.cpu_share <= 1.0:
        parser.error("--cpu-share must be within [0, 1]")
    configs = expand_configs(args.configs, args.ddp_buckets)
    baselines = [b for b in (args.baseline or "ddp,ddp:fp16").split(",") if b in configs] \
        or [configs[-1]]
    if args.ranks_per_host < 1 or (args.ranks_per_host > 1 and not args.netns):
        parser.error("--ranks-per-host must be >= 1 and needs --netns")
    where = (f"{args.np_} simulated hosts x {args.ranks_per_host} rank(s), {args.rate} links"
             if args.netns
             else f"{args.np_} ranks on one machine")
    mode = (f"device-time compute (--cpu-share {args.cpu_share:g})"
            if args.compute == "device" else "CPU compute")
    print(f"# training throughput, {where}, {mode}; batch {args.batch_size}/rank, "
          f"{args.threads} torch thread(s)/rank, {args.iters} timed steps x {args.rounds} "
          f"rounds; img/s min / median / max over rounds (a round: the slowest rank's median "
          f"step); ratios: median of per-round ratios (range)", flush=True)
    t0 = time.time()
    rows = collect(args, configs)
    print(benchtable.phases_lines(rows))
    print()
    print(benchtable.throughput_table([r for r in rows if "img_s" in r], configs, baselines,
                                      args.cpu))
    print()
    print(benchtable.bounds_table(rows, configs))
    print()
    base = next((c for c in ("ddp", "ddp-lcc") if c in configs), configs[0])
    print(benchtable.rss_table(rows, configs, base))
    print(f"\n# {time.time() - t0:.0f} s; load average at the end: "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    result: dict = {"rows": rows, "args": vars(args)}
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
    if args.plot:
        from plots import plot_training

        plot_training(rows, args.plot, benchtable.plot_bounds(rows))
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    if "--worker" in sys.argv:
        main()
        sys.stdout.flush()
        from mpi4py import MPI

        MPI.COMM_WORLD.Barrier()
        MPI.Finalize()
        os._exit(0)     # skip DDP/gloo teardown, which can deadlock at interpreter exit
    main()
