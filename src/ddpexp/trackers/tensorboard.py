"""`tracker=tensorboard`: TensorBoard event files in the job dir (JOB_DIR/tensorboard), so `tensorboard --logdir`
on a sweep dir shows each job as a run. A resumed job writes to the same log dir: its writer purges every step
from the earlier files and the record's rows up to the checkpoint are written again before the resumed run's own,
so each (tag, step) holds one value as TensorBoard's reader sees it, whatever an earlier attempt had flushed."""

from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import dataclass
from typing import Any

from ddpexp.trackers.base import Resume, TrackerConfig, TrackerError, flat_params

LABEL = "TensorBoard"


@dataclass
class TensorboardTrackerConfig(TrackerConfig):
    _target_: str = "ddpexp.trackers.tensorboard.start"
    on_error: str = "fail"
    log_dir: str | None = None  # null: JOB_DIR/tensorboard


def check(cfg: TensorboardTrackerConfig, job: Any) -> None:
    if importlib.util.find_spec("tensorboard") is None:
        raise TrackerError('the tensorboard package is not installed (pip install "ddpexp[tensorboard]")')
    cfg.log_dir = os.path.abspath(cfg.log_dir or os.path.join(job.dir, "tensorboard"))
    existing = cfg.log_dir
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
        raise TrackerError(f"cannot write its log dir {cfg.log_dir}: {existing} is not a writable directory")


def start(
    cfg: TensorboardTrackerConfig, job: Any, config: dict[str, Any], state: dict[str, Any] | None, resume: Resume | None
) -> TensorboardRun:
    from torch.utils.tensorboard import SummaryWriter
    from torch.utils.tensorboard.summary import hparams

    # purge_step=0: TensorBoard's reader drops whatever earlier files hold (an attempt's steps after its
    # checkpoint, or all of an attempt that left none); the record's rows come again below.
    writer = SummaryWriter(cfg.log_dir, purge_step=0)
    objective = str(config.get("objective", "val/acc"))
    for summary in hparams(flat_params(config), {objective: 0.0}):  # the HParams tab, beside the scalars
        writer.file_writer.add_summary(summary)
    run = TensorboardRun(writer, cfg.log_dir)
    for row in resume.rows if resume is not None else []:
        run.log({k: v for k, v in row.items() if k != "step"}, row["step"])
    return run


class TensorboardRun:
    def __init__(self, writer: Any, log_dir: str):
        self.writer, self.log_dir = writer, log_dir

    def log(self, row: dict[str, float], step: int) -> None:
        for key, value in row.items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                self.writer.add_scalar(key, value, step)
        self.writer.flush()  # at the log interval: what a killed job logged is on disk

    def state(self) -> dict[str, Any]:
        return {"log_dir": self.log_dir}

    def info(self) -> dict[str, Any]:
        return {"log_dir": self.log_dir}

    def finish(self, status: str, final: dict[str, float]) -> None:
        self.writer.add_text("status", status)
        self.writer.close()

    def close(self) -> None:
        self.writer.close()
