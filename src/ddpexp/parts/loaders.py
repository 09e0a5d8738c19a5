"""How the loop draws batches: one global order per epoch, whatever the world size (GlobalOrder), each rank's slice
of each global micro-batch, from any sample of an epoch on (exact mid-epoch resume, at any world size), held in
memory or through a DataLoader; and each rank's share of an exact evaluation."""

from __future__ import annotations

import inspect
import itertools
import logging
from collections.abc import Iterator
from typing import Any

import torch

from ddpexp.parts.inmemory import batchable, splitmix

log = logging.getLogger("ddpexp")


class GlobalOrder:
    """One epoch's order of the whole train set, fixed by the seed and the epoch alone (DistributedSampler's
    permutation, without its padding), cut into global micro-batches of batch_size x world_size samples from any
    sample on; rank r takes the samples r, r + W, ... of each (the slices differ by at most one sample). For an
    evenly divisible set this is DistributedSampler's order exactly; at any world size, no sample is repeated or
    dropped (drop_last: the last, short global micro-batch is). A resume at another world size or batch size
    continues the same order from the count of samples consumed."""

    def __init__(self, n: int, batch_size: int, rank: int, world_size: int, seed: int, drop_last: bool = False):
        self.n, self.batch_size, self.rank, self.world_size, self.seed = n, batch_size, rank, world_size, seed
        self.block = batch_size * world_size
        self.end = n - n % self.block if drop_last else n  # the samples an epoch trains on
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch, self.start = epoch, start

    def __len__(self) -> int:
        """Micro-batches in a whole epoch."""
        return -(-self.end // self.block)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, int, int]]:
        return self.blocks()

    def blocks(self, device: torch.device | None = None) -> Iterator[tuple[torch.Tensor, int, int]]:
        """(the indices this rank loads, how many of them it trains on, the micro-batch's size over all ranks),
        the indices on `device` (the epoch's order is moved there once). A rank whose slice is empty (a last
        micro-batch of fewer samples than ranks) loads rank 0's and trains on none of them, so that it still takes
        part in every collective."""
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.n, generator=g)
        order = order.to(device) if device is not None else order
        for start in range(self.start, self.end, self.block):
            block = order[start : min(start + self.block, self.end)]
            mine = block[self.rank :: self.world_size]
            yield (mine, len(mine), len(block)) if len(mine) else (block[:: self.world_size], 0, len(block))

    def key(self, index: torch.Tensor) -> torch.Tensor:
        """Each sample's random key for this epoch: (seed, epoch, sample index), whichever rank loads it."""
        return sample_keys(self.seed, self.epoch, index)


def sample_keys(seed: int, epoch: int, index: torch.Tensor) -> torch.Tensor:
    """A 63-bit key per sample (splitmix64 of seed, epoch and index): the same for a sample at any world size."""
    return splitmix(index.to(torch.int64) * 0x9E3779B9 + (seed * 1_000_003 + epoch) * 0x2545F491) & ((1 << 63) - 1)


class TrainLoader:
    """The train loop's view of its data: `set_epoch(epoch, start_batch, start_sample)`, `len()` (micro-batches in
    a whole epoch, or None when the dataset cannot tell), iteration over (batch, samples trained, samples over all
    ranks) from that point on (CPU batches here).

    A map-style dataset follows the GlobalOrder through a DataLoader (its workers load only what is trained);
    each sample is loaded with torch's RNG seeded by its key, so a random transform gives a sample the same
    augmentation at any world size and in any worker. An IterableDataset shards itself (it may give ranks
    different counts: the loop agrees when to stop), is skipped by consuming batches, and yields (batch, None,
    None): its samples are counted by the loop's agreement. Every other data path implements the same members.
    """

    def __init__(self, dataset: Any, batch_size: int, rank: int, world_size: int, seed: int, drop_last: bool = False,
                 **loader_kwargs: Any):  # fmt: skip
        from torch.utils.data import DataLoader, IterableDataset

        self.batch_size, self.world_size, self.start_batch = batch_size, world_size, 0
        self.order = None
        if isinstance(dataset, IterableDataset):
            self.loader = DataLoader(dataset, batch_size, **loader_kwargs)
        else:
            self.order = GlobalOrder(len(dataset), batch_size, rank, world_size, seed, drop_last)
            keyed = _Keyed(dataset, seed)
            self.loader = DataLoader(keyed, batch_sampler=_KeyedBatches(self.order), **loader_kwargs)

    def set_epoch(self, epoch: int, start_batch: int = 0, start_sample: int | None = None) -> None:
        self.start_batch = start_batch
        if self.order is not None:
            self.order.set_epoch(epoch, _start(start_batch, start_sample, self.order))

    def __len__(self) -> int:
        if self.order is None:
            raise TypeError("an IterableDataset has no length")
        return len(self.order)

    def __iter__(self) -> Iterator[Any]:
        if self.order is None:
            return ((b, None, None) for b in itertools.islice(iter(self.loader), self.start_batch, None))
        sizes = ((own, total) for _, own, total in self.order)  # the same order the batch sampler walks
        return ((b, own, total) for b, (own, total) in zip(self.loader, sizes))


def _start(start_batch: int, start_sample: int | None, order: GlobalOrder) -> int:
    """The sample to start an epoch at: a checkpoint's count, or (one from before it kept a count) its micro-batches
    at today's world size and batch size."""
    return start_sample if start_sample is not None else min(start_batch * order.block, order.end)


class _KeyedBatches:
    """The DataLoader's batch sampler: each micro-batch's (epoch, index) pairs for this rank."""

    def __init__(self, order: GlobalOrder):
        self.order = order

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        for mine, _, _ in self.order:
            yield [(self.order.epoch, i) for i in mine.tolist()]

    def __len__(self) -> int:
        return len(range(self.order.start, self.order.end, self.order.block))


class _Keyed:
    """The dataset, each sample loaded under torch's RNG seeded by its (seed, epoch, index) key (restored after)."""

    def __init__(self, dataset: Any, seed: int):
        self.dataset, self.seed = dataset, seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]) -> Any:
        epoch, index = key
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(sample_keys(self.seed, epoch, torch.tensor(index))))
            return self.dataset[index]


def train_loader(splits: Any, cfg: Any, rank: int, world_size: int, device: Any) -> Any:
    """The loader for `cfg` (batch_size, seed, num_workers, drop_last): the in-memory path when the train set is
    one tensor (data=digits, or a torchvision set held in RAM), else a DataLoader. Both have the TrainLoader
    interface."""
    tensors = batchable(splits.train)
    drop_last = bool(getattr(cfg, "drop_last", False))
    if tensors is not None:
        return InMemoryLoader(tensors, cfg.batch_size, rank, world_size, cfg.seed, device, drop_last)
    return TrainLoader(
        splits.train, cfg.batch_size, rank, world_size, cfg.seed, drop_last,
        num_workers=cfg.num_workers, pin_memory=device.type == "cuda", persistent_workers=cfg.num_workers > 0,
    )  # fmt: skip


class InMemoryLoader:
    """The TrainLoader interface (set_epoch, len, iter) over a batchable dataset held on `device`: the GlobalOrder
    (the same micro-batches as the DataLoader path, sample for sample) by index slicing. Augmentation is keyed per
    sample where the dataset's `batch` takes `keys` (ddpexp's in-memory images do)."""

    def __init__(self, dataset: Any, batch_size: int, rank: int, world_size: int, seed: int, device: torch.device,
                 drop_last: bool = False):  # fmt: skip
        self.data = dataset.to(device)
        self.device, self.batch_size = device, batch_size
        self.order = GlobalOrder(len(self.data), batch_size, rank, world_size, seed, drop_last)
        self.keyed = "keys" in inspect.signature(self.data.batch).parameters

    def set_epoch(self, epoch: int, start_batch: int = 0, start_sample: int | None = None) -> None:
        self.order.set_epoch(epoch, _start(start_batch, start_sample, self.order))

    def __len__(self) -> int:
        return len(self.order)

    def __iter__(self) -> Iterator[Any]:
        for idx, own, total in self.order.blocks(self.device):  # no host-to-device copy per batch
            if self.keyed:
                yield self.data.batch(idx, train=True, keys=self.order.key(idx)), own, total
            else:
                yield self.data.batch(idx, train=True), own, total


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
    """Sizes that train, but not as the user likely meant: a global batch larger than the train set is one short
    step per epoch (and ranks beyond the set's size train on none of its samples)."""
    if n is None or n == 0:
        return
    if batch_size * world_size > n:
        log.warning(
            "warning: batch_size=%d on %d ranks is more than the %d train samples: one step per epoch, of %d samples",
            batch_size, world_size, n, n,
        )  # fmt: skip
