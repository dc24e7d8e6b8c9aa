"""What the engine's users may read about its state (:class:`EngineStatus`): the direct path,
the API, the torch layer's cross-barrier waits and the autotuner read it instead of the engine's
fields. The engine alone writes it (its thread, or ``shutdown()``/``join()`` through engine
methods)."""
from __future__ import annotations

from dataclasses import dataclass

from .exceptions import LightCCError, ShutdownError


@dataclass
class EngineStatus:
    """The engine's lifecycle as others see it; plain fields, read without a lock (each is
    replaced whole, never mutated in place)."""

    stopping: bool = False                  # shutdown() ran on this rank
    dead: BaseException | None = None       # the background thread failed with this error
    shut_down: str = ""                     # why lightcc stopped on every rank ("": it runs)
    joined: bool = False                    # join() ran here; its JOIN is not executed yet
    gone_ranks: frozenset[int] = frozenset()  # ranks that shut down or exited

    def stopped(self) -> bool:
        """The engine makes no more progress on this rank (failed, or shutting down)."""
        return self.dead is not None or self.stopping

    def error(self, what: str = "") -> LightCCError | None:
        """The error a call (``what``, prefixed to the message) must raise because lightcc
        stopped here or everywhere, or None while it runs."""
        if self.dead is None and not self.shut_down and not self.stopping:
            return None
        prefix = f"{what}: " if what else ""
        if self.dead is not None:
            return LightCCError(f"{prefix}lightcc's background thread stopped: {self.dead}")
        if self.shut_down:
            return ShutdownError(f"{prefix}{self.shut_down}")
        return ShutdownError(f"{prefix}lightcc is shutting down on this rank")

    def check(self) -> None:
        """Raise :meth:`error` if there is one."""
        if self.dead is not None or self.shut_down or self.stopping:
            raise self.error() from self.dead
