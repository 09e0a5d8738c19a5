"""What each step trains on, counted: the divisors that make a step's loss the exact mean over every item of
the step on all ranks (slices of any size, a rank with none), the run's planned steps when resumed at another
world size or batch size, and the samples a resumed epoch had trained before."""

from __future__ import annotations

import math
import sys
from typing import Any

import torch
import torch.distributed as dist

from ddpexp.config import Config
from ddpexp.exceptions import ConfigError
from ddpexp.parts.tasks import samples
from ddpexp.rank.resume import Position, Resumed


def planned_steps(cfg: Config, resumed: Resumed | None, per_epoch: int | None, epoch_samples: int | None,
                  block: int) -> int:  # fmt: skip
    """The run's optimizer steps: `epochs` of `per_epoch`; resumed mid-epoch, the steps taken, those left of that
    epoch at this world size and batch size, and the later epochs'."""
    if per_epoch is None:
        return sys.maxsize
    pos = resumed.position if resumed is not None else None
    if pos is None or pos.samples is None or epoch_samples is None or pos.epoch >= cfg.epochs:
        return cfg.epochs * per_epoch
    micro_batches = -(-max(epoch_samples - pos.samples, 0) // block)
    left = -(-micro_batches // cfg.grad_accum)
    return pos.step + left + (cfg.epochs - pos.epoch - 1) * per_epoch


def resumed_part(resumed: Resumed | None, pos: Position, epoch: int) -> int:
    """Samples of the resumed epoch that the checkpoint's run trained before it."""
    return (pos.samples or 0) if resumed is not None and epoch == pos.epoch else 0


def weights(
    task: Any, task_name: str, group: list[Any], sizes: list[int], all_samples: int | None, world_size: int
) -> tuple[list[Any], Any]:
    """Each micro-batch's divisor of its mean loss, so that after DDP averages over the ranks the step's gradient
    is that of the mean over every item of the step (items: the task's `count`, else samples), and the items of
    the step over all ranks (a tensor) for a counting task's throughput, else None.

    With equal shards and no `count`, every rank's i-th micro-batch has the same size, so the sizes are known
    here without a collective; when they are all equal the divisor is exactly the number of micro-batches, as
    in a hand-written `loss / grad_accum`."""
    if hasattr(task, "count"):  # tokens, pixels, unmasked labels: the step's total over the ranks
        counts = [torch.as_tensor(task.count(b) if n else 0) for b, n in zip(group, sizes)]
        total = torch.stack(counts).sum().to(torch.float64)
        dist.all_reduce(total)
        return [(total / (world_size * n)).float() for n in counts], total
    if min(samples(b) for b in group) < 1:
        raise ConfigError(
            f"{task_name}: cannot tell how many samples a {type(group[0]).__name__} batch holds (no tensor in it); "
            "give the task a count(batch) method"
        )
    if all_samples is not None:  # the step's samples over all ranks: of the global order, or agreed
        return [all_samples / (world_size * n) if n else math.inf for n in sizes], None
    return [sum(sizes) / n for n in sizes], None
