"""Keeping torch.compile out of the backend's own Python code.

torch calls the lightcc process group, its Works and its futures from C++ (DDP's reducer, the
``_c10d_functional`` ops) and from Python, sometimes while a ``torch.compile``'d function is
running: in the parts that run eagerly around graph breaks, e.g. DDP's ``_pre_forward``,
whose reducer broadcasts the rebuilt bucket layout. Dynamo then tries to compile each such
Python frame like user code. It sees ``self`` as a ``ProcessGroup``, an opaque object whose
only visible members are ``rank``, ``size``, ``group_name`` and a few others, and fails at
the first private attribute ("Attempted to access unregistered member on an OpaqueObject").
gloo and NCCL are C++, so they have no frame to trace.

The backend is runtime code, not model code: every method torch can reach runs with Dynamo
disabled for itself and for everything it calls. torch's own lazy wrapper is used where it
exists (it imports Dynamo at the first call, which DDP and FSDP have done already), so
``import lightcc.torch`` stays as fast as it was; each call costs about 0.5 us more.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, TypeVar

import torch

T = TypeVar("T")


def _disable(fn: Callable[..., Any]) -> Callable[..., Any]:
    # torch._disable_dynamo: torch's lazy form of torch.compiler.disable, in a module that
    # Dynamo never traces (so its wrapper frame is safe too)
    lazy = getattr(torch, "_disable_dynamo", None)
    return lazy(fn) if lazy is not None else torch.compiler.disable(fn)


#: Private names that torch calls on a process group or a Work.
TORCH_CALLS = frozenset({"_allgather_base", "_reduce_scatter_base", "_start_coalescing",
                         "_end_coalescing", "_set_group_name", "_set_group_desc",
                         "_source_rank"})


def untraced(cls: T) -> T:
    """Class decorator: run the public methods and properties defined in ``cls`` (not
    inherited), and the private ones torch calls (:data:`TORCH_CALLS`), outside Dynamo."""
    for name, value in list(vars(cls).items()):
        if name.startswith("_") and name not in TORCH_CALLS:
            continue
        if isinstance(value, property):
            setattr(cls, name, property(*(None if f is None else _disable(f)
                                          for f in (value.fget, value.fset, value.fdel)),
                                        value.__doc__))
        elif inspect.isfunction(value):
            setattr(cls, name, _disable(value))
    return cls
