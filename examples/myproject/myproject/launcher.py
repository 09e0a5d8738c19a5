"""launcher=nice: the project's own launcher, spawn's ranks at a lower CPU priority (`launcher.niceness`), so a long
run leaves a shared workstation responsive. A launcher is one module (launch, resolve, world_size, plan), one
dataclass (NiceConfig, for launcher=nice) and one YAML (conf/launcher/nice.yaml)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from ddpexp.exceptions import ConfigError
from ddpexp.launchers import spawn
from ddpexp.launchers.base import Handle


@dataclass
class NiceConfig(spawn.SpawnConfig):
    _target_: str = "myproject.launcher.launch"
    niceness: int = 10  # 0 (as the command) .. 19 (only when nothing else wants the cores)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.niceness <= 19:
            raise ConfigError(f"launcher.niceness={self.niceness}: must be 0..19")


resolve, world_size, plan = spawn.resolve, spawn.world_size, spawn.plan


def launch(worker: Callable[..., None], cfg: Any, job: Any) -> Handle:
    return spawn.launch(partial(niced, worker, cfg.launcher.niceness), cfg, job)


def niced(worker: Callable[..., None], niceness: int, cfg: Any, job: Any) -> None:
    """In each rank: lower its priority, record the niceness it runs at (summary.json), then train."""
    os.nice(niceness - os.nice(0))
    worker(cfg, replace(job, record={**job.record, "niceness": os.nice(0)}))
