"""strategy=ddp: DistributedDataParallel, as the seed's tutorial wraps the model. Every rank holds the whole model;
a checkpoint is one file rank 0 writes with the whole state (rank/checkpoint.py)."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpexp.exceptions import ConfigError
from ddpexp.rank import distributed
from ddpexp.rank.model import build_model
from ddpexp.strategies import DdpStrategyConfig, record


class DDPStrategy:
    lockstep = False  # the forward is no collective: ranks may score different numbers of val batches
    sharded = False  # a checkpoint is rank 0's file of the whole state

    def __init__(self, config: DdpStrategyConfig, device: torch.device):
        self.config, self.device = config, device
        self.ddp: DDP | None = None

    def build(self, cfg: Any, splits: Any, resumed: Any) -> tuple[torch.nn.Module, str, bool]:
        """The whole model on this rank's device, with the checkpoint's weights if resumed; (model, precision,
        channels_last)."""
        if resumed is not None and resumed.state.get("sharded"):
            raise ConfigError(
                f"resume: {resumed.path} is a strategy=fsdp2 checkpoint (every rank's shards); strategy=ddp resumes "
                "its own one-file checkpoints only"
            )
        return build_model(cfg, self.device, splits, resumed.state["model"] if resumed is not None else None)

    def wrap(self, model: torch.nn.Module, cfg: Any, precision: str = "fp32", ckpt_dir: str = "") -> DDP:
        self.ddp = DDP(
            model,
            device_ids=[self.device.index] if self.device.type == "cuda" else None,
            find_unused_parameters=cfg.ddp.find_unused_parameters,
            static_graph=cfg.ddp.static_graph,
            gradient_as_bucket_view=cfg.ddp.gradient_as_bucket_view,
            bucket_cap_mb=cfg.ddp.bucket_cap_mb,
        )
        return self.ddp

    def parameters(self) -> Any:
        assert self.ddp is not None
        return self.ddp.parameters()

    def micro_batch(self, sync: bool) -> AbstractContextManager[Any]:
        """The backward of a micro-batch: all-reduced only at the step's last (sync)."""
        assert self.ddp is not None
        return nullcontext() if sync else self.ddp.no_sync()

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm)

    def state(self, model: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
        """The model's and optimizer's part of rank 0's checkpoint file (every rank calls it)."""
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}

    def restore(self, resumed: Any, model: torch.nn.Module, optimizer: Any) -> None:
        """The optimizer's state (the weights were loaded before DDP wrapped the model)."""
        optimizer.load_state_dict(resumed.state["optimizer"])

    def replicas(self, model: torch.nn.Module) -> dict[str, Any]:
        return distributed.compare_replicas(model)

    def record(self) -> dict[str, Any]:
        return {"strategy": record(self.config), "ddp_buckets": _bucket_sizes(self.ddp)}


def _bucket_sizes(ddp: DDP | None) -> list[int] | None:
    """DDP's gradient buckets in bytes, in all-reduce order, as rebuilt after the first step (None if unknown)."""
    try:
        info = ddp._get_ddp_logging_data()  # type: ignore[union-attr]  # private, but the one place DDP tells
    except (AttributeError, RuntimeError):
        return None
    sizes = info.get("rebuilt_bucket_sizes") or info.get("bucket_sizes")
    return [int(s) for s in str(sizes).split(",")] if sizes else None
