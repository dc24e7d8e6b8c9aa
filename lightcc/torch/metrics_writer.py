"""``lightcc.torch.metrics_writer(writer)``: lightcc's metrics as TensorBoard scalars.

The returned callback reads :func:`lightcc.metrics` and writes every numeric value with
``writer.add_scalar(tag, value, step)`` under ``lightcc/...`` (``lightcc/bytes_sent``,
``lightcc/wire/world/bytes_sent``, ``lightcc/rates/collectives_per_s``, ...). Any object with
``add_scalar`` works: ``torch.utils.tensorboard.SummaryWriter``, tensorboardX's, or a logger
of your own; create it on rank 0 only to get one event file for the job.
"""
from __future__ import annotations

from typing import Any, Callable

from ..common.api import metrics
from ..common.observability.metrics import flatten


def metrics_writer(writer: Any, prefix: str = "lightcc",
                   every: int = 1) -> Callable[[int | None], dict[str, float]]:
    """A callback ``log(step=None)`` writing the metrics as scalars every ``every`` calls
    (``step`` defaults to the number of calls so far); returns what it wrote."""
    if not callable(getattr(writer, "add_scalar", None)):
        raise TypeError(f"metrics_writer needs an object with add_scalar(tag, value, step) "
                        f"(e.g. torch.utils.tensorboard.SummaryWriter), got {type(writer)!r}")
    if every < 1:
        raise ValueError(f"every must be >= 1, got {every}")
    calls = [0]

    def log(step: int | None = None) -> dict[str, float]:
        calls[0] += 1
        if (calls[0] - 1) % every:
            return {}
        at = calls[0] - 1 if step is None else step
        scalars = flatten(metrics(), prefix)
        for tag, value in scalars.items():
            writer.add_scalar(tag, value, at)
        return scalars

    return log
