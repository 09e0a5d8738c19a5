"""The train loop's log interval: the loss (and a counting task's items) summed on the device and read once per
interval, and the first step whose loss was not finite, so a NaN stops the run without a host sync per step."""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
import torch.distributed as dist

from ddpexp.config import Config
from ddpexp.exceptions import NonFinite
from ddpexp.job import Job
from ddpexp.rank import checkpoint

log = logging.getLogger("ddpexp")
NEVER = 2**62  # Meter.first_bad before any non-finite loss


class Meter:
    """The train loss (and a counting task's items) of each log interval, summed on the device and read once per
    interval: the loop's only host sync, on every rank (an all-reduce). The first step whose loss was not
    finite is kept on the device too, so that a NaN is caught without a sync per step."""

    def __init__(self, device: torch.device, step: int, items: str | None):
        self.loss = torch.zeros((), device=device)
        self.items_name, self.items = items, torch.zeros((), dtype=torch.float64, device=device)
        self.last = (time.perf_counter(), step)  # (time, step) of the last log line
        self.first_bad = torch.full((), NEVER, dtype=torch.int64, device=device)
        self.warned, self.spoilt = False, False

    def add(self, loss: torch.Tensor, items: Any, step: int) -> None:
        self.loss += loss
        if items is not None:
            self.items += items
        self.first_bad = torch.where(torch.isfinite(loss), self.first_bad, self.first_bad.clamp(max=step))

    def check_finite(self, cfg: Config, job: Job, step: int, value: float = float("nan")) -> bool:
        """Every rank: stop (or warn) if any rank's loss was not finite at a step since the run began. Returns
        whether every loss was (on_nonfinite=warn trains on with weights that are no one's best)."""
        if self.spoilt:
            return False
        bad = self.first_bad.clone()
        dist.all_reduce(bad, op=dist.ReduceOp.MIN)
        if int(bad) != NEVER:
            self.spoilt = True
            self.nonfinite(cfg, job, "train/loss", value, int(bad), step)
        return not self.spoilt

    def nonfinite(self, cfg: Config, job: Job, key: str, value: float, bad_step: int, step: int) -> None:
        """Every rank reaches this at the same step (the values were reduced): stop, or say so once and go on."""
        if self.warned:
            return
        line = f"{key} went non-finite ({value}) at step {bad_step}"
        if cfg.on_nonfinite == "warn":
            log.warning("%s; going on (on_nonfinite=warn)", line)
            self.warned = True
            return
        kept = checkpoint.newest(job.checkpoint_dir)
        kept = f"the last checkpoint before it is {kept}" if kept else "no checkpoint was written"
        raise NonFinite(f"{line}; stopped at step {step}, {kept} (on_nonfinite=warn goes on instead)")

    def log(self, cfg: Config, job: Job, tracker: Any, optimizer: Any, step: int, epoch: int) -> float:
        reduced = self.loss.clone()
        dist.all_reduce(reduced)
        steps = step - self.last[1]
        loss = reduced.item() / (steps * dist.get_world_size())
        now = time.perf_counter()
        samples = steps * cfg.grad_accum * cfg.batch_size * dist.get_world_size()
        metrics = {
            "train/loss": loss,
            "lr": optimizer.param_groups[0]["lr"],
            "samples_per_s": samples / (now - self.last[0]),
        }
        if self.items_name is not None:  # already summed over the ranks
            metrics[f"{self.items_name}_per_s"] = self.items.item() / (now - self.last[0])
        tracker.log(metrics, step, epoch)
        log.info("epoch %d step %d: %s", epoch, step, " ".join(f"{k} {v:.4g}" for k, v in metrics.items()))
        self.loss.zero_()
        self.items.zero_()
        self.last = (now, step)
        return loss
