"""Test-only fault injection: raise :class:`InjectedFault` at chosen points of a collective.

Enabled by the environment variable ``LCC_TEST_FAULT`` (set the same on every rank), or by
:func:`set_spec` from a test. A spec is ``site:substring[:ranks[:mode]]``; several specs are
separated by ``;``.

* ``site``: ``compressor`` (a compressor's scheme), ``algorithm`` (an allreduce algorithm) or
  ``backend`` (the communication of any collective, "result check failed");
* ``substring``: the fault fires for a bucket when one of its tensor names contains it
  (``*`` matches every bucket);
* ``ranks``: world ranks that raise, ``1`` or ``0+2`` (default ``*``: every rank);
* ``mode``: ``end`` (default): raised where the bucket's communication has completed on
  every rank, so the communication sequence stays matched and the engine's per-bucket error
  agreement fails the bucket everywhere; ``early``: raised *before* the site communicates,
  which leaves the peers blocked inside MPI — used to test that such a job ends (the failing
  rank aborts after the agreement timeout) instead of hanging.

Set ``LCC_TEST_AGREEMENT_TIMEOUT`` (seconds, default 60) to shorten that timeout in tests.
Nothing here runs unless a spec is set: :func:`enabled` is one global read.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Iterable

from ..exceptions import ConfigError, LightCCError

ENV = "LCC_TEST_FAULT"
TIMEOUT_ENV = "LCC_TEST_AGREEMENT_TIMEOUT"
SITES = ("compressor", "algorithm", "backend")
MODES = ("end", "early")


class InjectedFault(LightCCError):
    """The exception a fault site raises (a test asked for it)."""


@dataclass(frozen=True)
class FaultSpec:
    """One parsed ``site:substring[:ranks[:mode]]``; ``ranks`` None means every rank."""

    site: str
    substring: str
    ranks: frozenset[int] | None = None
    mode: str = "end"

    def matches(self, site: str, names: Iterable[str], rank: int, mode: str) -> bool:
        if site != self.site or mode != self.mode:
            return False
        if self.ranks is not None and rank not in self.ranks:
            return False
        return self.substring == "*" or any(self.substring in n for n in names)


def parse(text: str) -> tuple[FaultSpec, ...]:
    """Parse a spec string (see module docstring); ConfigError naming the bad part."""
    specs = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        fields = part.split(":")
        if not 2 <= len(fields) <= 4:
            raise ConfigError(f"{ENV}={text!r}: {part!r} is not site:substring[:ranks[:mode]]")
        site, sub = fields[0].strip().lower(), fields[1]
        if site not in SITES:
            raise ConfigError(f"{ENV}={text!r}: site {site!r} must be one of {', '.join(SITES)}")
        if not sub:
            raise ConfigError(f"{ENV}={text!r}: empty tensor-name substring (use '*')")
        ranks = None
        if len(fields) >= 3 and fields[2].strip() not in ("", "*"):
            try:
                ranks = frozenset(int(r) for r in fields[2].split("+"))
            except ValueError:
                raise ConfigError(f"{ENV}={text!r}: ranks {fields[2]!r} must look like 1 or "
                                  f"0+2") from None
            if any(r < 0 for r in ranks):
                raise ConfigError(f"{ENV}={text!r}: negative rank in {fields[2]!r}")
        mode = fields[3].strip().lower() if len(fields) == 4 else "end"
        if mode not in MODES:
            raise ConfigError(f"{ENV}={text!r}: mode {mode!r} must be one of {', '.join(MODES)}")
        specs.append(FaultSpec(site, sub, ranks, mode))
    return tuple(specs)


_specs: tuple[FaultSpec, ...] | None = None
_rank: int | None = None
fired: list[tuple[str, str]] = []      # (site, first tensor name) of every fault raised here


def set_spec(text: str | None) -> None:
    """Replace the active specs (None: disable). Call on every rank with nothing in flight."""
    global _specs
    _specs = None if text is None else parse(text)


def enabled() -> bool:
    """Whether fault injection is on (then the engine also agrees on every bucket's status)."""
    return _specs is not None


def agreement_timeout() -> float:
    """Seconds a failing rank waits for its peers to agree before it aborts the job."""
    try:
        return max(0.1, float(os.environ.get(TIMEOUT_ENV, "60")))
    except ValueError:
        return 60.0


def _world_rank() -> int:
    global _rank
    if _rank is None:
        from ..backends.mpi import world_rank_size

        _rank = world_rank_size()[0]
    return _rank


def check(site: str, names: Iterable[str], mode: str = "end") -> None:
    """Raise :class:`InjectedFault` when an active spec matches this site, bucket and rank."""
    if _specs is None:
        return
    names = tuple(names)
    rank = _world_rank()
    for spec in _specs:
        if spec.matches(site, names, rank, mode):
            fired.append((site, names[0] if names else ""))
            raise InjectedFault(f"injected {site} fault ({mode}) on rank {rank} for bucket "
                                f"starting with '{names[0] if names else ''}'")


class FaultyCompressor:
    """Wraps a compressor: ``early`` faults fire before it communicates; ``end`` faults are
    recorded when it returns and raised by :func:`raise_deferred` once the algorithm around it
    has finished its communication (a hierarchical algorithm still talks after the
    compressor)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.deferred: InjectedFault | None = None

    def __getattr__(self, item: str) -> Any:
        return getattr(self.inner, item)

    def allreduce(self, comm: Any, buf: Any, ctx: Any) -> None:
        check("compressor", ctx.names, "early")
        self.inner.allreduce(comm, buf, ctx)
        if self.deferred is None:
            try:
                check("compressor", ctx.names, "end")
            except InjectedFault as exc:
                self.deferred = exc

    def raise_deferred(self) -> None:
        exc, self.deferred = self.deferred, None
        if exc is not None:
            raise exc


def wrap_compressor(comp: Any) -> Any:
    """``comp`` wrapped for fault injection when enabled (and not None), else ``comp``."""
    if _specs is None or comp is None:
        return comp
    return FaultyCompressor(comp)


# read the environment once, at import (tests set it before starting the ranks)
if os.environ.get(ENV) is not None:
    set_spec(os.environ[ENV])
