"""The regression problem of the elastic torch job: its constants and data, shared by the worker
(train_torch.py) and the test's single-process replay (test_elastic.py). No lightcc here."""
from __future__ import annotations

import numpy as np
import torch

N, DIM, BATCH, EPOCHS, COMMIT, LR, MOMENTUM, SEED = 60, 5, 2, 2, 3, 0.05, 0.9, 7


def data() -> tuple[torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(123)
    x = rng.standard_normal((N, DIM)).astype(np.float32)
    y = (x @ rng.standard_normal((DIM, 1)) + 0.1 * rng.standard_normal((N, 1))).astype(np.float32)
    return torch.from_numpy(x), torch.from_numpy(y)
