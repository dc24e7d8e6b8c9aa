"""``lccrun`` command-line flags and their translation into ``LCC_*`` environment variables.

Each tuning flag maps to one :data:`~lightcc.common.config.KNOBS` entry; the flag's value is
converted to the knob's unit (MB -> bytes for the fusion threshold) and checked with the knob's
own parser and check, so ``lccrun`` rejects exactly what ``init()`` would reject.
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, NoReturn

from ..common.config import KNOBS, Knob
from ..common.exceptions import ConfigError
from .discovery import discover_hosts
from .elastic_flags import elastic_flags_env, number_text as _num
from .horovod_flags import add_horovod_flags, apply_horovod_flags
from .hosts import Host, parse_host_list, parse_hostfile, total_slots
from .slurm import allocation_hosts

MB = 1024 * 1024
_KNOB = {k.env: k for k in KNOBS}


class UsageError(ConfigError):
    """A bad ``lccrun`` argument; reported as one line, exit code 2, before launching."""


@dataclass(frozen=True)
class KnobFlag:
    """A command-line flag that sets one ``LCC_*`` variable."""

    flag: str
    env: str
    type: Callable[[str], Any]
    metavar: str
    to_env: Callable[[Any], str] = str
    from_default: Callable[[Any], str] = str  # knob default, shown in flag units in --help

    @property
    def knob(self) -> Knob:
        return _KNOB[self.env]

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


def _mb_to_bytes(mb: float) -> str:
    return str(int(round(mb * MB)))


def _bytes_as_mb(value: int) -> str:
    return _num(value / MB)


KNOB_FLAGS: tuple[KnobFlag, ...] = (
    KnobFlag("--fusion-threshold-mb", "LCC_FUSION_THRESHOLD", float, "MB",
             _mb_to_bytes, _bytes_as_mb),
    KnobFlag("--cycle-time-ms", "LCC_CYCLE_TIME", float, "MS", _num, _num),
    KnobFlag("--cache-capacity", "LCC_CACHE_CAPACITY", int, "N"),
    KnobFlag("--compression", "LCC_COMPRESSION", str, "NAME"),
    KnobFlag("--algorithm", "LCC_ALGORITHM", str, "NAME"),
    KnobFlag("--timeline-filename", "LCC_TIMELINE", str, "PATH", os.path.abspath),
    KnobFlag("--autotune", "LCC_AUTOTUNE", str, "refresh"),
    KnobFlag("--autotune-log-file", "LCC_AUTOTUNE_LOG", str, "PATH", os.path.abspath),
    KnobFlag("--stall-check-time-seconds", "LCC_STALL_CHECK_TIME", float, "S", _num, _num),
    KnobFlag("--stall-shutdown-time-seconds", "LCC_STALL_SHUTDOWN_TIME", float, "S", _num, _num),
    KnobFlag("--log-level", "LCC_LOG_LEVEL", str, "LEVEL"),
    KnobFlag("--num-links", "LCC_NUM_LINKS", int, "N"),
    KnobFlag("--local-size", "LCC_LOCAL_SIZE", int, "N"),
)


@dataclass
class LaunchSpec:
    """Everything needed to build the ``mpirun`` command, validated."""

    np: int
    command: list[str]
    hosts: list[Host] | None = None
    hostfile: str | None = None
    knob_env: dict[str, str] = field(default_factory=dict)
    extra_env: dict[str, str | None] = field(default_factory=dict)  # -x NAME[=VALUE]
    network_interface: str | None = None
    ssh_port: int | None = None
    ssh_identity_file: str | None = None
    mpi_args: list[str] = field(default_factory=list)
    elastic: bool = False
    discovery_script: str | None = None     # polled while the job runs (elastic)
    discovery_period: float = 1.0           # seconds between polls
    start_timeout: float | None = None      # seconds until every rank must have started
    notes: list[str] = field(default_factory=list)   # one-line notes printed at launch
    slots_per_host: int = 1                 # slots of a discovered host listed without any
    status_period: float | None = None      # --status: seconds between status lines
    verbose: bool = False
    dry_run: bool = False


def default_text(kf: KnobFlag) -> str:
    """The knob's default in the flag's unit, e.g. ``64 MB`` (from KNOBS, never duplicated)."""
    default = kf.knob.default
    if default in ("", None):
        return "unset"
    unit = {"MB": "MB", "MS": "ms", "S": "s"}.get(kf.metavar, kf.knob.unit)
    return f"{kf.from_default(default)} {unit}".strip()


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2 (argparse prints usage too)
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="lccrun", allow_abbrev=False,
        description="Launch a lightcc job: builds and runs the Open MPI mpirun command line.",
        epilog="Example: lccrun -np 4 python train.py   |   lccrun -np 8 -H a:4,b:4 python "
               "train.py. Every LCC_* variable already set in the environment is forwarded too.")
    p.add_argument("-np", "--num-proc", dest="np", type=int, metavar="N",
                   help="number of ranks (default: total slots of -H/--hostfile)")
    p.add_argument("-H", "--hosts", metavar="HOST:SLOTS,...",
                   help="hosts and ranks per host, e.g. a:4,b:4 (slots default to 1)")
    p.add_argument("--hostfile", metavar="PATH", help="file with one 'host slots=N' per line")
    p.add_argument("--network-interface", metavar="IF[,IF]",
                   help="NICs (or CIDR subnets) for MPI and Open MPI's out-of-band traffic")
    p.add_argument("-p", "--ssh-port", type=int, metavar="PORT", help="ssh port of remote hosts")
    p.add_argument("-i", "--ssh-identity-file", metavar="PATH", help="ssh private key")
    tune = p.add_argument_group("tuning (each sets an LCC_* variable in every rank)")
    for kf in KNOB_FLAGS:
        help_text = f"{kf.knob.help} Env {kf.env}; default {default_text(kf)}."
        if kf.flag == "--autotune":
            tune.add_argument(kf.flag, dest=kf.dest, nargs="?", const="1", metavar="refresh",
                              help=help_text.replace("%", "%%"))
            continue
        tune.add_argument(kf.flag, dest=kf.dest, type=kf.type, metavar=kf.metavar,
                          help=help_text.replace("%", "%%"))
    el = p.add_argument_group("elastic (docs/elastic.md: a rank that dies no longer ends the job; "
                              "any of these launches with Open MPI's fault tolerance)")
    el.add_argument("--min-np", type=int, metavar="N",
                    help="end the job (with a message) when fewer ranks than this survive a "
                         "failure; default 1. Env LCC_ELASTIC_MIN_NP.")
    el.add_argument("--max-np", type=int, metavar="N",
                    help="grow back to N ranks at each reset, starting new processes on free "
                         "slots of the host list (-H, the discovery script, or this machine); "
                         "-np must not exceed it. Env LCC_ELASTIC_MAX_NP; default: never grow")
    el.add_argument("--elastic-timeout", type=float, metavar="S",
                    help="longest time the survivors may take to re-form the group after a "
                         "failure before the job ends; default 600 s. Env LCC_ELASTIC_TIMEOUT.")
    el.add_argument("--blacklist-after", type=int, metavar="N",
                    help="a host on which N ranks failed gets no new ranks (with --max-np); "
                         "default 0 = never. Env LCC_ELASTIC_BLACKLIST_AFTER.")
    el.add_argument("--reset-limit", type=int, metavar="N",
                    help="the most times the group may be re-formed (Horovod's reset_limit); "
                         "the failure that would need one more ends the job; default 0 = no "
                         "limit. Env LCC_ELASTIC_RESET_LIMIT.")
    el.add_argument("--host-discovery-script", metavar="PATH",
                    help="executable printing one 'host:slots' (or 'host') a line, as for "
                         "horovodrun; its hosts replace -H at launch, and it is run again "
                         "every --host-discovery-period seconds: a changed list resets every "
                         "rank at its next commit (ranks of removed hosts leave; with "
                         "--max-np, new ranks start on free slots)")
    el.add_argument("--host-discovery-period", type=float, default=1.0, metavar="S",
                    help="seconds between runs of the discovery script; default 1")
    add_horovod_flags(p)
    p.add_argument("-x", dest="extra_env", action="append", default=[], metavar="NAME[=VALUE]",
                   help="also forward this environment variable (set it when =VALUE is given)")
    p.add_argument("--mpi-args", default="", metavar='"..."',
                   help="extra mpirun arguments, passed through verbatim")
    p.add_argument("--status", nargs="?", const=5.0, type=float, metavar="SECONDS",
                   help="print a status line every SECONDS (default 5): steps/s, wire MB/s, "
                        "compression ratio, exposed communication, the slowest rank; "
                        "rewritten in place on a terminal")
    p.add_argument("--verbose", action="store_true",
                   help="print the mpirun command and prefix output lines with the rank")
    p.add_argument("--dry-run", action="store_true",
                   help="print the mpirun command and LCC_* environment, then exit")
    p.add_argument("--check-build", action="store_true",
                   help="print what this installation can do (MPI, torch, CuPy/NCCL, ...)")
    p.add_argument("--version", action="store_true", help="print the version and exit")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="the program each rank runs, e.g. python train.py --epochs 3")
    return p


_AUTOTUNE_VALUES = ("0", "1", "refresh")


def _normalise(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """Glue each option to its value (``--mpi-args=--map-by x``, ``-np=-1``) up to the command.

    argparse would otherwise take a value starting with ``-`` for an option, and let
    ``--autotune`` (optional value) swallow the command's first word. Nothing after the first
    word of the command is touched.
    """
    nargs = {s: a.nargs for a in parser._actions for s in a.option_strings}
    consts = {s: a.const for a in parser._actions for s in a.option_strings}
    out, i = [], 0
    while i < len(argv):
        tok = argv[i]
        name, eq, _ = tok.partition("=")
        if tok == "--" or not tok.startswith("-") or tok == "-" or name not in nargs:
            if name not in nargs and tok.startswith("-") and tok not in ("-", "--"):
                out.append(tok)  # unknown option: argparse reports it
                i += 1
                continue
            return out + argv[i:]  # the command starts here
        want = nargs[name]
        nxt = argv[i + 1] if i + 1 < len(argv) else None
        if eq or want == 0:
            out.append(tok)
        elif want == "?":
            if name == "--autotune":
                value = nxt if nxt in _AUTOTUNE_VALUES else "1"
            else:          # --status [SECONDS]: a number, else the flag's own default
                value = nxt if nxt is not None and _is_number(nxt) else str(consts[name])
            out.append(f"{name}={value}")
            i += value == nxt
        elif nxt is not None:
            out.append(f"{name}={nxt}")
            i += 1
        else:
            out.append(tok)  # missing value: argparse reports it
        i += 1
    return out


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = build_parser()
    ns = parser.parse_args(_normalise(argv, parser))
    if ns.command and ns.command[0] == "--":
        ns.command = ns.command[1:]
    return ns


def knob_env(ns: argparse.Namespace) -> dict[str, str]:
    """``LCC_*`` values from the tuning flags given, each validated by its knob."""
    env: dict[str, str] = {}
    for kf in KNOB_FLAGS:
        value = getattr(ns, kf.dest)
        if value is None:
            continue
        text = kf.to_env(value)
        knob = kf.knob
        try:
            parsed = knob.parse(text)
        except (TypeError, ValueError) as exc:
            raise UsageError(f"{kf.flag} {value!r}: {exc}") from None
        problem = knob.check(parsed)
        if problem:
            raise UsageError(f"{kf.flag} {value!r}: {problem}")
        env[kf.env] = text
    return env


def _extra_env(items: list[str]) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not name or not (name[0].isalpha() or name[0] == "_") or \
                not all(c.isalnum() or c == "_" for c in name):
            raise UsageError(f"-x {item!r}: expected NAME or NAME=VALUE")
        out[name] = value if sep else None
    return out


def _check_interfaces(text: str) -> str:
    parts = [t.strip() for t in text.split(",")]
    for part in parts:
        if not part or not all(c.isalnum() or c in "._:/-" for c in part):
            raise UsageError(f"--network-interface {text!r}: expected names like eth0 or "
                             f"subnets like 10.0.0.0/16, comma-separated")
    return ",".join(parts)


def to_spec(ns: argparse.Namespace, environ: dict[str, str] | None = None) -> LaunchSpec:
    """Validate a parsed command line into a :class:`LaunchSpec` (UsageError if invalid).

    ``environ`` (default ``os.environ``) is read for a Slurm allocation only."""
    if not ns.command:
        raise UsageError("no command given (e.g. lccrun -np 2 python train.py)")
    if ns.hosts is not None and ns.hostfile is not None:
        raise UsageError("give either -H/--hosts or --hostfile, not both")
    if ns.host_discovery_script is not None and (ns.hosts is not None or
                                                 ns.hostfile is not None):
        raise UsageError("give either --host-discovery-script or -H/--hostfile, not both")
    try:
        hv_mpi, hv_env, notes = apply_horovod_flags(ns)
        slots = ns.slots_per_host or 1
        hosts = (parse_host_list(ns.hosts, slots) if ns.hosts is not None
                 else parse_hostfile(ns.hostfile, slots) if ns.hostfile is not None
                 else discover_hosts(ns.host_discovery_script, default_slots=slots)
                 if ns.host_discovery_script is not None else None)
        if hosts is None:
            hosts = allocation_hosts(dict(os.environ if environ is None else environ))
            if hosts is not None:
                notes.append(f"Slurm allocation: hosts and slots from SLURM_JOB_NODELIST and "
                             f"SLURM_TASKS_PER_NODE: {','.join(h.spec() for h in hosts)}")
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
    np_ = ns.np
    if np_ is None:
        if hosts is None:
            raise UsageError("-np N is required (or give -H/--hostfile to use all their slots)")
        np_ = total_slots(hosts)
    if np_ < 1:
        raise UsageError(f"-np must be >= 1, got {np_}")
    if hosts is not None and np_ > total_slots(hosts):
        raise UsageError(f"-np {np_} exceeds the {total_slots(hosts)} slots of the host list; "
                         f"add slots (host:N) or lower -np")
    if ns.ssh_port is not None and not 0 < ns.ssh_port < 65536:
        raise UsageError(f"--ssh-port {ns.ssh_port}: must be in 1..65535")
    if ns.ssh_identity_file is not None and not os.path.isfile(ns.ssh_identity_file):
        raise UsageError(f"--ssh-identity-file {ns.ssh_identity_file!r}: no such file")
    try:
        mpi_args = shlex.split(ns.mpi_args)
    except ValueError as exc:
        raise UsageError(f"--mpi-args {ns.mpi_args!r}: {exc}") from None
    mpi_args = hv_mpi + mpi_args
    try:
        elastic_env = elastic_flags_env(ns, np_)
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
    if ns.timeline_filename is not None and "LCC_TIMELINE_ALL_RANKS" not in (
            os.environ if environ is None else environ):   # one file for the job
        hv_env.setdefault("LCC_TIMELINE_ALL_RANKS", "1")
    if elastic_env and "--with-ft" not in mpi_args:
        mpi_args += ["--with-ft", "ulfm"]
    if elastic_env and "state_base_recoverable" not in ns.mpi_args:
        # every job PRRTE starts, the spawned ones included, counts as recoverable: the
        # death of a process that joined is then an elastic event, not the job's failure
        mpi_args += ["--prtemca", "state_base_recoverable", "1"]
    return LaunchSpec(
        np=np_, command=list(ns.command), hosts=hosts,
        hostfile=os.path.abspath(ns.hostfile) if ns.hostfile else None,
        knob_env={**knob_env(ns), **hv_env, **elastic_env},
        extra_env=_extra_env(ns.extra_env),
        network_interface=(_check_interfaces(ns.network_interface)
                           if ns.network_interface is not None else None),
        ssh_port=ns.ssh_port,
        ssh_identity_file=(os.path.abspath(ns.ssh_identity_file)
                           if ns.ssh_identity_file else None),
        mpi_args=mpi_args, elastic=bool(elastic_env),
        discovery_script=(os.path.abspath(ns.host_discovery_script)
                          if ns.host_discovery_script else None),
        discovery_period=ns.host_discovery_period, verbose=ns.verbose, dry_run=ns.dry_run,
        start_timeout=ns.start_timeout, notes=notes, slots_per_host=ns.slots_per_host or 1,
        status_period=_status_period(ns.status))


def _status_period(value: float | None) -> float | None:
    if value is not None and not value > 0:
        raise UsageError(f"--status {value:g}: must be > 0 seconds")
    return value


def flag_table() -> str:
    """Markdown table of every tuning flag next to its variable (for docs/launcher.md)."""
    rows = ["| flag | variable | default | meaning |", "|---|---|---|---|"]
    for kf in KNOB_FLAGS:
        flag = f"{kf.flag} [{kf.metavar}]" if kf.flag == "--autotune" else f"{kf.flag} {kf.metavar}"
        rows.append(f"| `{flag}` | `{kf.env}` | {default_text(kf)} | {kf.knob.help} |")
    return "\n".join(rows)


if __name__ == "__main__":  # pragma: no cover - helper for writing the docs
    sys.stdout.write(flag_table() + "\n")
