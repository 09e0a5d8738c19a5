"""The project's own data: scikit-learn's wine recognition set (178 wines, 13 chemical measurements, 3 cultivars),
which ships with scikit-learn: nothing is downloaded. Splits carries the facts the model is built with."""

from __future__ import annotations

import torch
from sklearn.datasets import load_wine

from ddpexp.parts.data import Splits


def wine(val_fraction: float = 0.25, seed: int = 0) -> Splits:
    x, y = load_wine(return_X_y=True)
    x, y = torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_val = round(len(y) * val_fraction)
    val, train = perm[:n_val], perm[n_val:]
    mean, std = x[train].mean(0), x[train].std(0)  # standardized with the train split's statistics only
    x = (x - mean) / std
    tds = torch.utils.data.TensorDataset
    return Splits(tds(x[train], y[train]), tds(x[val], y[val]), num_classes=3, in_features=13)
