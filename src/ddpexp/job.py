"""What a launcher and the worker know of the job: its directory, its name in a sweep, the resolved config."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Job:
    dir: str  # absolute; Hydra made it in the parent, ranks only write into it
    name: str  # W&B run name: the job's overrides
    group: str | None  # W&B group: the sweep, None for a single run
    launcher: str  # the `launcher=` choice
    config_yaml: str  # the resolved config, as the checkpoint and W&B store it
    overrides: list[str] = field(default_factory=list)

    @property
    def summary_path(self) -> str:
        return os.path.join(self.dir, "summary.json")

    @property
    def metrics_path(self) -> str:
        return os.path.join(self.dir, "metrics.jsonl")

    @property
    def checkpoint_dir(self) -> str:
        return os.path.join(self.dir, "checkpoints")

    def log_path(self, rank: int) -> str:
        return os.path.join(self.dir, "logs", f"rank{rank}.log")

    def error_path(self, rank: int) -> str:
        """A failing rank's traceback and time: the earliest one is the root cause, the rest its echoes."""
        return os.path.join(self.dir, "logs", f"rank{rank}.error.json")


def write_json(path: str, obj: Any) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, default=str)
        f.write("\n")
    os.replace(tmp, path)


def read_json(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):  # a path under a file: none either
        return None
