"""Who launched this process, and which transport lightcc runs on (``LCC_TRANSPORT``).

One rule, applied once in ``init()`` and logged there:

* ``mpi`` when MPI launched the job (mpirun, lccrun: ``OMPI_COMM_WORLD_SIZE``, ``PMIX_RANK``,
  ``PMI_SIZE``), when the script passed an MPI communicator, or when no launcher's variables
  are set (a single process: MPI as a singleton);
* ``tcp`` (the MPI-free plane: a rendezvous store and lightcc's TCP links between all ranks)
  when torchrun's variables (``RANK`` and ``WORLD_SIZE``; Ray Train, Kubeflow and Spark's
  ``TorchDistributor`` set the same) or Slurm's (``SLURM_PROCID`` and ``SLURM_NTASKS``) are
  set, or when the caller passed a rendezvous store (the c10d path);
* ``LCC_TRANSPORT=mpi|tcp`` forces one.

Nothing here imports mpi4py or torch.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Mapping

from ..exceptions import ConfigError

#: Set by mpirun / PMIx in the processes it starts (a launcher's own process has none).
MPI_VARS = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_SIZE")
TORCH_VARS = ("RANK", "WORLD_SIZE")
SLURM_VARS = ("SLURM_PROCID", "SLURM_NTASKS")
#: rendezvous port under Slurm when MASTER_PORT is unset: this plus SLURM_JOB_ID modulo 1000
SLURM_BASE_PORT = 29400


@dataclass(frozen=True)
class Launch:
    """What the launcher told this process: its rank, the job's size, its place on its host and
    where the rendezvous store listens (``source`` names the launcher for messages)."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    master_addr: str
    master_port: int
    source: str


def choose_transport(setting: str, comm_given: bool, store_given: bool,
                     env: Mapping[str, str] | None = None) -> tuple[str, str]:
    """``("mpi" | "tcp", why)`` for ``LCC_TRANSPORT=setting`` (see module docstring)."""
    env = os.environ if env is None else env
    if setting in ("mpi", "tcp"):
        return setting, f"LCC_TRANSPORT={setting}"
    if comm_given:
        return "mpi", "init() was given an MPI communicator"
    mpi_vars = [v for v in MPI_VARS if v in env]
    if mpi_vars:
        return "mpi", f"MPI launched the job ({mpi_vars[0]} is set)"
    if store_given:
        return "tcp", "init() was given a rendezvous store (torch.distributed's)"
    if all(v in env for v in TORCH_VARS):
        return "tcp", "torchrun's variables (RANK, WORLD_SIZE) are set and no MPI launcher's"
    if all(v in env for v in SLURM_VARS):
        return "tcp", "Slurm's variables (SLURM_PROCID, SLURM_NTASKS) are set, no MPI's"
    return "mpi", "no launcher's variables are set (a single process)"


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    text = env.get(name)
    if text is None:
        if default is None:
            raise ConfigError(f"{name} is not set; the MPI-free launch needs it (or launch "
                              f"with torchrun, srun, lccrun or mpirun)")
        return default
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{name}={text!r} is not an integer") from None


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list (``"gpu[07-09,12],cpu1"`` -> ``"gpu07"``)."""
    m = re.match(r"\s*([^,\[]+)(?:\[([^\]]+)\])?", nodelist)
    if not m:
        raise ConfigError(f"SLURM_JOB_NODELIST={nodelist!r}: no host name in it")
    prefix, ranges = m.group(1), m.group(2)
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def from_environment(env: Mapping[str, str] | None = None) -> Launch:
    """This process's :class:`Launch` from torchrun's variables, else Slurm's."""
    env = os.environ if env is None else env
    if all(v in env for v in TORCH_VARS):
        rank, size = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        local_rank = _int(env, "LOCAL_RANK", 0)
        local_size = _int(env, "LOCAL_WORLD_SIZE", 0)
        addr, port = env.get("MASTER_ADDR", "127.0.0.1"), _int(env, "MASTER_PORT", 29500)
        source = "torchrun's variables"
    elif all(v in env for v in SLURM_VARS):
        rank, size = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
        local_rank = _int(env, "SLURM_LOCALID", 0)
        local_size = 0
        addr = env.get("MASTER_ADDR") or first_host(env.get("SLURM_JOB_NODELIST", "") or
                                                    "127.0.0.1")
        port = _int(env, "MASTER_PORT",
                    SLURM_BASE_PORT + _int(env, "SLURM_JOB_ID", 0) % 1000)
        source = "Slurm's variables"
    else:
        raise ConfigError("LCC_TRANSPORT=tcp needs torchrun's variables (RANK, WORLD_SIZE, "
                          "MASTER_ADDR, MASTER_PORT) or Slurm's (SLURM_PROCID, SLURM_NTASKS, "
                          "SLURM_JOB_NODELIST); none are set")
    if size < 1 or not 0 <= rank < size:
        raise ConfigError(f"{source}: rank {rank} is not in 0..{size - 1} (world size {size})")
    return Launch(rank, size, local_rank, local_size, addr, port, source)
