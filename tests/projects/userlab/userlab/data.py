"""Characters of a module of Python's standard library, each the input for predicting the next one."""

from __future__ import annotations

import inspect
import textwrap

import torch

from ddpexp.data import Splits


def chars(n: int = 1200, val_fraction: float = 0.25):
    text = inspect.getsource(textwrap)[:n]
    vocab = sorted(set(text))
    ids = torch.tensor([vocab.index(c) for c in text])
    x, y = ids[:-1], ids[1:]
    n_val = int(len(x) * val_fraction)
    tds = torch.utils.data.TensorDataset
    return Splits(tds(x[n_val:], y[n_val:]), tds(x[:n_val], y[:n_val]), vocab_size=len(vocab))
