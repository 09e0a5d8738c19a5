"""Datasets behind `data=`: each factory returns Splits (train, val and the shape facts the model needs).

The parent calls `prepare()` once before any rank starts: it downloads when asked and otherwise checks that the
files are there, so a missing dataset is one clear error instead of N rank tracebacks.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ddpexp.config import ConfigError

# torchvision dataset class name -> (folder under root, files whose presence means "downloaded")
_IDX = ["train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"]
_TORCHVISION = {
    "MNIST": ("MNIST/raw", _IDX),
    "FashionMNIST": ("FashionMNIST/raw", _IDX),
    "CIFAR10": ("cifar-10-batches-py", [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]),
}
_STATS = {"MNIST": ((0.1307,), (0.3081,)), "FashionMNIST": ((0.2860,), (0.3530,)),
          "CIFAR10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))}  # fmt: skip
_SHAPES = {"MNIST": (1, 28, 10), "FashionMNIST": (1, 28, 10), "CIFAR10": (3, 32, 10)}


@dataclass
class Splits:
    """What a data factory returns. A user factory (`data._target_`) returns one of these too."""

    train: Any  # torch.utils.data.Dataset yielding (image tensor, int label)
    val: Any
    num_classes: int
    in_channels: int
    image_size: int


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


def train_loader(splits: Splits, cfg: Any, rank: int, world_size: int, device: Any) -> Any:
    """The TrainLoader for `cfg` (batch_size, seed, num_workers); every data path returns the same interface."""
    return TrainLoader(
        splits.train, cfg.batch_size, rank, world_size, cfg.seed,
        num_workers=cfg.num_workers, pin_memory=device.type == "cuda", persistent_workers=cfg.num_workers > 0,
    )  # fmt: skip


def digits(val_fraction: float = 0.2, seed: int = 0) -> Splits:
    """scikit-learn's real 8x8 handwritten digits (1797 images): the offline default."""
    import torch
    from sklearn.datasets import load_digits

    d = load_digits()
    x = (torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0 - 0.5) / 0.5
    y = torch.tensor(d.target, dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_val = round(len(y) * val_fraction)
    val, train = perm[:n_val], perm[n_val:]
    tds = torch.utils.data.TensorDataset
    return Splits(tds(x[train], y[train]), tds(x[val], y[val]), num_classes=10, in_channels=1, image_size=8)


def torchvision_dataset(name: str, root: str = "data", download: bool = False) -> Splits:
    """MNIST, FashionMNIST or CIFAR10 through torchvision's own classes (ToTensor + Normalize per sample)."""
    import torchvision
    from torchvision import transforms

    mean, std = _STATS[name]
    tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize(mean, std)])
    cls = getattr(torchvision.datasets, name)
    train, val = (cls(root, train=split, transform=tf, download=download) for split in (True, False))
    in_channels, image_size, num_classes = _SHAPES[name]
    return Splits(train, val, num_classes=num_classes, in_channels=in_channels, image_size=image_size)


def fake(
    train_size: int = 1000, val_size: int = 200, image_size: int = 28, in_channels: int = 1, num_classes: int = 10
) -> Splits:
    """torchvision FakeData: random images, for smoke tests and throughput checks."""
    from torchvision import datasets, transforms

    shape = (in_channels, image_size, image_size)
    tf = transforms.ToTensor()
    train = datasets.FakeData(train_size, shape, num_classes, transform=tf, random_offset=0)
    val = datasets.FakeData(val_size, shape, num_classes, transform=tf, random_offset=train_size)
    return Splits(train, val, num_classes=num_classes, in_channels=in_channels, image_size=image_size)


def prepare(data_cfg: dict) -> None:
    """In the parent, before ranks start: download a torchvision dataset if asked, else check its files."""
    if data_cfg.get("_target_") != f"{__name__}.torchvision_dataset":
        return
    name, root = data_cfg["name"], os.path.abspath(data_cfg.get("root", "data"))
    if name not in _TORCHVISION:
        raise ConfigError(f"data.name={name!r}: must be one of {', '.join(_TORCHVISION)}")
    folder, files = _TORCHVISION[name]
    missing = [f for f in files if not os.path.exists(os.path.join(root, folder, f))]
    if not missing:
        return
    if not data_cfg.get("download", False):
        raise ConfigError(
            f"data.root={root}: {name} not found (missing {os.path.join(folder, missing[0])}); "
            f"set data.download=true, or put the files there"
        )
    try:
        torchvision_dataset(name, root, download=True)
    except Exception as e:  # torchvision raises URLError, HTTPError or RuntimeError depending on the mirror
        raise ConfigError(f"data.download=true: could not download {name} to {root} ({e}); no network?") from e
