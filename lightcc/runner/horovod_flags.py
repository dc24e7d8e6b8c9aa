"""horovodrun's flags that lccrun accepts besides its own, so a horovodrun command line works.

Each one is an alias of an lccrun setting, an Open MPI option, or a flag that does not apply
to lightcc and is accepted with a one-line note (never silently):

* ``--start-timeout S``: lccrun's start-up watch (:mod:`~lightcc.runner.startup`);
* ``--output-filename DIR``: each rank's stdout/stderr in ``DIR/<job>/rank.<N>/``
  (Open MPI's ``--output dir=DIR``);
* ``--prefix-output-with-timestamp``: Open MPI's ``--output timestamp``;
* ``--config-file FILE``: Horovod's YAML (``params``, ``autotune``, ``timeline``,
  ``stall_check``, ``logging``); a flag given on the command line wins;
* ``--hierarchical-allreduce``: ``--algorithm hierarchical``;
* ``--no-stall-check``: ``LCC_STALL_CHECK_TIME=0`` and ``LCC_STALL_SHUTDOWN_TIME=0``;
* ``--timeline-mark-cycles``: lightcc's file timeline always marks cycles (a note);
* ``--slots-per-host N``: the slot count of every host listed without one (``-H a,b``, a
  hostfile line without ``slots=``, a discovery script printing bare names).
"""
from __future__ import annotations

import argparse
import os
from typing import Any

from ..common.exceptions import ConfigError

MB = 1024 * 1024


def add_horovod_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("horovodrun compatibility (docs/launcher.md)")
    g.add_argument("--start-timeout", type=float, metavar="S",
                   help="end the job when not every rank has started after S seconds, naming "
                        "the hosts still missing (a progress line every 5 s until then); "
                        "default: no limit")
    g.add_argument("--output-filename", metavar="DIR",
                   help="write each rank's stdout and stderr under DIR (Open MPI's --output "
                        "dir=DIR: DIR/<job>/rank.<N>/stdout)")
    g.add_argument("--prefix-output-with-timestamp", action="store_true",
                   help="prefix every output line with the time (Open MPI's --output "
                        "timestamp)")
    g.add_argument("--config-file", metavar="YAML",
                   help="Horovod's YAML config file (params, autotune, timeline, stall_check, "
                        "logging); flags given on the command line win")
    g.add_argument("--hierarchical-allreduce", action="store_true",
                   help="alias of --algorithm hierarchical")
    g.add_argument("--no-stall-check", action="store_true",
                   help="no stall warnings and no StallError (LCC_STALL_CHECK_TIME=0, "
                        "LCC_STALL_SHUTDOWN_TIME=0)")
    g.add_argument("--timeline-mark-cycles", action="store_true",
                   help="accepted; lightcc's timeline file always marks engine cycles")
    g.add_argument("--slots-per-host", type=int, metavar="N",
                   help="slots of every host listed without a count (-H a,b; hostfile lines "
                        "without slots=; a discovery script's bare names); default 1")


# Horovod YAML (section, key) -> lccrun destination; None: accepted with a note
_YAML: dict[tuple[str, str], str | None] = {
    ("params", "fusion_threshold_mb"): "fusion_threshold_mb",
    ("params", "cycle_time_ms"): "cycle_time_ms",
    ("params", "cache_capacity"): "cache_capacity",
    ("params", "hierarchical_allreduce"): "hierarchical_allreduce",
    ("params", "hierarchical_allgather"): None,
    ("autotune", "enabled"): "autotune",
    ("autotune", "log_file"): "autotune_log_file",
    ("timeline", "filename"): "timeline_filename",
    ("timeline", "mark_cycles"): "timeline_mark_cycles",
    ("stall_check", "enabled"): "stall_check_enabled",
    ("stall_check", "warning_time_seconds"): "stall_check_time_seconds",
    ("stall_check", "shutdown_time_seconds"): "stall_shutdown_time_seconds",
    ("logging", "level"): "log_level",
}


def read_config_file(path: str) -> tuple[dict[str, Any], list[str]]:
    """(lccrun destination -> value, notes) from a Horovod YAML config file."""
    import yaml

    try:
        with open(path) as fh:
            data = yaml.safe_load(fh) or {}
    except FileNotFoundError:
        raise ConfigError(f"--config-file {path!r}: no such file") from None
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"--config-file {path!r}: {exc}".replace("\n", " ")) from None
    if not isinstance(data, dict):
        raise ConfigError(f"--config-file {path!r}: expected sections (params:, timeline:, ...)")
    values: dict[str, Any] = {}
    ignored: list[str] = []
    for section, body in data.items():
        if not isinstance(body, dict):
            ignored.append(str(section))
            continue
        for key, value in body.items():
            dest = _YAML.get((str(section), str(key)), "?")
            if dest is None or dest == "?":
                ignored.append(f"{section}.{key}")
            else:
                values[dest] = value
    notes = [f"--config-file: {', '.join(ignored)} do not apply to lightcc and are ignored"] \
        if ignored else []
    return values, notes


def _from_config(ns: argparse.Namespace, values: dict[str, Any]) -> None:
    """Fill flags the command line left unset from the config file's values."""
    for dest, value in values.items():
        if dest == "autotune":
            if ns.autotune is None and value:
                ns.autotune = "1"
        elif dest == "stall_check_enabled":
            ns.no_stall_check = ns.no_stall_check or not value
        elif dest in ("hierarchical_allreduce", "timeline_mark_cycles"):
            setattr(ns, dest, getattr(ns, dest) or bool(value))
        elif getattr(ns, dest, None) is None:
            setattr(ns, dest, str(value).lower() if dest == "log_level" else value)


def apply_horovod_flags(ns: argparse.Namespace) -> tuple[list[str], dict[str, str], list[str]]:
    """Fold the horovodrun flags into ``ns``; returns (mpirun arguments, LCC_* values, notes).

    Raises ConfigError for a bad value."""
    notes: list[str] = []
    if ns.config_file is not None:
        values, notes = read_config_file(ns.config_file)
        _from_config(ns, values)
    env: dict[str, str] = {}
    if ns.hierarchical_allreduce:
        if ns.algorithm not in (None, "hierarchical"):
            raise ConfigError(f"--hierarchical-allreduce contradicts --algorithm {ns.algorithm}")
        ns.algorithm = "hierarchical"
    if ns.no_stall_check:
        given = [f for f, v in (("--stall-check-time-seconds", ns.stall_check_time_seconds),
                                ("--stall-shutdown-time-seconds",
                                 ns.stall_shutdown_time_seconds)) if v not in (None, 0)]
        if given:
            raise ConfigError(f"--no-stall-check contradicts {' and '.join(given)}")
        env = {"LCC_STALL_CHECK_TIME": "0", "LCC_STALL_SHUTDOWN_TIME": "0"}
    if ns.timeline_mark_cycles:
        notes.append("--timeline-mark-cycles: lightcc's timeline file always marks engine "
                     "cycles (CYCLE instants); nothing to change")
    if ns.start_timeout is not None and not ns.start_timeout > 0:
        raise ConfigError(f"--start-timeout {ns.start_timeout:g}: must be > 0 seconds")
    if ns.slots_per_host is not None and ns.slots_per_host < 1:
        raise ConfigError(f"--slots-per-host {ns.slots_per_host}: must be >= 1")
    output = []
    if ns.output_filename is not None:
        if "," in ns.output_filename or not ns.output_filename.strip():
            raise ConfigError(f"--output-filename {ns.output_filename!r}: expected a "
                              f"directory name without commas")
        output.append(f"dir={os.path.abspath(ns.output_filename)}")
    if ns.prefix_output_with_timestamp:
        output.append("timestamp")
    mpi = ["--output", ",".join(output)] if output else []
    return mpi, env, notes
