"""Shared helpers for the lightcc.torch workers: seeded per-rank inputs, checks, a runner that
aborts the whole job on the first failure (so a failing rank never leaves others hanging)."""
from __future__ import annotations

import os
import sys
import time
import traceback
from typing import Any, Callable

import numpy as np
import torch


def rank_input(rank: int, shape: tuple[int, ...], dtype: torch.dtype, tag: int = 0) -> torch.Tensor:
    """Deterministic input of ``rank`` (any rank can rebuild any other rank's)."""
    g = torch.Generator().manual_seed(10_000 * tag + rank)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 4).round().to(dtype) / 4
    lo = 0 if dtype == torch.uint8 else -50
    return torch.randint(lo, 50, shape, generator=g).to(dtype)


def close(a: torch.Tensor, b: torch.Tensor, what: str, atol: float = 1e-5,
          rtol: float = 1e-5) -> None:
    if a.shape != b.shape:
        raise AssertionError(f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}")
    if a.dtype != b.dtype:
        raise AssertionError(f"{what}: dtype {a.dtype} != {b.dtype}")
    x, y = a.detach().to(torch.float64), b.detach().to(torch.float64)
    if not torch.allclose(x, y, atol=atol, rtol=rtol):
        diff = (x - y).abs().max().item() if x.numel() else 0.0
        raise AssertionError(f"{what}: max abs difference {diff}\n got {a}\n want {b}")


def check(cond: Any, what: str) -> None:
    if not cond:
        raise AssertionError(what)


def raises(exc: type | tuple, fn: Callable[[], Any], what: str,
           match: str | None = None) -> BaseException:
    try:
        fn()
    except exc as e:  # noqa: PERF203
        if match is not None and match not in str(e):
            raise AssertionError(f"{what}: message {str(e)!r} lacks {match!r}") from e
        return e
    raise AssertionError(f"{what}: expected {exc}, nothing raised")


def signal_ranks(name: str) -> None:
    """Tell the other ranks that this rank got past a point (a file in ``LCC_TEST_TMP``)."""
    path = os.path.join(os.environ["LCC_TEST_TMP"], name)
    with open(path + ".tmp", "w"):
        pass
    os.replace(path + ".tmp", path)


def wait_for_signal(name: str) -> None:
    """Block until some rank called :func:`signal_ranks` with ``name``. No deadline: a signal
    that never comes is a hang, which the job's timeout turns into a failure."""
    path = os.path.join(os.environ["LCC_TEST_TMP"], name)
    while not os.path.exists(path):
        time.sleep(0.01)


def run(cases: list[Callable[[], None]]) -> None:
    """Run each case in order; on failure print it and abort every rank."""
    from mpi4py import MPI

    rank = MPI.COMM_WORLD.Get_rank()
    for case in cases:
        try:
            case()
        except BaseException:
            sys.stdout.write(f"[rank {rank}] FAILED in {case.__name__}:\n"
                             f"{traceback.format_exc()}\n")
            sys.stdout.flush()
            MPI.COMM_WORLD.Abort(1)
    print(f"[rank {rank}] OK {len(cases)} cases", flush=True)


__all__ = ["check", "close", "np", "raises", "rank_input", "run", "signal_ranks",
           "wait_for_signal"]
