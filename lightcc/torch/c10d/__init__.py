"""The torch.distributed backend ``"lightcc"``: DDP, FSDP and every ``dist.*`` call on lightcc.

``import lightcc.torch`` registers it; then, under ``lccrun`` or ``mpirun``::

    import torch.distributed as dist
    dist.init_process_group("lightcc")

See docs/torch-distributed.md for what is supported and how it differs from gloo.
"""
from __future__ import annotations

from .backend import create, register
from .futures import LightCCFuture
from .group import BACKEND_NAME, GroupDestroyedError, ProcessGroupLightCC
from .work import CollectiveTimeout, LightCCWork

__all__ = ["BACKEND_NAME", "CollectiveTimeout", "GroupDestroyedError", "LightCCFuture",
           "LightCCWork", "ProcessGroupLightCC", "create", "register"]
