"""``lccrun`` main: parse, validate, then print (``--dry-run``) or run the ``mpirun`` command."""
from __future__ import annotations

import os
import shutil
import sys
import tempfile

from ..common.exceptions import ConfigError
from .args import UsageError, parse_args, to_spec
from .command import (STATUS_DIR_ENV, Launch, build_command, check_command, current_machine,
                      dry_run_text)
from .version import lightcc_version

USAGE_EXIT = 2


def _fail(message: str) -> int:
    sys.stderr.write(f"lccrun: error: {message} (see lccrun --help)\n")
    return USAGE_EXIT


def prepare(argv: list[str], environ: dict[str, str] | None = None) -> tuple[str, object]:
    """Parse ``argv`` into ('version' | 'check' | 'launch', payload); UsageError if invalid."""
    ns = parse_args(argv)
    if ns.version:
        return "version", f"lccrun (lightcc) {lightcc_version()}"
    if ns.check_build:
        return "check", None
    env = dict(os.environ if environ is None else environ)
    spec = to_spec(ns, env)
    launch = build_command(spec, current_machine(), env)
    try:
        check_command(spec.command, launch.env.get("PATH"))
    except UsageError as exc:
        if not spec.dry_run:
            raise
        launch.warnings.append(str(exc))  # a dry run may describe a command for elsewhere
    return ("dry-run" if spec.dry_run else "launch"), (spec, launch)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv in (["-h"], ["--help"]) or not argv:
        from .args import build_parser

        build_parser().print_help()
        return 0 if argv else USAGE_EXIT
    try:
        mode, payload = prepare(argv)
    except (UsageError, ConfigError) as exc:
        return _fail(str(exc))
    if mode == "version":
        print(payload)
        return 0
    if mode == "check":
        from .check_build import collect, render

        sys.stdout.write(render(collect()))
        return 0
    spec, launch = payload  # type: ignore[misc]
    if mode == "dry-run":
        sys.stdout.write(dry_run_text(launch))
        return 0
    for note in spec.notes:
        print(f"lccrun: {note}", file=sys.stderr, flush=True)
    return run(launch, verbose=spec.verbose, spec=spec)


def run(launch: Launch, verbose: bool = False, spec: object = None) -> int:
    """Run the job with a private status directory for the rank wrappers."""
    from .supervise import supervise

    if verbose:
        sys.stderr.write(f"lccrun: {launch.shell()}\n")
        sys.stderr.flush()
    status_dir = tempfile.mkdtemp(prefix="lccrun-")
    env = dict(launch.env)
    env[STATUS_DIR_ENV] = status_dir
    env.setdefault("LCC_FLIGHT_DIR", os.path.join(status_dir, "flight"))
    registry, watch = _start_watch(spec)
    argv = list(launch.argv)
    status = None
    if registry is not None:
        env.update(registry.env())
        if getattr(spec, "status_period", None):
            from .status import STATUS_ENV, StatusWatch

            env[STATUS_ENV] = repr(spec.status_period)
            argv[1:1] = ["-x", STATUS_ENV]
            status = StatusWatch(registry, spec.status_period)
        for name in registry.env():       # remote ranks see only what -x forwards
            argv[1:1] = ["-x", name]
    discovery = None
    if getattr(spec, "elastic", False):
        from .discovery import Discovery
        from .hosts import Host

        slots = max(spec.np, int(launch.env.get("LCC_ELASTIC_MAX_NP", "0") or 0))
        discovery = Discovery(status_dir, spec.hosts or [Host("localhost", slots)],
                              spec.discovery_script, spec.discovery_period,
                              spec.slots_per_host)
    try:
        sys.stdout.flush()
        return supervise(argv, env, status_dir, flight_dir=env["LCC_FLIGHT_DIR"],
                         discovery=discovery, startup=watch, status=status)
    finally:
        if registry is not None:
            registry.close()
        shutil.rmtree(status_dir, ignore_errors=True)
        if "LCC_TIMELINE" in getattr(spec, "knob_env", {}):
            merge_timeline(spec.knob_env["LCC_TIMELINE"])


def merge_timeline(path: str) -> None:
    """``--timeline-filename``: the ranks' files merged into ``path`` (one Perfetto file, a
    process track per rank), the per-rank table and, when the torch layer marked training steps,
the per-step table printed (docs/timeline.md)."""
    from ..common.observability import timeline_merge

    try:
        done = timeline_merge.merge(path)
        if not done["ranks"]:
            return
        events = timeline_merge.read_events(path)
        rows, steps = timeline_merge.summary(events), timeline_merge.steps(events)
    except OSError as exc:
        print(f"lccrun: timeline {path}: cannot merge the ranks' files: {exc}", file=sys.stderr)
        return
    cut = f", {done['dropped']} events left out (cap)" if done["dropped"] else ""
    print(f"lccrun: timeline {path}: {done['ranks']} rank files merged, {done['events']} "
          f"events{cut}", file=sys.stderr)
    lines = timeline_merge.table(rows)
    if steps:        # training steps marked by the torch layer (docs/timeline.md)
        lines += timeline_merge.step_table(steps)
    for line in lines:
        print(f"lccrun: {line}", file=sys.stderr)


def _start_watch(spec) -> tuple[object, object]:
    """lccrun's start-up registry and its watch (docs/launcher.md, "Start-up"); (None, None)
    when lccrun runs without a LaunchSpec (tests)."""
    if spec is None:
        return None, None
    from ..common.control.transport import interface_addresses
    from .startup import Registry, StartWatch, agent_command, layout

    addrs = ["127.0.0.1"] + [a for a in interface_addresses().values()
                             if not a.startswith("127.")]
    registry = Registry(addrs)
    agent = agent_command(spec.mpi_args, spec.ssh_port, spec.ssh_identity_file)
    return registry, StartWatch(registry, layout(spec.hosts, spec.np,
                                                 "--map-by" in spec.mpi_args), spec.start_timeout, agent)
