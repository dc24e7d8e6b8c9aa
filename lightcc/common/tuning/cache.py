"""Where tuned settings are remembered: fingerprints and the JSON cache file.

A fingerprint names what a tuned setting is good for: the cluster (ranks, host count, ranks
per host, an interconnect guess), the model (names, shapes and dtypes of the tensors reduced
in one training step) and the lightcc version. Its SHA-256 keys an entry of the cache file
(``LCC_AUTOTUNE_CACHE``, default ``$XDG_CACHE_HOME/lightcc/autotune.json`` or
``~/.cache/lightcc/autotune.json``), which holds one entry per fingerprint::

    {"format": 1, "entries": {"<sha256>": {"setting": {...}, "bytes_per_s": ...,
                                            "fingerprint": {...}, "steps": ..., "saved": ...}}}

Writes go to a temporary file renamed over the old one, so a crash never leaves half a file;
entries of other fingerprints are kept.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Iterable

log = logging.getLogger("lightcc")

FORMAT = 1


def default_cache_path() -> str:
    """``$XDG_CACHE_HOME/lightcc/autotune.json`` (``~/.cache`` when XDG_CACHE_HOME is unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "lightcc", "autotune.json")


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


def fingerprint_key(fp: dict[str, Any]) -> str:
    """Stable SHA-256 of the fingerprint's canonical JSON."""
    text = json.dumps(fp, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _read(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return {"format": FORMAT, "entries": {}}
    except (OSError, ValueError) as exc:
        log.warning("autotune cache %s is unreadable (%s); starting a new one", path, exc)
        return {"format": FORMAT, "entries": {}}
    if not isinstance(data, dict) or data.get("format") != FORMAT \
            or not isinstance(data.get("entries"), dict):
        log.warning("autotune cache %s has an unknown format; starting a new one", path)
        return {"format": FORMAT, "entries": {}}
    return data


def lookup(path: str, key: str) -> dict[str, Any] | None:
    """The cache entry for ``key``, or None."""
    entry = _read(path)["entries"].get(key)
    return entry if isinstance(entry, dict) and isinstance(entry.get("setting"), dict) else None


def store(path: str, key: str, fp: dict[str, Any], setting: dict[str, Any],
          bytes_per_s: float, steps: int) -> None:
    """Add or replace the entry for ``key`` (atomic rename; other entries are kept)."""
    data = _read(path)
    data["entries"][key] = {"setting": setting, "bytes_per_s": round(bytes_per_s, 1),
                            "fingerprint": fp, "steps": steps,
                            "saved": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)
