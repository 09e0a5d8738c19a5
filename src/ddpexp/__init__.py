"""ddpexp: Hydra-configured PyTorch DistributedDataParallel experiments with pluggable launchers.

`ddpexp.run([...])` runs from Python what the `ddpexp` command runs, `ddpexp.evaluate(run_dir, ...)` what
`ddpexp eval` runs; `ddpexp.load_model(run_dir)` hands back a run's model with a checkpoint's weights. Importing
ddpexp imports neither torch nor Hydra: each name below is imported on first use."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from ddpexp.cli.api import Summary, run
    from ddpexp.cli.evaluate import evaluate, load_model
    from ddpexp.exceptions import ConfigError, Interrupted, RunFailed

_PUBLIC = {"run": "ddpexp.cli.api", "Summary": "ddpexp.cli.api", "ConfigError": "ddpexp.exceptions",
           "RunFailed": "ddpexp.exceptions", "Interrupted": "ddpexp.exceptions",
           "evaluate": "ddpexp.cli.evaluate", "load_model": "ddpexp.cli.evaluate"}  # fmt: skip
__all__ = ["ConfigError", "Interrupted", "RunFailed", "Summary", "evaluate", "load_model", "run"]


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'ddpexp' has no attribute {name!r}")
    return getattr(importlib.import_module(_PUBLIC[name]), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_PUBLIC])
