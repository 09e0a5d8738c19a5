"""The in-memory data path's datasets: a dataset that fits in RAM is decoded once into one uint8 tensor (cached as a
.pt file under data.root), kept whole on the training device and batched by index slicing (parts/loaders.py), with
augmentation (random crop with padding, flip) done per batch on the device."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, TensorDataset

CACHE_DIR = "ddpexp-cache"
CACHE_VERSION = 1  # bump when the cached layout changes: older files are rebuilt


class TensorImages(Dataset):
    """Images as one uint8 tensor [N, C, H, W] and int64 labels, normalized when read.

    `batch(idx)` gives a whole batch by index slicing; `[i]` one sample, so DataLoader, Subset and a user's own
    code still work. The float values are bit-equal to torchvision's ToTensor + Normalize of the same pixels."""

    def __init__(
        self, images: torch.Tensor, labels: torch.Tensor, mean: tuple, std: tuple, crop_padding: int = 0, hflip=False
    ):
        self.images, self.labels = images, labels
        self.mean = torch.as_tensor(mean, dtype=torch.float32, device=images.device).view(-1, 1, 1)
        self.std = torch.as_tensor(std, dtype=torch.float32, device=images.device).view(-1, 1, 1)
        self.crop_padding, self.hflip = crop_padding, hflip

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        x, y = self.batch(torch.tensor([i]))
        return x[0], int(y[0])

    def to(self, device: torch.device) -> TensorImages:
        moved = TensorImages(self.images.to(device), self.labels.to(device), (), (), self.crop_padding, self.hflip)
        moved.mean, moved.std = self.mean.to(device), self.std.to(device)
        return moved

    def batch(
        self, idx: torch.Tensor, train: bool = False, keys: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`keys`: each sample's random key (the loader's: seed, epoch, index), else torch's RNG draws."""
        pixels = self.images[idx]
        if train:
            pixels = augment(pixels, self.crop_padding, self.hflip, keys)
        # ToTensor's `float().div(255)`, then Normalize's `sub_(mean).div_(std)`: the same ops, element by element.
        return pixels.float().div(255).sub(self.mean).div(self.std), self.labels[idx]


class _Tensors:
    """A TensorDataset (e.g. data=digits) seen through the same `batch(idx)` / `to(device)` interface."""

    def __init__(self, tensors: tuple[torch.Tensor, ...]):
        self.tensors = tensors

    def __len__(self) -> int:
        return len(self.tensors[0])

    def to(self, device: torch.device) -> _Tensors:
        return _Tensors(tuple(t.to(device) for t in self.tensors))

    def batch(self, idx: torch.Tensor, train: bool = False) -> tuple[torch.Tensor, ...]:
        return tuple(t[idx] for t in self.tensors)


def batchable(dataset: Any) -> Any | None:
    """The dataset as something with `batch(idx)`, or None when it must go through a DataLoader."""
    if isinstance(dataset, TensorDataset):
        return _Tensors(dataset.tensors)
    return dataset if hasattr(dataset, "batch") and hasattr(dataset, "to") else None


def augment(pixels: torch.Tensor, crop_padding: int, hflip: bool, keys: torch.Tensor | None = None) -> torch.Tensor:
    """torchvision's RandomCrop(size, padding, fill=0) and RandomHorizontalFlip, for a whole batch at once; with
    `keys` (int64, one per sample) each sample's shift and flip follow from its key alone, not from the batch."""
    n, _, h, w = pixels.shape

    def draw(salt: int, high: int) -> torch.Tensor:  # n ints in [0, high)
        if keys is None:
            return torch.randint(0, high, (n,), device=pixels.device)
        return ((splitmix(keys + salt) >> 11) & ((1 << 52) - 1)) % high

    if crop_padding:
        p = crop_padding
        padded = F.pad(pixels, (p, p, p, p))
        dy, dx = draw(1, 2 * p + 1)[:, None], draw(2, 2 * p + 1)[:, None]
        rows = (dy + torch.arange(h, device=pixels.device))[:, None, :, None]  # n, 1, h, 1
        cols = (dx + torch.arange(w, device=pixels.device))[:, None, None, :]  # n, 1, 1, w
        batch = torch.arange(n, device=pixels.device)[:, None, None, None]
        channels = torch.arange(pixels.shape[1], device=pixels.device)[None, :, None, None]
        pixels = padded[batch, channels, rows, cols]
    if hflip:
        flip = torch.rand(n, device=pixels.device) < 0.5 if keys is None else draw(3, 2) == 1
        pixels = torch.where(flip[:, None, None, None], pixels.flip(3), pixels)
    return pixels


def splitmix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 (wrapping multiplication, logical shifts): a well-mixed hash per element."""
    for shift, mult in ((30, -4658895280553007687), (27, -7723592293110705685)):
        x = (x ^ ((x >> shift) & ((1 << (64 - shift)) - 1))) * mult
    return x ^ ((x >> 31) & ((1 << 33) - 1))


def cached(name: str, root: str, split: str, decode: Any, sources: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """(images, labels) of one split, from root/ddpexp-cache/NAME-SPLIT.pt when it was made from these very
    source files (sizes and mtimes), else decoded with `decode()` and written there atomically."""
    path = os.path.join(root, CACHE_DIR, f"{name}-{split}.pt")
    stamp = fingerprint(sources)
    try:
        state = torch.load(path, weights_only=True)
        if state.get("fingerprint") == stamp:
            return state["images"], state["labels"]
    except Exception:  # missing, truncated, foreign or refused by weights_only: it is only a cache, decode again
        pass
    images, labels = decode()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    torch.save({"fingerprint": stamp, "images": images, "labels": labels}, tmp)
    os.replace(tmp, path)  # concurrent jobs may both decode; each replace is whole
    return images, labels


def fingerprint(sources: list[str]) -> str:
    stats = [(os.path.basename(p), os.stat(p).st_size, os.stat(p).st_mtime_ns) for p in sorted(sources)]
    return f"v{CACHE_VERSION}:{stats}"
