"""Keep numba's parallel kernels from changing the caller's OpenMP thread count.

numba's ``omp`` threading layer (the default where libgomp is present, as with torch's CPU
wheels) sets the calling thread's OpenMP thread count to numba's when a parallel kernel
launches. torch reads the same setting, so a training script that had called
``torch.set_num_threads(1)`` found torch running 2 threads after its first compressed
allreduce, and its reductions stopped being reproducible. Every public kernel entry point
restores torch's thread count after the launch (one cheap check when torch is not loaded).
"""
from __future__ import annotations

import functools
import sys
from typing import Any, Callable, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def keeps_torch_threads(fn: F) -> F:
    """Run ``fn``; afterwards restore torch's thread count if the kernel changed it."""

    @functools.wraps(fn)
    def inner(*args: Any, **kwargs: Any) -> Any:
        torch = sys.modules.get("torch")
        if torch is None:
            return fn(*args, **kwargs)
        before = torch.get_num_threads()
        try:
            return fn(*args, **kwargs)
        finally:
            if torch.get_num_threads() != before:
                torch.set_num_threads(before)

    return inner  # type: ignore[return-value]
