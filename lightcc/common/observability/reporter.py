"""A rank's side of ``lccrun --status``: every few seconds, this rank's metrics to lccrun.

Started by ``init()`` when lccrun set ``LCC_RUNNER_STATUS`` (seconds between reports) along
with its registry's address and token (``LCC_RUNNER_ADDR``, ``LCC_RUNNER_TOKEN``): a daemon
thread sends one line ``status <token> <rank> <json>`` per report over a short TCP connection.
It never raises into the job: a report that cannot be sent is skipped.
"""
from __future__ import annotations

import json
import os
import threading
from typing import Any, Callable

from ..._exit import report_to_lccrun

STATUS_ENV = "LCC_RUNNER_STATUS"
ADDR_ENV, TOKEN_ENV = "LCC_RUNNER_ADDR", "LCC_RUNNER_TOKEN"
FIELDS = ("steps", "collectives", "compression_ratio")
RATES = ("steps_per_s", "exposed_share", "bytes_sent_per_s")


def summary(metrics: dict[str, Any]) -> dict[str, float]:
    """The few numbers lccrun's status line needs, from ``lightcc.metrics()``."""
    out = {k: metrics[k] for k in FIELDS if k in metrics}
    out.update({k: v for k, v in metrics.get("rates", {}).items() if k in RATES})
    return out


def send(where: str, token: str, rank: int, payload: dict, timeout: float = 2.0) -> bool:
    line = f"status {token} {rank} {json.dumps(payload, separators=(',', ':'))}\n".encode()
    return report_to_lccrun(where, line, timeout)


def start(rank: int, collect: Callable[[], dict], environ: dict | None = None) -> bool:
    """Start the reporting thread when lccrun asked for it; True if started."""
    env = os.environ if environ is None else environ
    try:
        period = float(env.get(STATUS_ENV, "0") or 0)
    except ValueError:
        period = 0.0
    where, token = env.get(ADDR_ENV, ""), env.get(TOKEN_ENV, "")
    if period <= 0 or not where or not token:
        return False
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(period):
            try:
                payload = summary(collect())
            except Exception:  # noqa: BLE001 - lightcc was shut down: stop reporting
                return
            send(where, token, rank, payload)

    threading.Thread(target=loop, name="lightcc-status", daemon=True).start()
    return True
