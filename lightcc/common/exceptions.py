"""The error types users catch.

Every lightcc error is a :class:`LightCCError` (a ``RuntimeError``), except local misuse seen at
submit time, which also derives from ``ValueError`` or ``TypeError`` so that code written for
Horovod (which raises those) keeps working.
"""
from __future__ import annotations


class LightCCError(RuntimeError):
    """Base class of every lightcc error."""


class NotInitializedError(LightCCError, ValueError):
    """A lightcc function that needs ``init()`` was called before it (or after ``shutdown()``)."""


class ConfigError(LightCCError, ValueError):
    """An ``LCC_*`` variable, an ``init()`` keyword or an ``lccrun`` flag has an invalid value."""


class MismatchError(LightCCError):
    """Ranks submitted the same tensor name with different shapes, dtypes, ops or roots."""


class StallError(LightCCError):
    """Some ranks never submitted a tensor within ``LCC_STALL_SHUTDOWN_TIME``."""


class ShutdownError(LightCCError):
    """The operation was pending when ``shutdown()`` ran (on this or another rank)."""


class CollectiveError(LightCCError):
    """A compressor, algorithm or backend raised while executing a collective."""


class DuplicateNameError(LightCCError, ValueError):
    """A tensor name is already in flight for the same collective type on this rank."""


class InvalidArgumentError(LightCCError, ValueError):
    """A locally checkable argument is wrong (splits, root rank, scale factors, names)."""


class UnsupportedDTypeError(LightCCError, TypeError):
    """The array's dtype cannot be used with this collective or op."""


# Horovod's name for internal failures; kept so ``except HorovodInternalError`` works.
HorovodInternalError = LightCCError
