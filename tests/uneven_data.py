"""A user dataset that shards itself and gives ranks different batch counts (an IterableDataset, no sampler)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset, TensorDataset

from ddpexp.parts.data import Splits


class PerRankStream(IterableDataset):
    def __init__(self, counts: list[int]):
        self.counts = counts

    def __iter__(self):  # type: ignore[no-untyped-def]
        rank = dist.get_rank()
        g = torch.Generator().manual_seed(rank)
        for i in range(self.counts[rank]):
            yield torch.randn(1, 8, 8, generator=g), i % 10


def splits(counts: tuple[int, ...] = (40, 70), **_digits_keys: object) -> Splits:  # data=digits' keys, unused
    g = torch.Generator().manual_seed(99)
    val = TensorDataset(torch.randn(30, 1, 8, 8, generator=g), torch.arange(30) % 10)
    return Splits(PerRankStream(list(counts)), val, num_classes=10, in_channels=1, image_size=8)
