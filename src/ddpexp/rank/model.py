"""The model as every rank builds it, for training (rank/train.py) and for `ddpexp eval` (rank/eval_worker.py):
`model._target_` given the data's facts, on its device in its memory format (speed.py's defaults), SyncBatchNorm
if asked, a checkpoint's weights loaded; and the autocast of its precision."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from hydra.utils import instantiate

from ddpexp.config import Config
from ddpexp.parts.optim import call_accepting
from ddpexp.rank import speed


def build_model(cfg: Config, device: torch.device, splits: Any, weights: Any) -> tuple[torch.nn.Module, str, bool]:
    """(the model on `device` with `weights` if given, precision, channels_last)."""
    model = call_accepting(instantiate(cfg.model, _partial_=True), **splits.facts).to(device)
    precision, channels_last = speed.speed_defaults(cfg, device, model)
    model = model.to(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    if cfg.ddp.sync_batchnorm:
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if weights is not None:
        model.load_state_dict(weights)
    return model, precision, channels_last


def autocast_for(device: torch.device, precision: str) -> Any:
    return torch.autocast(
        device.type, dtype=torch.bfloat16 if precision == "bf16" else torch.float16, enabled=precision != "fp32"
    )


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
