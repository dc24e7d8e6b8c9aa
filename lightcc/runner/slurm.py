"""Hosts and slots of the Slurm allocation lccrun runs in (``salloc``, ``sbatch``).

Slurm writes the allocation in a compressed form: ``SLURM_JOB_NODELIST=node[01-03,07],gpu5``
(ranges keep their zero padding; several bracket groups in one name multiply out,
``r[1-2]-n[1-2]`` is r1-n1, r1-n2, r2-n1, r2-n2) and ``SLURM_TASKS_PER_NODE=2(x3),1`` (2 tasks
on each of the first 3 nodes, 1 on the next). Malformed text raises
:class:`~lightcc.common.exceptions.ConfigError` naming the variable and the bad part.
"""
from __future__ import annotations

import re

from ..common.exceptions import ConfigError
from .hosts import Host, parse_host_list

NODELIST_ENV = "SLURM_JOB_NODELIST"
TASKS_ENV = "SLURM_TASKS_PER_NODE"
_RANGE_RE = re.compile(r"^(\d+)(?:-(\d+))?$")
_TASKS_RE = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def _split_top(text: str, where: str) -> list[str]:
    """Split at commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ConfigError(f"{where}: nested '[' in {text!r}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ConfigError(f"{where}: ']' without '[' in {text!r}")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ConfigError(f"{where}: unclosed '[' in {text!r}")
    parts.append(text[start:])
    return parts


def _expand_range(body: str, where: str) -> list[str]:
    """``01-03,07`` -> ['01', '02', '03', '07'] (zero padding of the lower bound kept)."""
    out = []
    for item in body.split(","):
        m = _RANGE_RE.match(item.strip())
        if not m:
            raise ConfigError(f"{where}: {item!r} is not a number or a range like 01-03")
        lo, hi = m.group(1), m.group(2) if m.group(2) is not None else m.group(1)
        if int(hi) < int(lo):
            raise ConfigError(f"{where}: range {item!r} goes down")
        width = len(lo) if lo.startswith("0") else 0
        out += [str(n).zfill(width) for n in range(int(lo), int(hi) + 1)]
    return out


def expand_nodelist(text: str, where: str = NODELIST_ENV) -> list[str]:
    """Slurm's compressed node list -> host names in order."""
    if not text or not text.strip():
        raise ConfigError(f"{where}: empty node list")
    names: list[str] = []
    for part in _split_top(text.strip(), where):
        if not part:
            raise ConfigError(f"{where}: empty entry in {text!r}")
        pieces = re.split(r"(\[[^\]]*\])", part)
        expanded = [""]
        for piece in pieces:
            if piece.startswith("["):
                options = _expand_range(piece[1:-1], where)
            else:
                if "[" in piece or "]" in piece:
                    raise ConfigError(f"{where}: unbalanced brackets in {part!r}")
                options = [piece]
            expanded = [head + tail for head in expanded for tail in options]
        names += expanded
    return names


def expand_tasks(text: str, where: str = TASKS_ENV) -> list[int]:
    """``2(x3),1`` -> [2, 2, 2, 1]."""
    if not text or not text.strip():
        raise ConfigError(f"{where}: empty")
    out: list[int] = []
    for item in text.strip().split(","):
        m = _TASKS_RE.match(item.strip())
        if not m:
            raise ConfigError(f"{where}: {item!r} is not N or N(xK)")
        count, repeat = int(m.group(1)), int(m.group(2) or 1)
        if count < 1 or repeat < 1:
            raise ConfigError(f"{where}: {item!r} must count at least 1")
        out += [count] * repeat
    return out


def allocation_hosts(environ: dict[str, str]) -> list[Host] | None:
    """The allocation's hosts and slots, or None outside Slurm (no ``SLURM_JOB_NODELIST``).

    Slots are ``SLURM_TASKS_PER_NODE`` (1 per node when unset)."""
    nodelist = environ.get(NODELIST_ENV)
    if not nodelist:
        return None
    names = expand_nodelist(nodelist)
    tasks_text = environ.get(TASKS_ENV)
    tasks = expand_tasks(tasks_text) if tasks_text else [1] * len(names)
    if len(tasks) != len(names):
        raise ConfigError(f"{TASKS_ENV}={tasks_text!r} counts {len(tasks)} nodes but "
                          f"{NODELIST_ENV}={nodelist!r} lists {len(names)}")
    # the names are checked (and duplicates refused) like a -H list
    return parse_host_list(",".join(f"{n}:{s}" for n, s in zip(names, tasks)))
