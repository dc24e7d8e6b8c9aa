"""``broadcast_object`` and ``allgather_object``: Python objects between ranks (Horovod's names
and arguments).

Objects travel pickled (cloudpickle when installed, so lambdas work) in uint8 tensors: one
collective for the sizes, one for the bytes.
"""
from __future__ import annotations

import io
import pickle
from typing import Any

import numpy as np
import torch

from ..common import api as _api
from ..common.api import global_process_set
from . import collectives as _ops

try:
    import cloudpickle as _pickler
except ImportError:  # pragma: no cover - cloudpickle ships with most torch installs
    _pickler = pickle


def _dumps(obj: Any) -> torch.Tensor:
    buf = io.BytesIO()
    _pickler.dump(obj, buf)
    return torch.from_numpy(np.frombuffer(buf.getvalue(), dtype=np.uint8).copy())


def _loads(data: torch.Tensor) -> Any:
    return _pickler.loads(data.numpy().tobytes())


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: Any = global_process_set) -> Any:
    """Return ``root_rank``'s ``obj`` on every rank of ``process_set`` (pickled).

    ``root_rank`` is a global rank, also within a process set (as in Horovod). The default
    name does not depend on ``obj``'s type (Horovod's does), so non-root ranks may pass
    ``None``.
    """
    name = "broadcast_object" if name is None else name
    _api.root_index(root_rank, process_set, "broadcast_object")
    is_root = _api.rank() == root_rank
    payload = _dumps(obj) if is_root else None
    size = torch.tensor([payload.numel() if is_root else 0], dtype=torch.int64)
    _ops.broadcast_(size, root_rank, f"{name}.sz", process_set)
    data = payload if is_root else torch.empty(int(size.item()), dtype=torch.uint8)
    _ops.broadcast_(data, root_rank, f"{name}.t", process_set)
    return obj if is_root else _loads(data)


def allgather_object(obj: Any, name: str | None = None,
                     process_set: Any = global_process_set) -> list[Any]:
    """Every rank's ``obj``, as a list in rank order (pickled; types may differ by rank)."""
    name = "allgather_object" if name is None else name
    payload = _dumps(obj)
    h_sizes = _ops.allgather_async(torch.tensor([payload.numel()], dtype=torch.int64),
                                   f"{name}.sz", process_set)
    h_data = _ops.allgather_async(payload, f"{name}.t", process_set)
    sizes = _ops.synchronize(h_sizes).tolist()
    data = _ops.synchronize(h_data)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
    return [_loads(data[offsets[i]:offsets[i + 1]]) for i in range(len(sizes))]
