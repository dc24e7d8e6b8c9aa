"""Connect lightcc's engine phases (``lightcc::negotiate``, ``lightcc::pack``, ...) to
``torch.profiler``: record_function ranges opened only while a profiler records
(:mod:`lightcc.common.observability.ranges`)."""
from __future__ import annotations

import torch
import torch.autograd.profiler as _autograd_profiler


def _recording() -> bool:
    # a module global torch sets while any profiler records, seen from every thread
    # (torch._C._autograd._profiler_enabled() is False under the Kineto profiler)
    return bool(_autograd_profiler._is_profiler_enabled)


def install() -> None:
    from ..common.observability import ranges

    ranges.install(torch.ops.profiler._record_function_enter_new,
                   torch.ops.profiler._record_function_exit, _recording)
