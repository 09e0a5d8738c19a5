"""How the loop draws batches: each rank's shard of the train set in DistributedSampler's order (with its padding),
from any batch of an epoch on (exact mid-epoch resume), held in memory or through a DataLoader; and each rank's
share of an exact evaluation."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DistributedSampler

from ddpexp.parts.inmemory import batchable

log = logging.getLogger("ddpexp")


class TrainLoader:
    """The train loop's view of its data: `set_epoch(epoch, start_batch)`, `len()` (batches in a full epoch, or
    None when the dataset cannot tell), iteration over (x, y) CPU batches from `start_batch` on.

    Map-style datasets are sharded with DistributedSampler's order and padding; starting at batch k yields exactly
    the batches an uninterrupted epoch would yield from k on (exact mid-epoch resume). An IterableDataset shards
    itself (it may give ranks different counts: the loop agrees when to stop) and is skipped by consuming batches.
    Every other data path (e.g. an in-memory one) implements the same three members.
    """

    def __init__(self, dataset: Any, batch_size: int, rank: int, world_size: int, seed: int, **loader_kwargs: Any):
        from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

        self.batch_size, self.start_batch = batch_size, 0
        self.sampler = None
        if not isinstance(dataset, IterableDataset):
            self.sampler = DistributedSampler(dataset, world_size, rank, shuffle=True, seed=seed)
            self._indices = _SkippableIndices(self.sampler)
        sampler = self._indices if self.sampler is not None else None
        self.loader = DataLoader(dataset, batch_size, sampler=sampler, **loader_kwargs)

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.start_batch = start_batch
        if self.sampler is not None:
            self.sampler.set_epoch(epoch)
            self._indices.start = start_batch * self.batch_size

    def __len__(self) -> int:
        if self.sampler is None:
            raise TypeError("an IterableDataset has no length")
        return -(-len(self.sampler) // self.batch_size)

    def __iter__(self) -> Iterator[Any]:
        if self.sampler is not None:
            return iter(self.loader)
        return itertools.islice(iter(self.loader), self.start_batch, None)


class _SkippableIndices:
    """The sampler's indices for this epoch from position `start` on (so the DataLoader never loads skipped ones)."""

    def __init__(self, sampler: Any):
        self.sampler, self.start = sampler, 0

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(iter(self.sampler), self.start, None)

    def __len__(self) -> int:
        return len(self.sampler) - self.start


def train_loader(splits: Any, cfg: Any, rank: int, world_size: int, device: Any) -> Any:
    """The loader for `cfg` (batch_size, seed, num_workers): the in-memory path when the train set is one tensor
    (data=digits, or a torchvision set held in RAM), else a DataLoader. Both have the TrainLoader interface."""
    tensors = batchable(splits.train)
    if tensors is not None:
        return InMemoryLoader(tensors, cfg.batch_size, rank, world_size, cfg.seed, device)
    return TrainLoader(
        splits.train, cfg.batch_size, rank, world_size, cfg.seed,
        num_workers=cfg.num_workers, pin_memory=device.type == "cuda", persistent_workers=cfg.num_workers > 0,
    )  # fmt: skip


class InMemoryLoader:
    """The TrainLoader interface (set_epoch, len, iter) over a batchable dataset held on `device`.

    Index order and padding are DistributedSampler's (the same epochs as the DataLoader path, sample for sample);
    starting at batch k just slices from k * batch_size."""

    def __init__(self, dataset: Any, batch_size: int, rank: int, world_size: int, seed: int, device: torch.device):
        self.data = dataset.to(device)
        self.device, self.batch_size, self.start_batch = device, batch_size, 0
        self.sampler = DistributedSampler(self.data, world_size, rank, shuffle=True, seed=seed)  # type: ignore[arg-type]

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.sampler.set_epoch(epoch)
        self.start_batch = start_batch

    def __len__(self) -> int:
        return -(-len(self.sampler) // self.batch_size)

    def __iter__(self) -> Iterator[Any]:
        order = torch.tensor(list(self.sampler), device=self.device)
        for start in range(self.start_batch * self.batch_size, len(order), self.batch_size):
            yield self.data.batch(order[start : start + self.batch_size], train=True)


def eval_batches(dataset: Any, rank: int, world_size: int, batch_size: int, device: torch.device) -> Iterator[Any]:
    """Rank r's share of an exact evaluation, samples r, r + N, ...: by slicing when the set is batchable."""
    from torch.utils.data import DataLoader, Subset

    data = batchable(dataset)
    if data is None:
        yield from DataLoader(Subset(dataset, range(rank, len(dataset), world_size)), batch_size)
        return
    data = data.to(device)
    mine = torch.arange(rank, len(data), world_size, device=device)
    for start in range(0, len(mine), batch_size):
        yield data.batch(mine[start : start + batch_size])


def warn_about_sizes(n: int | None, world_size: int, batch_size: int) -> None:
    """Sizes that train, but not as the user likely meant: DistributedSampler pads every rank's shard to the same
    length with repeated samples, and a batch larger than a shard is one short step per epoch."""
    if n is None or n == 0:
        return
    shard = -(-n // world_size)
    padding = shard * world_size - n
    if padding * 10 > shard * world_size:
        log.warning(
            "warning: %d train samples on %d ranks: DistributedSampler pads the shards with %d repeated samples, "
            "%d%% of every epoch", n, world_size, padding, round(100 * padding / (shard * world_size)),
        )  # fmt: skip
    if batch_size > shard:
        log.warning(
            "warning: batch_size=%d is more than each rank's %d train samples: one step per epoch, of %d samples a rank",
            batch_size, shard, shard,
        )  # fmt: skip
