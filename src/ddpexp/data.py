"""Datasets behind `data=`: each factory returns Splits (train, val and the shape facts the model needs).

The parent calls `prepare()` once before any rank starts: it downloads when asked and otherwise checks that the
files are there, so a missing dataset is one clear error instead of N rank tracebacks.
"""

from __future__ import annotations

import inspect
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
DIGITS = 1797  # images in scikit-learn's load_digits()


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
    """The loader for `cfg` (batch_size, seed, num_workers): the in-memory path when the train set is one tensor
    (data=digits, or a torchvision set held in RAM), else a DataLoader. Both have the TrainLoader interface."""
    from ddpexp.inmemory import InMemoryLoader, batchable

    tensors = batchable(splits.train)
    if tensors is not None:
        return InMemoryLoader(tensors, cfg.batch_size, rank, world_size, cfg.seed, device)
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


def torchvision_dataset(
    name: str,
    root: str = "data",
    download: bool = False,
    in_memory: bool | None = None,
    in_memory_max_mb: float = 4096,
    crop_padding: int = 0,
    hflip: bool = False,
) -> Splits:
    """MNIST, FashionMNIST or CIFAR10. In memory (in_memory=null: when the files take <= in_memory_max_mb): decoded
    once to uint8 tensors, cached under root, normalized and augmented per batch. Otherwise torchvision's own
    classes with per-sample transforms (RandomCrop/RandomHorizontalFlip, ToTensor, Normalize) for a DataLoader."""
    mean, std = _STATS[name]
    in_channels, image_size, num_classes = _SHAPES[name]
    if fits_in_memory(name, root, in_memory, in_memory_max_mb):  # from the cache: no torchvision import (~4 s)
        from ddpexp.inmemory import TensorImages

        train, val = (tensors(name, root, split) for split in (True, False))
        return Splits(
            TensorImages(*train, mean, std, crop_padding, hflip), TensorImages(*val, mean, std),
            num_classes=num_classes, in_channels=in_channels, image_size=image_size,
        )  # fmt: skip
    import torchvision
    from torchvision import transforms

    tf = [transforms.ToTensor(), transforms.Normalize(mean, std)]
    augment = [transforms.RandomCrop(image_size, padding=crop_padding)] if crop_padding else []
    augment += [transforms.RandomHorizontalFlip()] if hflip else []
    cls = getattr(torchvision.datasets, name)
    train = cls(root, train=True, transform=transforms.Compose(augment + tf), download=download)
    val = cls(root, train=False, transform=transforms.Compose(tf), download=download)
    return Splits(train, val, num_classes=num_classes, in_channels=in_channels, image_size=image_size)


def _sources(name: str, root: str) -> list[str]:
    folder, files = _TORCHVISION[name]
    return [os.path.join(root, folder, f) for f in files]


def fits_in_memory(name: str, root: str, in_memory: bool | None, max_mb: float) -> bool:
    if in_memory is not None:
        return in_memory
    return sum(os.path.getsize(p) for p in _sources(name, root) if os.path.exists(p)) <= max_mb * 2**20


def tensors(name: str, root: str, train: bool) -> tuple[Any, Any]:
    """(uint8 images [N, C, H, W], int64 labels) of one split, decoded by torchvision's class once, then cached."""
    from ddpexp.inmemory import cached

    def decode() -> tuple[Any, Any]:
        import torch
        import torchvision

        ds = getattr(torchvision.datasets, name)(root, train=train)
        images = torch.as_tensor(ds.data)
        images = images.unsqueeze(1) if images.dim() == 3 else images.permute(0, 3, 1, 2)  # CIFAR: N, H, W, C
        return images.contiguous(), torch.as_tensor(ds.targets, dtype=torch.long)

    return cached(name, root, "train" if train else "test", decode, _sources(name, root))


def fake(
    train_size: int = 1000,
    val_size: int = 200,
    image_size: int = 28,
    in_channels: int = 1,
    num_classes: int = 10,
    crop_padding: int = 0,
    hflip: bool = False,
) -> Splits:
    """torchvision FakeData: random images, for smoke tests and throughput checks (augmentation keys as above)."""
    from torchvision import datasets, transforms

    shape = (in_channels, image_size, image_size)
    augment = [transforms.RandomCrop(image_size, padding=crop_padding)] if crop_padding else []
    augment += [transforms.RandomHorizontalFlip()] if hflip else []
    tf = transforms.ToTensor()
    train = datasets.FakeData(train_size, shape, num_classes, transforms.Compose([*augment, tf]), random_offset=0)
    val = datasets.FakeData(val_size, shape, num_classes, transform=tf, random_offset=train_size)
    return Splits(train, val, num_classes=num_classes, in_channels=in_channels, image_size=image_size)


def prepare(data_cfg: dict) -> None:
    """In the parent, before ranks start: download a torchvision dataset if asked, else check its files; then
    build the in-memory cache if that path applies."""
    if data_cfg.get("_target_") != f"{__name__}.torchvision_dataset":
        return
    shape(data_cfg)
    name, root = data_cfg["name"], os.path.abspath(data_cfg.get("root", "data"))
    max_mb = data_cfg.get("in_memory_max_mb", 4096)
    if not isinstance(max_mb, (int, float)) or max_mb <= 0:
        raise ConfigError(f"data.in_memory_max_mb={max_mb!r}: must be > 0")
    folder, files = _TORCHVISION[name]
    missing = [f for f in files if not os.path.exists(os.path.join(root, folder, f))]
    if missing and not data_cfg.get("download", False):
        raise ConfigError(
            f"data.root={root}: {name} not found (missing {os.path.join(folder, missing[0])}); "
            f"set data.download=true, or put the files there"
        )
    if missing:
        try:
            torchvision_dataset(name, root, download=True, in_memory=False)
        except Exception as e:  # torchvision raises URLError, HTTPError or RuntimeError depending on the mirror
            raise ConfigError(f"data.download=true: could not download {name} to {root} ({e}); no network?") from None
    if fits_in_memory(name, root, data_cfg.get("in_memory"), max_mb):
        for train in (True, False):  # decoded and cached once here, not by every rank at once
            tensors(name, root, train)


def shape(data_cfg: dict) -> tuple[int, int, int] | None:
    """(in_channels, image_size, num_classes) of a built-in `data=`, from its config alone (nothing is read), once
    the keys that size it are checked; None for a user's factory, whose shape is known only once it is built.

    One training sample is enough for a step on every rank: DistributedSampler pads, and the last batch is kept."""
    factory = {f"{__name__}.{f.__name__}": f for f in (digits, torchvision_dataset, fake)}.get(data_cfg["_target_"])
    if factory is None:
        return None
    kwargs = {k: p.default for k, p in inspect.signature(factory).parameters.items()} | data_cfg
    if "crop_padding" in kwargs:
        _check_int(kwargs, "crop_padding", 0, "(0: no random crop)")
    if factory is digits:
        fraction = kwargs["val_fraction"]
        n_val = round(DIGITS * fraction) if isinstance(fraction, (int, float)) else 0
        if not 0 < n_val < DIGITS:
            raise ConfigError(f"data.val_fraction={fraction!r}: must leave >= 1 of the {DIGITS} digits to each split")
        return 1, 8, 10
    if factory is torchvision_dataset:
        if data_cfg.get("name") not in _SHAPES:
            raise ConfigError(f"data.name={data_cfg.get('name')!r}: must be one of {', '.join(_SHAPES)}")
        return _SHAPES[kwargs["name"]]
    for key in ("train_size", "val_size", "image_size", "in_channels", "num_classes"):
        _check_int(kwargs, key, 1)
    return kwargs["in_channels"], kwargs["image_size"], kwargs["num_classes"]


def _check_int(kwargs: dict, key: str, low: int, why: str = "") -> None:
    value = kwargs[key]
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ConfigError(f"data.{key}={value!r}: must be an int >= {low} {why}".rstrip())
