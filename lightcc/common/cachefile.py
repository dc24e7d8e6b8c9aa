"""The tuning cache file: one JSON file of entries keyed by a fingerprint's SHA-256.

Shared by the autotuner (``tuning/cache.py`` builds its fingerprints) and ``compression=auto``
(``compression/autoprobe.py``), which sit on different floors of the layering, so the file
itself lives here, below both. The file (``LCC_AUTOTUNE_CACHE``, default
``$XDG_CACHE_HOME/lightcc/autotune.json`` or ``~/.cache/lightcc/autotune.json``) holds::

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
from typing import Any

log = logging.getLogger("lightcc")

FORMAT = 1


def default_cache_path() -> str:
    """``$XDG_CACHE_HOME/lightcc/autotune.json`` (``~/.cache`` when XDG_CACHE_HOME is unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "lightcc", "autotune.json")


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
