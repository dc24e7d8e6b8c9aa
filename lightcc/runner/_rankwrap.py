"""Run one rank's Python program so that its failure ends the whole job promptly.

``lccrun`` starts ``python train.py args`` as ``python -m lightcc.runner._rankwrap train.py
args`` (also ``-c code`` and ``-m module``). The program runs in this process as ``__main__``.
If it raises or calls ``sys.exit`` with a non-zero code after MPI was initialised, a plain exit
would block in ``MPI_Finalize`` while the other ranks wait in a collective; instead this
wrapper prints the traceback, records the rank's exit status in ``$LCC_RUNNER_STATUS_DIR`` (when
lccrun set it) and calls ``MPI_Abort`` with the exit code, so Open MPI ends every rank.
A clean exit (code 0) is left alone. It also exports torchrun's per-rank variables (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``) from Open MPI's, so torchrun-style
scripts run unchanged.

Other programs run as ``python -I .../_rankwrap.py --exec program args`` (the file itself, so
nothing but the standard library is imported): the program runs as a child process and a
non-zero exit or a fatal signal is recorded the same way, then passed on unchanged (exit code,
or the same signal) so Open MPI sees what it would have seen without the wrapper.
"""
from __future__ import annotations

import importlib.util
import json
import os
import runpy
import signal
import subprocess
import sys
import time
import traceback
import types

if __package__:
    from .. import _exit
else:   # run as a file under ``python -I``: load the stdlib-only sibling, not the lightcc package
    _spec = importlib.util.spec_from_file_location(
        "_lightcc_exit", os.path.join(os.path.dirname(os.path.dirname(
            os.path.realpath(__file__))), "_exit.py"))
    _exit = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_exit)

# how a failure ends the job is shared with init()'s exit hook (lightcc/_exit.py)
STATUS_DIR_ENV = _exit.STATUS_DIR_ENV
CONSEQUENCE_WAIT_S = _exit.CONSEQUENCE_WAIT_S
world_rank = _exit.world_rank
is_consequence = _exit.is_consequence
wait_for_cause = _exit.wait_for_cause


ADDR_ENV = "LCC_RUNNER_ADDR"     # "addr1,addr2:port": lccrun's start-up registry (startup.py)
TOKEN_ENV = "LCC_RUNNER_TOKEN"   # proves a report comes from this job


def announce(environ: dict[str, str] | None = None, timeout: float = 2.0) -> bool:
    """Tell lccrun this rank's process is up (``<token> <rank> <host> <pid>``), trying each
    address lccrun gave; never raises. False when not under lccrun or nobody answered."""
    import socket

    environ = os.environ if environ is None else environ
    where, token, rank = environ.get(ADDR_ENV, ""), environ.get(TOKEN_ENV, ""), world_rank()
    if not where or not token or rank is None:
        return False
    line = f"{token} {rank} {socket.gethostname()} {os.getpid()}\n".encode()
    return _exit.report_to_lccrun(where, line, timeout)


# torchrun's per-rank variables, from Open MPI's (PMIx's as a fallback for the rank)
_TORCH_VARS = {"RANK": ("OMPI_COMM_WORLD_RANK", "PMIX_RANK"),
               "WORLD_SIZE": ("OMPI_COMM_WORLD_SIZE",),
               "LOCAL_RANK": ("OMPI_COMM_WORLD_LOCAL_RANK",),
               "LOCAL_WORLD_SIZE": ("OMPI_COMM_WORLD_LOCAL_SIZE",)}


def export_torch_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """Set ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE`` from the MPI launch,
    so scripts written for torchrun run unchanged (``MASTER_ADDR``/``MASTER_PORT`` come from
    lccrun). Returns what was set; variables MPI does not provide are left alone."""
    env = os.environ if env is None else env
    done = {}
    for name, sources in _TORCH_VARS.items():
        value = next((env[s] for s in sources if env.get(s, "").isdigit()), None)
        if value is not None:
            env[name] = done[name] = value
    return done


def write_status(code: int, what: str, signum: int = 0, consequence: bool = False) -> None:
    """Record ``{rank, code, what, signal, consequence, time}`` for lccrun's summary; never
    raises. ``consequence``: the error only reports that another rank failed."""
    directory, rank = os.environ.get(STATUS_DIR_ENV), world_rank()
    if not directory or rank is None:
        return
    record = {"rank": rank, "code": code, "what": what, "time": time.time()}
    job_rank = os.environ.get("OMPI_COMM_WORLD_RANK", "")
    if _exit.launch_number is not None and job_rank.isdigit():
        # joined an elastic job: ``rank`` is its launch number; prterun's banners name it by
        # its rank in its own spawned job
        record["job_rank"] = int(job_rank)
    if signum:
        record["signal"] = signum
    if consequence:
        record["consequence"] = True
    try:
        path = os.path.join(directory, f"rank-{rank}.json")
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as fh:
            json.dump(record, fh)
        os.replace(tmp, path)
    except OSError:
        pass


def _exit_code(exc: BaseException) -> tuple[int, str]:
    """(exit code, description) the way the interpreter itself would exit."""
    if isinstance(exc, SystemExit):
        code = exc.code
        if code is None:
            return 0, ""
        if isinstance(code, int):
            return code, "sys.exit"
        print(code, file=sys.stderr)  # sys.exit("message") prints it and exits 1
        return 1, f"sys.exit({str(code)[:200]!r})"
    if isinstance(exc, KeyboardInterrupt):
        return 130, "KeyboardInterrupt"
    return 1, f"uncaught {type(exc).__name__}: {str(exc)[:300]}".rstrip(": ")


def _user_traceback(exc: BaseException) -> None:
    """Print the traceback without this wrapper's and runpy's frames."""
    tb = exc.__traceback__
    skip = {os.path.abspath(__file__), os.path.abspath(runpy.__file__), "<frozen runpy>"}
    while tb is not None and (tb.tb_frame.f_code.co_filename in skip
                              or os.path.abspath(tb.tb_frame.f_code.co_filename) in skip):
        tb = tb.tb_next
    traceback.print_exception(type(exc), exc, tb)


def _flight_dump(reason: str) -> None:
    """Write lightcc's flight record if lightcc was used (never imports it) and have the other
    ranks of this host write theirs before MPI_Abort takes them down."""
    recorder = sys.modules.get("lightcc.common.observability.flight")
    if recorder is not None:
        recorder.dump_on_exit(reason)


def _run(args: list[str]) -> None:
    """Run ``script args`` / ``-c code args`` / ``-m module args`` as ``__main__``."""
    if args[0] == "-c":
        sys.argv = ["-c", *args[2:]]
        module = types.ModuleType("__main__")
        module.__dict__["__builtins__"] = __builtins__
        saved = sys.modules.get("__main__")
        sys.modules["__main__"] = module
        try:
            exec(compile(args[1], "<string>", "exec"), module.__dict__)  # noqa: S102
        finally:
            if saved is not None:
                sys.modules["__main__"] = saved
    elif args[0] == "-m":
        sys.argv = args[1:]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(args)
        if not getattr(sys.flags, "isolated", 0):
            sys.path[0] = os.path.dirname(os.path.realpath(args[0]))
        runpy.run_path(args[0], run_name="__main__")


def run_child(command: list[str]) -> int:
    """Run a non-Python program as a child; record and pass on a non-zero exit or a signal."""
    try:
        child = subprocess.Popen(command)
    except OSError as exc:
        print(f"lccrun: rank {world_rank()}: cannot start {command[0]!r}: {exc.strerror}",
              file=sys.stderr)
        write_status(127, f"cannot start {command[0]!r}")
        return 127

    told: list[int] = []  # signals sent to us (teardown by Open MPI or lccrun): not a failure

    def forward(signum, _frame) -> None:
        told.append(signum)
        try:
            child.send_signal(signum)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, forward)
    code = child.wait()
    if code > 0 and not told:
        write_status(code, "")
    elif code < 0:
        if not told:
            write_status(128 - code, "", signum=-code)
        sys.stdout.flush()
        try:
            signal.signal(-code, signal.SIG_DFL)  # die the same way, for Open MPI's report
        except (OSError, ValueError):  # SIGKILL, SIGSTOP: already the default
            pass
        os.kill(os.getpid(), -code)
        return 128 - code
    return code


def main(args: list[str] | None = None) -> int:
    args = sys.argv[1:] if args is None else args
    export_torch_env()
    announce()
    if args[:1] == ["--exec"] and len(args) > 1:
        return run_child(args[1:])
    if not args or (args[0] in ("-c", "-m") and len(args) < 2):
        print("usage: python -m lightcc.runner._rankwrap (script | -c code | -m module) [args]"
              "\n       python -I _rankwrap.py --exec program [args]", file=sys.stderr)
        return 2
    try:
        _run(args)
    except BaseException as exc:  # noqa: BLE001 - every way out is reported
        code, what = _exit_code(exc)
        if code == 0:
            return 0
        if not isinstance(exc, SystemExit):
            _user_traceback(exc)
        _flight_dump(f"exited on {what}")
        consequence = is_consequence(exc)
        write_status(code, what, consequence=consequence)
        if consequence:
            wait_for_cause()
        _exit.abort_if_mpi(code)
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
