"""Checkpoint files: atomic writes, tensors and plain types only, loaded with weights_only=True."""

from __future__ import annotations

import os
import random
from typing import Any


def rng_state() -> dict[str, Any]:
    """Every RNG the loop touches, as tensors and plain types (no pickled objects)."""
    import numpy as np
    import torch

    version, mt, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": [version, list(mt), gauss],
        "numpy": [kind, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def save(state: dict[str, Any], path: str) -> None:
    """Write to a temp file beside `path`, fsync, then rename: a crash leaves the old file intact."""
    import torch

    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load(path: str) -> dict[str, Any]:
    import torch

    return torch.load(path, map_location="cpu", weights_only=True)
