"""tracker=csv: the project's own tracker, every row in JOB_DIR/metrics.csv (one line per metric value: step, key,
value), for a lab's spreadsheet. A tracker is one module (check, start), one dataclass (CsvTrackerConfig, for
tracker=csv) and one YAML (conf/tracker/csv.yaml); the contract is ddpexp.trackers.base."""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass
from typing import Any

from ddpexp.trackers.base import Resume, TrackerConfig, TrackerError


@dataclass
class CsvTrackerConfig(TrackerConfig):
    _target_: str = "myproject.csvlog.start"
    file_name: str = "metrics.csv"  # in the job dir


def check(cfg: CsvTrackerConfig, job: Any) -> None:
    if os.sep in cfg.file_name:
        raise TrackerError(f"file_name={cfg.file_name!r}: a file name in the job dir, not a path")


def start(cfg: CsvTrackerConfig, job: Any, config: dict[str, Any], state: Any, resume: Resume | None) -> CsvRun:
    path = os.path.join(job.dir, cfg.file_name)
    run = CsvRun(path)  # a new file: what an earlier attempt wrote after its checkpoint goes
    for row in resume.rows if resume is not None else []:
        run.log({k: v for k, v in row.items() if k != "step"}, row["step"])
    return run


class CsvRun:
    def __init__(self, path: str):
        self.path, self.file = path, open(path, "w", newline="", buffering=1)
        self.writer = csv.writer(self.file)
        self.writer.writerow(["step", "key", "value"])

    def log(self, row: dict[str, float], step: int) -> None:
        self.writer.writerows([step, k, v] for k, v in row.items() if isinstance(v, (int, float)))

    def state(self) -> dict[str, Any]:
        return {}

    def info(self) -> dict[str, Any]:
        return {"path": self.path}

    def finish(self, status: str, final: dict[str, float]) -> None:
        self.file.close()
