"""The least-squares problem of the NumPy elastic workers (train_numpy.py, hosts_numpy.py) and
the tests' single-process replay of it: rank r of n takes sample (step * n + r) % N at each
step and the ranks average their gradients. No lightcc here."""
from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np

N, DIM, LR = 16, 4, 0.1


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(5)
    return rng.standard_normal((N, DIM)), rng.standard_normal(N)


def gradient(x: np.ndarray, y: np.ndarray, w: np.ndarray, step: int, size: int,
             rank: int) -> np.ndarray:
    """Rank ``rank``'s gradient at ``step`` in a group of ``size`` ranks."""
    i = (step * size + rank) % N
    return x[i] * (x[i] @ w - y[i])


def replay(steps: int, size_at: Callable[[int], int]) -> np.ndarray:
    """The weights after ``steps`` steps, ``size_at(step)`` ranks at each."""
    x, y = data()
    w = np.zeros(DIM)
    for step in range(steps):
        size = size_at(step)
        w = w - LR * np.mean([gradient(x, y, w, step, size, r) for r in range(size)], axis=0)
    return w


def weights_line(w: np.ndarray, size: int) -> str:
    """What rank 0 of the final group prints."""
    return "W " + " ".join(f"{v:.12e}" for v in w) + f" size {size}"


def parse_weights(out: str, size: int) -> np.ndarray | None:
    """The weights a job printed with :func:`weights_line` for a group of ``size``."""
    line = re.search(rf"W ([-0-9.e+ ]+) size {size}", out)
    return None if line is None else np.array([float(v) for v in line.group(1).split()])
