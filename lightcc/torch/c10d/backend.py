"""Creating lightcc process groups: the backend creator, ``new_group`` and the MPI rendezvous.

* The world group (``init_process_group("lightcc")``) runs on lightcc's global process set;
  lightcc is initialized here when the script has not done it (rank and size come from MPI
  and must agree with torch's).
* ``dist.new_group(ranks)`` with a lightcc default group is delegated by torch 2.13 to
  :meth:`new_group` on *every* rank, which is what ``add_process_set`` (collective over all
  ranks) needs. With another default backend torch calls the creator on members only, which
  works for groups of all ranks and raises a clear error for strict subsets.
* Under ``mpirun`` without torchrun's variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
  ``MASTER_PORT``), the ``env://`` rendezvous falls back to one built over MPI: rank 0 starts a
  ``TCPStore`` on a free port and broadcasts its address, so ``init_process_group("lightcc")``
  needs no other argument (and neither does ``"gloo"``).
"""
from __future__ import annotations

import logging
import os
import socket
import sys
from datetime import timedelta
from typing import Any, Iterator

import torch
import torch.distributed as dist

from ...common import api
from ...common.backends import mpi as mpi_backend
from ...common.exceptions import InvalidArgumentError, LightCCError
from ...common.mca import RANK_VARS
from .group import BACKEND_NAME, ProcessGroupLightCC
from .p2p import make_comm

log = logging.getLogger("lightcc")
DEFAULT_TIMEOUT_S = 1800.0
_MPI_ENV = RANK_VARS              # present in processes mpirun started
_TORCH_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_state = {"initialized_lightcc": False, "registered": False}


def _timeout_s(timeout: Any) -> float:
    if isinstance(timeout, timedelta) and timeout.total_seconds() > 0:
        return timeout.total_seconds()
    return DEFAULT_TIMEOUT_S


def _ensure_lightcc(torch_rank: int, torch_size: int, store: Any = None) -> None:
    """Start lightcc if needed (through torch's rendezvous ``store`` when the job was not
    launched by MPI) and check that lightcc and torch agree on rank and size."""
    if not api.is_initialized():
        api.init(store=store, rank=torch_rank, world_size=torch_size)
        _state["initialized_lightcc"] = True
    if (api.rank(), api.size()) != (torch_rank, torch_size):
        raise LightCCError(f"torch says rank {torch_rank} of {torch_size}, but lightcc runs as "
                           f"rank {api.rank()} of {api.size()} (lightcc.init() was called on "
                           f"another world, or MPI launched a different job): keep "
                           f"RANK/WORLD_SIZE consistent with the launch")


def _p2p_comm(world_ranks: list[int] | None, member: bool = True) -> Any:
    """The group's point-to-point communicator: on the MPI-free transport a split of lightcc's
    TCP links (collective over all ranks), else an MPI one (collective over the members)."""
    if api.transport() == "tcp":
        return api.p2p_communicator(world_ranks, member)
    return make_comm(world_ranks) if member else None


def create(opts: Any, pg_options: Any = None) -> ProcessGroupLightCC:
    """The creator torch calls (extended API) for ``init_process_group`` / ``new_group``."""
    members = list(opts.global_ranks_in_group or [])
    timeout = _timeout_s(opts.timeout)
    if not members:            # the world group
        _ensure_lightcc(opts.group_rank, opts.group_size, getattr(opts, "store", None))
        pg = ProcessGroupLightCC(opts.group_rank, opts.group_size, api.global_process_set,
                                 timeout, _p2p_comm(None), list(range(opts.group_size)))
        return pg
    world = dist.get_world_size()
    if sorted(members) != list(range(world)):
        raise LightCCError(
            f"new_group(ranks={members}, backend='lightcc') with a non-lightcc default group: "
            f"torch calls the backend on the group's members only, but a lightcc process set "
            f"is created by all ranks together. Use init_process_group('lightcc') (then every "
            f"new_group works), or a group of all {world} ranks")
    _ensure_lightcc(dist.get_rank(), world, getattr(opts, "store", None))
    ps = api.add_process_set(api.ProcessSet(members))
    return ProcessGroupLightCC(opts.group_rank, opts.group_size, ps, timeout,
                               _p2p_comm(None), members, owns_set=True)


def new_group(self: ProcessGroupLightCC, ranks: list[int], timeout: Any = None,
              pg_options: Any = None, group_name: str | None = None,
              group_desc: str | None = None, backend: Any = None) -> ProcessGroupLightCC | None:
    """``dist.new_group`` on a lightcc default group (torch calls it on every rank). torch 2.14
    passes ``backend``; 2.13 does not, and it is read from torch's calling frame."""
    caller = sys._getframe(1).f_locals
    if caller.get("use_local_synchronization"):
        raise InvalidArgumentError("new_group(use_local_synchronization=True) is not supported "
                                   "by the lightcc backend: its process sets are created by "
                                   "all ranks together")
    if backend is None:
        backend = caller.get("backend")
    if backend is not None and str(backend).lower() != BACKEND_NAME:
        side = _side_group(str(backend).lower(), ranks, caller, group_desc)
        if side is not _NO_SIDE_GROUP:
            return side
        raise InvalidArgumentError(
            f"new_group(backend={str(backend)!r}) with a lightcc default group: torch "
            f"hands every new_group to the default group's backend. Initialize the default "
            f"group with {str(backend)!r} and create lightcc groups with "
            f"new_group(backend='lightcc') instead")
    ranks = sorted(int(r) for r in ranks)
    ps = api.add_process_set(api.ProcessSet(ranks))
    member = api.rank() in ranks
    comm = _p2p_comm(ranks, member)
    if not member:
        return None
    pg = ProcessGroupLightCC(ranks.index(api.rank()), len(ranks), ps,
                             _timeout_s(timeout) if timeout else self._timeout, comm, ranks,
                             owns_set=True)
    if group_name:
        pg.setGroupName(group_name)
    if group_desc:
        pg.setGroupDesc(group_desc)
    return pg


_NO_SIDE_GROUP = object()


def _side_group(backend: str, ranks: list[int], caller: dict, group_desc: str | None) -> Any:
    """``new_group(backend="gloo")`` beside a lightcc default group (torchtitan's checkpointer,
    vLLM): the group torch itself would build for that backend, through the default store, on
    every rank (None on non-members); ``_NO_SIDE_GROUP`` when this torch does not let us."""
    helper = getattr(dist.distributed_c10d, "_new_process_group_helper", None)
    store, name = caller.get("default_store"), caller.get("group_name")
    if helper is None or store is None or name is None:
        return _NO_SIDE_GROUP
    ranks = sorted(int(r) for r in (caller.get("ranks") or ranks))
    me = dist.get_rank()
    pg, _ = helper(len(ranks), ranks.index(me) if me in ranks else None, ranks, backend, store,
                   name, timeout=caller.get("timeout"), group_desc=group_desc)
    if me not in ranks:
        return None
    # the helper registered the group's name; torch registers what new_group returns again
    dist.distributed_c10d._unregister_process_group(name)
    return pg


ProcessGroupLightCC.new_group = new_group
#: the devices whose tensors the group takes (CUDA ones are staged through host memory). torch
#: uses a Python ProcessGroup as it is, without registering it per device, so its own
#: ``_device_types`` would be empty, and ``dcp.async_save`` would refuse the group ("A CPU
#: backend must be enabled for async save").
ProcessGroupLightCC._device_types = property(
    lambda self: [torch.device("cpu"), torch.device("cuda")])


# ---- rendezvous over MPI --------------------------------------------------------------------
def _under_mpi() -> bool:
    return any(name in os.environ for name in _MPI_ENV)


def _mpi_rendezvous(timeout: timedelta) -> tuple[Any, int, int]:
    """(store, rank, world size) without torchrun's variables: a TCPStore on rank 0, its
    address broadcast over MPI."""
    rank, size = mpi_backend.world_rank_size()
    store = None
    address = None
    if rank == 0:
        host = os.environ.get("MASTER_ADDR") or socket.gethostname()
        try:
            store = dist.TCPStore(host, int(os.environ.get("MASTER_PORT", 0)), size, True,
                                  timeout=timeout, wait_for_workers=False)
            address = (host, store.port)
        except Exception as exc:  # noqa: BLE001 - tell the other ranks, then raise
            address = ("", str(exc))
    address = mpi_backend.world_bcast(address, root=0)
    if not address[0]:
        raise LightCCError(f"rank 0 could not start the rendezvous store: {address[1]}")
    if store is None:
        store = dist.TCPStore(address[0], address[1], size, False, timeout=timeout)
    return store, rank, size


def _wrap_env_handler(original: Any) -> Any:
    def env_or_mpi(url: str, timeout: timedelta = timedelta(minutes=30),
                   **kwargs: Any) -> Iterator[tuple[Any, int, int]]:
        if all(name in os.environ for name in _TORCH_ENV) or not _under_mpi() \
                or "rank=" in url or "world_size=" in url:
            yield from original(url, timeout=timeout, **kwargs)
            return
        log.debug("env:// rendezvous without %s: using MPI", ", ".join(_TORCH_ENV))
        yield _mpi_rendezvous(timeout)
        raise RuntimeError("Unable to perform re-rendezvous using lightcc's MPI rendezvous")

    env_or_mpi._lightcc_original = original     # type: ignore[attr-defined]
    return env_or_mpi


def register() -> None:
    """Register the backend and the MPI rendezvous fallback (idempotent)."""
    if _state["registered"]:
        return
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, create, extended_api=True,
                                      devices=["cpu", "cuda"])
    import importlib

    handlers = importlib.import_module("torch.distributed.rendezvous")._rendezvous_handlers
    if "env" in handlers and not hasattr(handlers["env"], "_lightcc_original"):
        handlers["env"] = _wrap_env_handler(handlers["env"])
    _state["registered"] = True
