"""Strategies: how the ranks hold the model they train. `strategy=ddp` (the default) is DistributedDataParallel:
every rank holds the whole model, its gradients and the optimizer's state. `strategy=fsdp2` shards all three over
the ranks with FSDP2 (`torch.distributed.fsdp.fully_shard`) and checkpoints the shards with
`torch.distributed.checkpoint`, for a model that does not fit one device.

The loop (rank/train.py) calls one strategy object for what differs (rank/ddp.py, rank/fsdp2.py): building and
wrapping the model, gradient sync across micro-batches, clipping, the optimizer's parameters, what a checkpoint
holds and how a resume loads it. This module is the config: one dataclass per option (conf/strategy/NAME.yaml
extends it), checked in the parent; torch-free.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ddpexp.exceptions import ConfigError

DTYPES = ("fp32", "bf16", "fp16")


@dataclass
class StrategyConfig:
    name: str = "ddp"


@dataclass
class DdpStrategyConfig(StrategyConfig):
    """DistributedDataParallel; its knobs stay at `ddp.*`, where they were before the strategy group."""

    name: str = "ddp"


@dataclass
class Fsdp2StrategyConfig(StrategyConfig):
    """FSDP2: parameters, gradients and optimizer state sharded over the ranks; each unit's parameters are
    all-gathered for its forward and backward, its gradients reduce-scattered."""

    name: str = "fsdp2"
    units: Any = "auto"  # auto: the model's repeated blocks (the class most parameters sit in); or [ClassName, ...]
    reshard_after_forward: bool = True  # free each unit's gathered parameters after its forward (gather again)
    param_dtype: str | None = None  # the dtype units compute in; null: bf16 where precision=bf16, else fp32
    reduce_dtype: str | None = None  # the dtype gradients are reduced in; null: fp32
    activation_checkpointing: bool = False  # recompute each unit's activations in backward instead of keeping them
    cpu_offload: bool = False  # keep the sharded parameters, gradients and optimizer state in CPU memory (CUDA)

    def __post_init__(self) -> None:
        units = self.units
        ok = units == "auto" or (
            isinstance(units, (list, tuple)) and units and all(isinstance(u, str) and u for u in units)
        )
        if not ok:
            raise ConfigError(f"strategy.units={units!r}: must be auto or a list of module class names")
        for key in ("param_dtype", "reduce_dtype"):
            value = getattr(self, key)
            if value is not None and value not in DTYPES:
                raise ConfigError(f"strategy.{key}={value!r}: must be one of {', '.join(DTYPES)} or null")


SCHEMAS: dict[str, type[StrategyConfig]] = {"ddp": DdpStrategyConfig, "fsdp2": Fsdp2StrategyConfig}
DEFAULT = {"name": "ddp"}  # what a config without a `strategy` key (before the group) ran with


def typed(node: Any) -> StrategyConfig:
    """The strategy's dataclass: the composed group's as it is, or one from a plain mapping (a run's config.yaml,
    read back by `ddpexp eval`), or DDP for a config from before the group (no `strategy`)."""
    if isinstance(node, StrategyConfig):
        return node
    values = dict(node or DEFAULT)
    name = values.get("name", "ddp")
    if name not in SCHEMAS:
        raise ConfigError(f"strategy={name}: no such strategy (one of {', '.join(SCHEMAS)})")
    schema = SCHEMAS[name]
    known = {f.name for f in dataclasses.fields(schema)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"strategy.{unknown[0]}: no such key of strategy={name} ({schema.__name__})")
    return schema(**values)


def record(strategy: StrategyConfig) -> dict[str, Any]:
    """The strategy and its resolved options, as summary.json holds them."""
    return dataclasses.asdict(strategy)


def check(cfg: Any) -> None:
    """What the strategy cannot do with the rest of the config: one line, before any rank starts."""
    strategy = cfg.strategy
    if strategy.name != "fsdp2":
        return
    refused = {
        "compile=true": cfg.compile,
        "ddp.sync_batchnorm=true": cfg.ddp.sync_batchnorm,
        "channels_last=true": cfg.channels_last is True,
        "precision=fp16": cfg.precision == "fp16",  # its GradScaler would unscale sharded gradients unsynced
    }
    for setting, on in refused.items():
        if on:
            raise ConfigError(f"strategy=fsdp2 does not support {setting} (yet): use strategy=ddp for it")
    if strategy.cpu_offload and cfg.device == "cpu":
        raise ConfigError("strategy.cpu_offload=true: the parameters are on the CPU already (device=cpu); drop it")


__all__ = ["DdpStrategyConfig", "Fsdp2StrategyConfig", "StrategyConfig", "check", "record", "typed"]
