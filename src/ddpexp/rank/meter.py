"""The train loop's log interval: the loss (and a counting task's items) summed on the device and read once per
interval, and the first step whose loss was not finite, so a NaN stops the run without a host sync per step; and
the progress a person reads in those lines (the pace and when training ends at it)."""

from __future__ import annotations

import logging
import math
import time
from datetime import timedelta
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

    def __init__(self, device: torch.device, step: int, items: str | None, total_steps: int, start: int):
        # The pace counts this attempt's steps only: a resumed run's interval began before it (at `step`).
        self.total_steps, self.pace = total_steps, (time.perf_counter(), start)
        self.loss = torch.zeros((), device=device)
        self.items_name, self.items = items, torch.zeros((), dtype=torch.float64, device=device)
        self.last = (time.perf_counter(), step)  # (time, step) of the last log line
        self.first_bad = torch.full((), NEVER, dtype=torch.int64, device=device)
        self.warned: set[str] = set()  # on_nonfinite=warn: each metric is named once, at its first bad step
        self.spoilt = False

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

    def check_metrics(self, cfg: Config, job: Job, metrics: dict[str, float], step: int) -> bool:
        """An evaluation's metrics, after the train loss: a NaN loss at an earlier step is the cause of a NaN
        val/loss, so it is named first, at the step it went non-finite. Returns `check_finite`'s answer."""
        sound = self.check_finite(cfg, job, step)
        for key, value in metrics.items():
            if not math.isfinite(value):
                self.nonfinite(cfg, job, key, value, step, step)
        return sound

    def nonfinite(self, cfg: Config, job: Job, key: str, value: float, bad_step: int, step: int) -> None:
        """Every rank reaches this at the same step (the values were reduced): stop, or say so once and go on."""
        if key in self.warned:
            return
        line = f"{key} went non-finite ({value}) at step {bad_step}"
        if cfg.on_nonfinite == "warn":
            log.warning("%s; going on (on_nonfinite=warn)", line)
            self.warned.add(key)
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
        shown = " ".join(f"{k} {v:.4g}" for k, v in metrics.items())
        pace = progress(step, self.total_steps, step - self.pace[1], now - self.pace[0])
        log.info("epoch %d step %d: %s | %s", epoch, step, shown, pace)
        self.loss.zero_()
        self.items.zero_()
        self.last = self.pace = (now, step)
        self.check_finite(cfg, job, step, loss)  # read here anyway: a NaN is named at the interval it shows in
        return loss

    def started(self, step: int, epoch: int) -> None:
        """The first line of this attempt, before the first log interval ends: the pace of its first step (warm-up
        included, so slower than what follows) and the ETA at that pace. No loss is read: no host sync."""
        steps, seconds = step - self.pace[1], time.perf_counter() - self.pace[0]
        log.info("epoch %d step %d: started | %s", epoch, step, progress(step, self.total_steps, steps, seconds))


def line_due(step: int, start: int, every: int, total_steps: int) -> str | None:
    """Which rank-0 line a step ends with: the log interval's ("log"), else, at this attempt's first step, the line
    that says it started ("started"): an epoch shorter than log_every_n_steps would show no pace until then."""
    if step % every == 0 or step == total_steps:
        return "log"
    return "started" if step == start + 1 else None


def progress(step: int, total_steps: int, steps: int, seconds: float) -> str:
    """Where the run is, its pace over the last `steps` steps, and the steps' time left at that pace (the
    evaluations and checkpoints to come are not in it); without an end known (an IterableDataset), the pace."""
    rate = steps / seconds if seconds > 0 else math.inf
    if total_steps >= NEVER:
        return f"{rate:.3g} steps/s"
    left = (total_steps - step) / rate if rate > 0 else math.inf
    eta = str(timedelta(seconds=round(left))) if math.isfinite(left) else "unknown"
    return f"{step / total_steps:.0%} of {total_steps} steps, {rate:.3g} steps/s, ETA {eta}"
