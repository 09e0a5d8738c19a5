"""An MNIST-format dataset without network: scikit-learn's 8x8 digits, upscaled to 28x28, written as IDX files."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np


def write_mnist_idx(root: str | Path, n_train: int = 20000, n_test: int = 2000, seed: int = 0) -> Path:
    """Write root/MNIST/raw/{train,t10k}-{images-idx3,labels-idx1}-ubyte, the files torchvision's MNIST reads.

    Each image is one of the 1797 real 8x8 digits, scaled to 24x24 (nearest-neighbour), placed at a random offset
    in the 28x28 frame, with pixel noise: learnable, and different from sample to sample."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    base = (digits.images * (255 / 16)).astype(np.uint8)  # 0..16 -> 0..255
    raw = Path(root) / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for split, n in (("train", n_train), ("t10k", n_test)):
        pick = rng.integers(0, len(base), n)
        big = base[pick].repeat(3, axis=1).repeat(3, axis=2)  # 8x8 -> 24x24
        images = np.zeros((n, 28, 28), np.uint8)
        dy, dx = rng.integers(0, 5, n), rng.integers(0, 5, n)
        for i in range(n):
            images[i, dy[i] : dy[i] + 24, dx[i] : dx[i] + 24] = big[i]
        noise = rng.integers(0, 30, images.shape)
        images = np.clip(images.astype(np.int32) + noise, 0, 255).astype(np.uint8)
        labels = digits.target[pick].astype(np.uint8)
        (raw / f"{split}-images-idx3-ubyte").write_bytes(struct.pack(">IIII", 0x803, n, 28, 28) + images.tobytes())
        (raw / f"{split}-labels-idx1-ubyte").write_bytes(struct.pack(">II", 0x801, n) + labels.tobytes())
    return Path(root)


def has_mnist(root: str | Path) -> bool:
    raw = Path(root) / "MNIST" / "raw"
    names = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
    return all((raw / n).exists() for n in names)
