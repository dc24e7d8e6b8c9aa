"""Where tuned settings are remembered: fingerprints and the JSON cache file.

A fingerprint names what a tuned setting is good for: the cluster (ranks, host count, ranks
per host, an interconnect guess), the model (names, shapes and dtypes of the tensors reduced
in one training step) and the lightcc version. Its SHA-256 keys an entry of the cache file
(``LCC_AUTOTUNE_CACHE``, default ``$XDG_CACHE_HOME/lightcc/autotune.json`` or
``~/.cache/lightcc/autotune.json``), which holds one entry per fingerprint::

    {"format": 1, "entries": {"<sha256>": {"setting": {...}, "bytes_per_s": ...,
                                            "fingerprint": {...}, "steps": ..., "saved": ...}}}

Writes go to a temporary file renamed over the old one, so a crash never leaves half a file;
entries of other fingerprints are kept. The file itself (read, write, default path, key) is
``lightcc/common/cachefile.py``, shared with ``compression=auto``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

from ..cachefile import FORMAT, _read, default_cache_path, fingerprint_key, lookup, store

__all__ = ["FORMAT", "_read", "cluster_fingerprint", "default_cache_path", "fingerprint",
           "fingerprint_key", "interconnect_guess", "lookup", "model_fingerprint", "store"]


def interconnect_guess(num_hosts: int, sys_root: str = "/sys") -> str:
    """A coarse, deterministic label of the link between hosts.

    ``shm`` on one host; ``infiniband`` when ``/sys/class/infiniband`` lists a device; else
    ``tcp:<Mb/s>`` with the fastest speed any non-loopback interface reports (``tcp:?`` when
    none does). It cannot see traffic shaping or the switch: re-tune with
    ``LCC_AUTOTUNE=refresh`` when the network changes.
    """
    if num_hosts <= 1:
        return "shm"
    root = Path(sys_root)
    try:
        if any((root / "class" / "infiniband").iterdir()):
            return "infiniband"
    except OSError:
        pass
    best = 0
    try:
        for dev in (root / "class" / "net").iterdir():
            if dev.name == "lo":
                continue
            try:
                best = max(best, int((dev / "speed").read_text().strip()))
            except (OSError, ValueError):
                continue
    except OSError:
        pass
    return f"tcp:{best}" if best > 0 else "tcp:?"


def cluster_fingerprint(node_of_rank: Iterable[int], interconnect: str) -> dict[str, Any]:
    """Ranks, host count and ranks per host (sorted, so uneven layouts are kept apart)."""
    nodes = list(node_of_rank)
    counts = sorted((nodes.count(n) for n in set(nodes)), reverse=True)
    return {"ranks": len(nodes), "hosts": len(counts), "ranks_per_host": counts,
            "interconnect": interconnect}


def model_fingerprint(tensors: Iterable[tuple[str, tuple[int, ...], str]]) -> dict[str, Any]:
    """The tensors of one step as sorted ``[name, shape, dtype]`` triples and their count."""
    items = sorted((str(n), [int(d) for d in shape], str(dt)) for n, shape, dt in tensors)
    return {"tensors": [list(t) for t in items], "count": len(items)}


def fingerprint(cluster: dict[str, Any], model: dict[str, Any], version: str) -> dict[str, Any]:
    return {"cluster": cluster, "model": model, "lightcc": version}


