"""``ElasticSampler``: a ``DistributedSampler`` that remembers how far the epoch got and, after
the group changed, splits what is left among the new ranks (Horovod's documented semantics)."""
from __future__ import annotations

import math
import random
from typing import Any, Iterator

import torch.utils.data

from ...common import api as _api


class ElasticSampler(torch.utils.data.Sampler):
    """Partitions ``dataset``'s indices among the ranks, and re-partitions the unprocessed ones
    after a reset.

    The epoch's order is one permutation of all indices (``random.Random(seed + epoch)`` when
    ``shuffle``); each ``record_batch(batch_idx, batch_size)`` marks ``batch_size`` samples per
    rank of that order as processed. Rank ``r`` of ``n`` takes every ``n``-th index of the
    unprocessed rest from position ``r``, the rest first padded with its own beginning to a
    multiple of ``n``. Keep it in the ``TorchState`` (it is committed and synced with it), call
    ``record_batch`` after each batch and ``set_epoch(epoch + 1)`` at the end of each epoch.
    """

    def __init__(self, dataset: Any, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_num = 0
        self.num_replicas = 1
        self.rank = 0
        self.remaining_indices: list[int] = []
        self.num_samples = 0
        self.total_size = 0
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch``: a new order, nothing processed. Call it at the end of an
        epoch (with the next number), so that a partial epoch is never processed twice."""
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Mark one batch (``batch_size`` samples on every rank) as processed."""
        self.processed_num += batch_size * self.num_replicas

    def record_indices(self, indices: Any) -> None:
        """Mark ``len(indices)`` samples on every rank as processed."""
        self.processed_num += len(indices) * self.num_replicas

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state_dict: dict) -> None:
        self.epoch = int(state_dict["epoch"])
        self.processed_num = int(state_dict["processed_num"])
        self.reset()

    def reset(self) -> None:
        """Take the current group's rank and size and split what the epoch has left."""
        self.num_replicas = _api.size() if _api.is_initialized() else 1
        self.rank = _api.rank() if _api.is_initialized() else 0
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        self.remaining_indices = order[self.processed_num:]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self) -> Iterator[int]:
        indices = list(self.remaining_indices)
        indices += indices[:self.total_size - len(indices)]
        return iter(indices[self.rank:self.total_size:self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples
