"""A user dataset that records what it serves: the digits' train set, each sample it loads appended to
RECORD_DIR/served-PID.txt (one index a line), so a test counts how often every sample was trained on."""

from __future__ import annotations

import os
from typing import Any

from torch.utils.data import Dataset

from ddpexp.parts.data import Splits, digits


class Recorded(Dataset):
    def __init__(self, dataset: Any, record_dir: str):
        self.dataset, self.record_dir = dataset, record_dir

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> Any:
        with open(os.path.join(self.record_dir, f"served-{os.getpid()}.txt"), "a") as f:
            f.write(f"{i}\n")
        return self.dataset[i]


def splits(record_dir: str, val_fraction: float = 0.2, seed: int = 0, test_fraction: float | None = None) -> Splits:
    os.makedirs(record_dir, exist_ok=True)
    d = digits(val_fraction, seed, test_fraction)
    return Splits(Recorded(d.train, record_dir), d.val, num_classes=10, in_channels=1, image_size=8)


def served(record_dir: str) -> list[int]:
    """Every index served, by every process that wrote into `record_dir`."""
    out: list[int] = []
    for name in sorted(os.listdir(record_dir)):
        if name.startswith("served-"):
            with open(os.path.join(record_dir, name)) as f:
                out += [int(line) for line in f]
    return out
