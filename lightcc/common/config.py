"""Every ``LCC_*`` environment variable, parsed and validated in one place.

A :class:`Knob` describes one setting: its environment variable, type, default, unit and help
text. :func:`load` reads the environment once, applies keyword overrides given to ``init()``
and returns a frozen :class:`Config`. The launcher (``lccrun``) and the README table are built
from the same :data:`KNOBS` list, so names and units cannot drift apart.

Units: sizes are bytes in environment variables (``LCC_FUSION_THRESHOLD=67108864``) and MB on
the ``lccrun`` command line; times are milliseconds for the cycle time and seconds for stall
checks, as the names say.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from .exceptions import ConfigError

LOG_LEVELS = ("trace", "debug", "info", "warning", "error", "fatal")
BACKENDS = ("auto", "mpi", "nccl")
AUTOTUNE_MODES = ("0", "1", "refresh")


def _parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected 0/1/true/false, got {text!r}")


def _parse_idle_sleep(text: str) -> int | str:
    text = text.strip().lower()
    return text if text == "auto" else _parse_int(text)


def _parse_int(text: str) -> int:
    return int(text.strip(), 0)


def _parse_float(text: str) -> float:
    value = float(text.strip())
    if value != value:  # NaN
        raise ValueError("NaN is not a valid value")
    return value


def _parse_str(text: str) -> str:
    return text.strip()


@dataclass(frozen=True)
class Knob:
    """One configuration setting: where it comes from, what it means, how to check it."""

    field: str
    env: str
    parse: Callable[[str], Any]
    default: Any
    unit: str
    help: str
    check: Callable[[Any], str | None] = lambda v: None


def _min(limit: float) -> Callable[[Any], str | None]:
    return lambda v: None if v >= limit else f"must be >= {limit}"


def _choice(options: tuple[str, ...]) -> Callable[[Any], str | None]:
    return lambda v: None if v in options else f"must be one of {', '.join(options)}"


def _compression_ok(name: str) -> str | None:
    from .compression import available_compressors

    try:
        available_compressors().index(name.split(":")[0])
    except ValueError:
        return f"unknown compressor (known: {', '.join(available_compressors())})"
    if name.split(":")[0] == "auto":
        from .compression import make

        try:
            make(name)
        except ValueError as exc:
            return str(exc)
    return None


def _algorithm_ok(name: str) -> str | None:
    from .algorithms import available_algorithms

    if name not in available_algorithms():
        return f"unknown algorithm (known: {', '.join(available_algorithms())})"
    return None


KNOBS: tuple[Knob, ...] = (
    Knob("fusion_threshold", "LCC_FUSION_THRESHOLD", _parse_int, 64 * 1024 * 1024, "bytes",
         "Largest fusion bucket; small tensors are packed together up to this size. "
         "0 disables fusion.", _min(0)),
    Knob("cycle_time", "LCC_CYCLE_TIME", _parse_float, 1.0, "ms",
         "How long the coordinator holds a ready, not-yet-full bucket while other tensors "
         "are still arriving, so they can be fused. A lone request is never delayed.", _min(0.0)),
    Knob("cache_capacity", "LCC_CACHE_CAPACITY", _parse_int, 1024, "entries",
         "Response cache size; cached requests are negotiated by a small id instead of their "
         "full description. 0 disables the cache.", _min(0)),
    Knob("stall_check_time", "LCC_STALL_CHECK_TIME", _parse_float, 60.0, "s",
         "Warn (on rank 0) when a tensor submitted by some ranks waits this long for the "
         "others; names the tensor and the missing ranks. 0 disables the check.", _min(0.0)),
    Knob("stall_shutdown_time", "LCC_STALL_SHUTDOWN_TIME", _parse_float, 600.0, "s",
         "Fail a collective that some ranks never submitted with StallError, on every rank "
         "that did, after this long; the error names the collective, who submitted it and what "
         "the missing ranks wait in instead. 600 s bounds how long a job whose ranks diverged "
         "(one left a loop early) sits idle, while leaving room for rank-0-only work such as "
         "evaluation or checkpointing (torch.distributed's gloo gives up after 30 min). "
         "0 = never.", _min(0.0)),
    Knob("log_level", "LCC_LOG_LEVEL", lambda t: t.strip().lower(), "warning", "",
         "Logging level of the 'lightcc' logger.", _choice(LOG_LEVELS)),
    Knob("local_size", "LCC_LOCAL_SIZE", _parse_int, 0, "ranks",
         "Ranks per node. 0 = detect from host names; N > 0 splits consecutive ranks into "
         "simulated nodes of N (for tests and benchmarks on one machine).", _min(0)),
    Knob("compression", "LCC_COMPRESSION", _parse_str, "none", "",
         "Default compressor for DistributedOptimizer when none is given "
         "(none, auto, fp16, bf16, fp8, fp8_e5m2, topk, powersgd). auto measures the link "
         "and the codecs during the first steps and picks per tensor (docs/compression.md).",
         _compression_ok),
    Knob("compression_accuracy", "LCC_COMPRESSION_ACCURACY", lambda t: t.strip().lower(),
         "lossless", "",
         "What compression=auto may choose from: lossless (none, fp16, bf16) or lossy (also "
         "fp8). Used where auto is given without an accuracy; ranks must agree.",
         _choice(("lossless", "lossy"))),
    Knob("ef_ttl_steps", "LCC_EF_TTL_STEPS", _parse_int, 10_000, "steps",
         "Error-feedback residuals (TopK, PowerSGD) of a tensor unseen for this many engine "
         "steps are dropped. 0 = keep until cleared.", _min(0)),
    Knob("codec_threads", "LCC_CODEC_THREADS", _parse_int, 1, "threads",
         "Threads of each rank's compression kernels (numba). 1 = the serial kernels, no "
         "thread pool (one thread encodes fp16 at ~12 GB/s, far above any network); 0 = the "
         "usable cores divided by the ranks on this host. numba's OpenMP workers spin between "
         "launches and take CPU from training and the network stack.", _min(0)),
    Knob("min_compress_bytes", "LCC_MIN_COMPRESS_BYTES", _parse_int, 4096, "bytes",
         "Tensors smaller than this are sent uncompressed (decided per tensor, so fusion "
         "never changes how a tensor is treated).", _min(0)),
    Knob("direct_bytes", "LCC_DIRECT_BYTES", _parse_int, 64 * 1024, "bytes",
         "Blocking allreduces without a name (lcc.allreduce(loss), as scripts average metrics) "
         "of host arrays up to this size skip the engine: the calling thread checks that every "
         "rank made the same call and reduces with MPI's own allreduce (~20 us instead of "
         "~400 us through the engine here). Larger or GPU ones are checked the same way, then "
         "go through the engine. They rely on the call order, as Horovod's generated names do. "
         "Needs MPI_THREAD_MULTIPLE; 0 sends them all through the engine alone.", _min(0)),
    Knob("algorithm", "LCC_ALGORITHM", lambda t: t.strip().lower(), "auto", "",
         "Allreduce algorithm: auto, flat, native, ring, hierarchical, 2d, tree.",
         _algorithm_ok),
    Knob("auto_small_bytes", "LCC_AUTO_SMALL_BYTES", _parse_int, 64 * 1024, "bytes",
         "algorithm=auto uses the small-message algorithm (the native call) below this size.",
         _min(0)),
    Knob("auto_multinode_bytes", "LCC_AUTO_HIERARCHICAL_BYTES", _parse_int, 256 * 1024, "bytes",
         "algorithm=auto uses the multi-node algorithm from this size on jobs with several "
         "nodes of several ranks.", _min(0)),
    Knob("auto_multi_node", "LCC_AUTO_MULTI_NODE", lambda t: t.strip().lower(),
         "native", "",
         "algorithm=auto's choice for host buffers on several equal nodes of several ranks "
         "(native = one call of Open MPI's own allreduce, its han component; hierarchical, "
         "2d, flat); one rank per node uses ring.",
         lambda v: "must be a concrete algorithm, not auto" if v == "auto" else _algorithm_ok(v)),
    Knob("ring_chunk_bytes", "LCC_RING_CHUNK_BYTES", _parse_int, 1 << 20, "bytes",
         "Pipeline chunk of the ring and 2d algorithms.", _min(1)),
    Knob("mpi_chunk_bytes", "LCC_MPI_CHUNK_BYTES", _parse_int, 4 << 20, "bytes",
         "The MPI backend's allreduce is issued in pieces of this size (Open MPI's large-message "
         "algorithms were 3-4x slower here). 0 = one call.", _min(0)),
    Knob("num_links", "LCC_NUM_LINKS", _parse_int, 2, "",
         "Parallel TCP links per peer pair (Open MPI btl_tcp_links): lccrun passes it to "
         "mpirun; under plain mpirun, import lightcc and init() set OMPI_MCA_btl_tcp_links to "
         "it while MPI has not started and the variable is unset (init() warns when MPI "
         "started first on a multi-host job).", _min(1)),
    Knob("mpi_idle_sleep_us", "LCC_MPI_IDLE_SLEEP_US", _parse_idle_sleep, "auto", "us",
         "How an MPI wait idles: a turn of Open MPI's progress loop that found nothing to do "
         "sleeps this long (sets OMPI_MCA_mpi_yield_when_idle=1, "
         "threads_pthreads_yield_strategy=nanosleep and its nanosleep_time, the same way as "
         "btl_tcp_links), so waiting for a peer or the wire does not burn a core, at the price "
         "of tens of us per small message. 0 = Open MPI's spinning wait; auto = 20 when mpirun "
         "placed the ranks on several hosts with several on this one, else 0.",
         lambda v: None if v == "auto" or (isinstance(v, int) and v >= 0)
         else "must be auto or >= 0"),
    Knob("cross_transport", "LCC_CROSS_TRANSPORT", lambda t: t.strip().lower(), "auto", "",
         "What carries the point-to-point traffic between hosts (the ring algorithm, "
         "hierarchical's cross-host phase, the compressors' pipelined exchange): tcp = "
         "lightcc's own TCP connections, one per pair of ranks on different hosts, waited for "
         "in the kernel (no core spins while the wire is busy); mpi = Open MPI's TCP transport; "
         "auto = tcp when the job spans several hosts and some host runs several ranks. "
         "Addresses as for the control plane "
         "(LCC_CONTROL_ADDR when it names an interface). MPI's collectives are not affected.",
         _choice(("auto", "tcp", "mpi"))),
    Knob("transport", "LCC_TRANSPORT", lambda t: t.strip().lower(), "auto", "",
         "What the job runs on: mpi = MPI (the default when mpirun or lccrun launched it); "
         "tcp = no MPI at all, a rendezvous store (torch's TCPStore, else lightcc's own) and "
         "lightcc's TCP links between every pair of ranks (the default when torchrun's or "
         "Slurm's variables are set and no MPI launcher's); auto = that rule, logged at init.",
         _choice(("auto", "mpi", "tcp"))),
    Knob("rendezvous_timeout", "LCC_RENDEZVOUS_TIMEOUT", _parse_float, 300.0, "s",
         "MPI-free launch: how long init() waits for the store at MASTER_ADDR:MASTER_PORT and "
         "for every rank of WORLD_SIZE to arrive before it raises naming what is missing.",
         _min(1.0)),
    Knob("overlap", "LCC_OVERLAP", lambda t: t.strip().lower(), "auto", "",
         "When collectives start: 1 = in the background as soon as submitted (overlaps "
         "communication with compute); 0 = when a thread waits for them (lazy); auto = lazy "
         "only on a single host with fewer than 2 usable cores per rank, where background "
         "shared-memory collectives starve for CPU.", _choice(("auto", "0", "1"))),
    Knob("backend", "LCC_BACKEND", lambda t: t.strip().lower(), "auto", "",
         "Backend for GPU arrays (host arrays always use MPI): nccl = NCCL through CuPy, an "
         "error at the first GPU collective if a rank lacks it or two ranks share a GPU; mpi = "
         "MPI through pinned host buffers; auto = nccl when every rank of the process set has "
         "CuPy, NCCL and a GPU of its own, else mpi.", _choice(BACKENDS)),
    Knob("cpu_reduce", "LCC_CPU_REDUCE", _parse_bool, False, "",
         "GPU allreduce buckets are copied once to pinned host memory, reduced there by the "
         "host algorithm and compressor over MPI (inside and across nodes), and copied back "
         "(for PCIe-only machines, ACSpeed's CPU-Reduce).", ),
    Knob("deterministic", "LCC_DETERMINISTIC", _parse_bool, False, "",
         "float32 sums through the engine on 3 or more ranks add every rank's value in rank "
         "order, element by element, so a tensor's result is bitwise the same whatever its "
         "bucket, offset, fusion threshold or partition (cross-barrier mode then equals barrier "
         "mode bit for bit at any rank count; 2-rank sums are order-free anyway). Host "
         "tensors, uncompressed; the unnamed direct path and GPU buckets are not covered "
         "(docs/cross-barrier.md)."),
    Knob("timeline", "LCC_TIMELINE", _parse_str, "", "path",
         "Write a Chrome/Perfetto trace of every collective to this file.", ),
    Knob("timeline_all_ranks", "LCC_TIMELINE_ALL_RANKS", _parse_bool, False, "",
         "Every rank writes its own timeline (rank N to PATH.rank<N>, rank 0 to PATH); "
         "default: rank 0 only."),
    Knob("autotune", "LCC_AUTOTUNE", lambda t: t.strip().lower(), "0", "",
         "1 = tune fusion threshold, cycle time and algorithm online; refresh = ignore the "
         "cache and tune again.", _choice(AUTOTUNE_MODES)),
    Knob("autotune_log", "LCC_AUTOTUNE_LOG", _parse_str, "", "path",
         "CSV file with every autotuner sample.", ),
    Knob("autotune_cache", "LCC_AUTOTUNE_CACHE", _parse_str, "", "path",
         "Autotuner result cache (default: ~/.cache/lightcc/autotune.json).", ),
    Knob("control_addr", "LCC_CONTROL_ADDR", _parse_str, "", "",
         "Address, host name or network interface that ranks connect to for lightcc's "
         "control messages (TCP, a tree rooted at rank 0: LCC_CONTROL_FANOUT). An interface "
         "name applies on every host (each relay advertises its address there); an address or "
         "host name names rank 0's host. Default: loopback between ranks of one host, else "
         "every address of the relay's interfaces in turn."),
    Knob("control_fanout", "LCC_CONTROL_FANOUT", _parse_int, 4, "ranks",
         "Children per rank in the tree of TCP connections that carries lightcc's control "
         "messages, rooted at rank 0. In the steady state the ranks agree on cached requests "
         "in bit vectors on the way up, so no rank handles more than this many connections "
         "and reports per step; a job of up to this + 1 ranks is a star around rank 0.",
         _min(1)),
    Knob("flight_records", "LCC_FLIGHT_RECORDS", _parse_int, 256, "entries",
         "Flight recorder: how many of its last collectives each rank remembers (type, name, "
         "dtype, shape, process set, state, times) for the record it writes on SIGUSR1, a "
         "StallError, a lost rank or an uncaught exception (docs/elastic.md). 0 disables it.",
         _min(0)),
    Knob("flight_dir", "LCC_FLIGHT_DIR", _parse_str, "", "path",
         "Directory where each rank writes its flight record (rank<N>.json); lccrun sets a "
         "private one and prints a summary naming the rank that is behind. Empty: record, "
         "never write."),
    Knob("elastic_min_np", "LCC_ELASTIC_MIN_NP", _parse_int, 1, "ranks",
         "Elastic jobs (lightcc.torch.elastic.run, lccrun --min-np): when a rank dies and fewer "
         "ranks than this survive, the job ends with a message instead of going on "
         "(docs/elastic.md).", _min(1)),
    Knob("elastic_timeout", "LCC_ELASTIC_TIMEOUT", _parse_float, 600.0, "s",
         "Elastic jobs (lccrun --elastic-timeout): the longest the survivors may take to re-form "
         "the group after a rank died; past it the job ends (docs/elastic.md).", _min(0.1)),
    Knob("elastic_max_np", "LCC_ELASTIC_MAX_NP", _parse_int, 0, "ranks",
         "Elastic jobs (lccrun --max-np): after a reset the group grows back to this many "
         "ranks by starting new processes on listed hosts with free slots (lccrun's host list "
         "or discovery script). 0: never grow (docs/elastic.md).", _min(0)),
    Knob("elastic_blacklist_after", "LCC_ELASTIC_BLACKLIST_AFTER", _parse_int, 0, "failures",
         "Elastic jobs (lccrun --blacklist-after): a host on which this many ranks failed gets "
         "no new ranks for the rest of the job. 0: never blacklist (docs/elastic.md).",
         _min(0)),
    Knob("elastic_reset_limit", "LCC_ELASTIC_RESET_LIMIT", _parse_int, 0, "resets",
         "Elastic jobs (lccrun --reset-limit, Horovod's reset_limit): the most times the group "
         "may be re-formed; the failure or host change that would need one more ends the job "
         "with a message. 0: no limit (docs/elastic.md).", _min(0)),
    Knob("shutdown_timeout", "LCC_SHUTDOWN_TIMEOUT", _parse_float, 30.0, "s",
         "How long shutdown() waits for the background thread before giving up.", _min(0.0)),
)

_BY_FIELD = {k.field: k for k in KNOBS}


@dataclass(frozen=True)
class Config:
    """Validated settings of one ``init()``; see :data:`KNOBS` for meanings and units."""

    fusion_threshold: int
    cycle_time: float
    cache_capacity: int
    stall_check_time: float
    stall_shutdown_time: float
    log_level: str
    local_size: int
    compression: str
    compression_accuracy: str
    ef_ttl_steps: int
    codec_threads: int
    min_compress_bytes: int
    direct_bytes: int
    algorithm: str
    auto_small_bytes: int
    auto_multinode_bytes: int
    auto_multi_node: str
    ring_chunk_bytes: int
    mpi_chunk_bytes: int
    num_links: int
    mpi_idle_sleep_us: int | str
    cross_transport: str
    transport: str
    rendezvous_timeout: float
    overlap: str
    backend: str
    cpu_reduce: bool
    deterministic: bool
    timeline: str
    timeline_all_ranks: bool
    autotune: str
    autotune_log: str
    autotune_cache: str
    control_addr: str
    control_fanout: int
    flight_records: int
    flight_dir: str
    elastic_min_np: int
    elastic_timeout: float
    elastic_max_np: int
    elastic_blacklist_after: int
    elastic_reset_limit: int
    shutdown_timeout: float

    def replace(self, **changes: Any) -> "Config":
        """A copy with some fields changed (used by the autotuner)."""
        return dataclasses.replace(self, **changes)


def load(overrides: Mapping[str, Any] | None = None,
         environ: Mapping[str, str] | None = None) -> Config:
    """Read ``LCC_*`` variables, apply ``overrides`` (field names) and validate everything.

    Raises :class:`ConfigError` naming the variable, the bad value and what is expected.
    """
    env = os.environ if environ is None else environ
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - set(_BY_FIELD))
    if unknown:
        raise ConfigError(f"init() got unknown setting(s) {', '.join(unknown)}; "
                          f"known: {', '.join(sorted(_BY_FIELD))}")
    values: dict[str, Any] = {}
    for knob in KNOBS:
        if knob.field in overrides:
            value = overrides[knob.field]
            source = f"init({knob.field}=...)"
            if isinstance(value, str) and knob.parse is not _parse_str:
                value = _parse_or_raise(knob, value, source)
        elif knob.env in env:
            source = knob.env
            value = _parse_or_raise(knob, env[knob.env], source)
        else:
            values[knob.field] = knob.default
            continue
        problem = knob.check(value)
        if problem:
            raise ConfigError(f"{source}={value!r}: {problem}")
        values[knob.field] = value
    return Config(**values)


def _parse_or_raise(knob: Knob, text: str, source: str) -> Any:
    try:
        return knob.parse(text)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{source}={text!r} is not valid: {exc}") from None


def markdown_table() -> str:
    """The README's configuration table, generated from :data:`KNOBS`."""
    rows = ["| variable | default | unit | meaning |", "|---|---|---|---|"]
    for k in KNOBS:
        rows.append(f"| `{k.env}` | `{k.default!r}` | {k.unit} | {k.help} |")
    return "\n".join(rows)
