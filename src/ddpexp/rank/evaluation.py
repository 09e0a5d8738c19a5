"""Exact evaluation: rank r scores samples r, r+N, ... of the val set (each sample once, no padded duplicates);
the task's (sum, count) metrics are added up over batches and ranks, then divided, so they equal a
single-process evaluation for any world size and dataset length."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ddpexp.parts.loaders import eval_batches
from ddpexp.parts.tasks import check_metrics, finalize, samples, to_device
from ddpexp.rank import distributed


@torch.no_grad()
def check_metric_names(
    task: Any, model: torch.nn.Module, dataset: Any, batch_size: int, device: torch.device, autocast: Any,
    memory_format: Any = torch.contiguous_format, name: str = "task", lockstep: bool = False,
) -> None:  # fmt: skip
    """The task's metrics on this rank's first val batch, before the first step: a name that collides with the
    record's keys (or a value that is no (sum, count) pair) fails the rank now, in one line, not at the first
    evaluation an epoch later. For a user's data factory only the ranks see real batches (the parent's dry build
    checks ddpexp's data). In eval mode, with the RNG streams forked: nothing the run trains from changes."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        was_training = model.training
        model.eval()
        batches = eval_batches(dataset, dist.get_rank(), dist.get_world_size(), batch_size, device)
        try:
            batch = next(batches, None)  # a rank with no val batch (a set smaller than the world) has nothing to check
            if batch is not None:
                with autocast:
                    check_metrics(task.metrics(model, to_device(task, batch, device, memory_format)), name)
            elif lockstep:  # but its forward is a collective of the others' (fsdp2): it runs one, unchecked
                with autocast:
                    task.metrics(model, to_device(task, _filler(dataset, device), device, memory_format))
        finally:
            batches.close()
            model.train(was_training)


@torch.no_grad()
def evaluate(
    task: Any, model: torch.nn.Module, dataset: Any, batch_size: int, device: torch.device, autocast: Any,
    memory_format: Any = torch.contiguous_format, name: str = "task", split: str = "val", lockstep: bool = False,
) -> tuple[dict[str, float], int | None]:  # fmt: skip
    """({val/NAME: value}, samples scored over all ranks); `split` names the metrics (`ddpexp eval`: test/NAME).

    Runs on the unwrapped module: DDP's forward would broadcast buffers, a collective that hangs when the ranks
    hold different numbers of batches. So rank 0's buffers (BatchNorm's running stats, which each rank updated
    from its own last batch) are broadcast first, as DDP's next forward would: every rank scores the model the
    checkpoint holds. Evaluation draws nothing from the training RNG streams (a DataLoader draws its seed), so a
    run resumed after it continues exactly as one that never stopped there.

    `lockstep` (a sharded model, whose forward all-gathers its parameters): every rank runs as many forwards as
    the rank with the most batches, a rank out of batches on a filler batch whose scores it drops."""
    distributed.broadcast_buffers(model)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        was_training = model.training
        model.eval()
        try:
            sums, scored = _score(task, model, dataset, batch_size, device, autocast, memory_format, name, lockstep)
        finally:
            model.train(was_training)
    # A rank with no batch (a val set smaller than the world) still joins the reduction, with zeros.
    gathered = distributed.all_gather((list(sums), scored))
    names = list(dict.fromkeys(k for keys, _ in gathered for k in keys))  # the task's order, the same on all ranks
    zeros = torch.zeros(2, dtype=torch.float64, device=device)
    totals = torch.stack(
        [*(sums.get(k, zeros) for k in names), torch.tensor([scored, 0.0], dtype=torch.float64, device=device)]
    )
    dist.all_reduce(totals)
    values = totals.tolist()
    averages = {k: (s / c if c else float("nan")) for k, (s, c) in zip(names, values)}
    averages = finalize(task, averages)
    scored_all = int(values[-1][0]) if min(n for _, n in gathered) >= 0 else None
    return {f"{split}/{k}": float(v) for k, v in averages.items() if not k.startswith("_")}, scored_all


def _score(task, model, dataset, batch_size, device, autocast, memory_format, name, lockstep) -> tuple[dict, int]:  # type: ignore[no-untyped-def]
    rank, world_size = dist.get_rank(), dist.get_world_size()
    sums: dict[str, torch.Tensor] = {}  # name -> [sum, count] in float64
    scored = 0
    batches = eval_batches(dataset, rank, world_size, batch_size, device)
    for batch in _in_lockstep(batches, dataset, device) if lockstep else batches:
        if batch is None:  # out of batches while another rank scores: a forward for its collectives, dropped
            with autocast:
                task.metrics(model, to_device(task, _filler(dataset, device), device, memory_format))
            continue
        batch = to_device(task, batch, device, memory_format)
        with autocast:
            scores = check_metrics(task.metrics(model, batch), name)
        for key, (total, count) in scores.items():
            acc = sums.setdefault(key, torch.zeros(2, dtype=torch.float64, device=device))
            acc[0] += total
            acc[1] += count
        n = samples(batch)
        scored = scored + n if n >= 0 and scored >= 0 else -1  # -1: a batch without tensors, uncountable
    return sums, scored


def _in_lockstep(batches: Any, dataset: Any, device: torch.device) -> Any:
    """This rank's batches, then None while any other rank still has one: one tiny all-reduce per batch."""
    more = torch.zeros(1, dtype=torch.int64)
    while True:
        batch = next(batches, None)
        more.fill_(batch is not None)
        dist.all_reduce(more, op=dist.ReduceOp.MAX)
        if not more.item():
            return
        yield batch


def _filler(dataset: Any, device: torch.device) -> Any:
    """A batch of the split's first sample (any rank can build it)."""
    return next(iter(eval_batches(dataset, 0, 1, 1, device)))
