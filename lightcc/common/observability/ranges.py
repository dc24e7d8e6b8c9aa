"""lightcc's engine phases as ranges of the framework's profiler (``torch.profiler``).

The core does not import torch: the torch layer installs two functions with :func:`install`
(open a named range, close it) and a probe that says whether a profiler is recording. Each
phase site calls :func:`enter` / :func:`leave`; with nothing installed, or no profiler
running, that costs one call and one check (about 0.2 µs), a few times per bucket.

Sites: ``lightcc::bucket`` (execution/run.py), ``pack``/``wire``/``compress+wire``/``unpack``
(execution/host.py), ``negotiate`` (engine.py: a waiting thread blocked for the agreement).
Bucket ranges are mostly opened on the engine's background thread, so a profiler started on
the training thread records them only when it profiles every thread (torch:
``experimental_config=torch._C._profiler._ExperimentalConfig(profile_all_threads=True)``;
docs/timeline.md, "lightcc inside torch.profiler").
"""
from __future__ import annotations

from typing import Any, Callable

_open: Callable[[str], Any] | None = None
_close: Callable[[Any], None] | None = None
_recording: Callable[[], bool] = lambda: False


def install(open_range: Callable[[str], Any], close_range: Callable[[Any], None],
            recording: Callable[[], bool]) -> None:
    """Route :func:`enter`/:func:`leave` to a profiler (called by ``lightcc.torch``)."""
    global _open, _close, _recording
    _open, _close, _recording = open_range, close_range, recording


def enter(name: str) -> Any:
    """Open the range ``name`` (``lightcc::pack``, ...); returns a token for :func:`leave`, or
    None when no profiler records."""
    if _open is None or not _recording():
        return None
    return _open(name)


def leave(token: Any) -> None:
    """Close what :func:`enter` opened (nothing for None)."""
    if token is not None and _close is not None:
        _close(token)
