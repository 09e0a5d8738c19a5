"""The one DDP train loop, top to bottom: build the run's parts, restore a checkpoint, then epochs of optimizer
steps (logging, stop signals, checkpoints) each ended by an exact evaluation, the best checkpoint and early
stopping. The task (ddpexp.tasks) computes the loss and the metrics; the loop never looks inside a batch."""

from __future__ import annotations

import itertools
import logging
import os
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from hydra.utils import instantiate

from ddpexp.config import Config
from ddpexp.exceptions import Stopped
from ddpexp.job import Job
from ddpexp.parts.loaders import train_loader, warn_about_sizes
from ddpexp.parts.optim import build_optimizer, call_accepting
from ddpexp.parts.tasks import check_loss, directions, objective_mode, samples, to_device
from ddpexp.rank import checkpoint, distributed
from ddpexp.rank.accounting import planned_steps, resumed_part, weights
from ddpexp.rank.best import Best, check_objective
from ddpexp.rank.ddp import DDPStrategy
from ddpexp.rank.debug import DebugFaults
from ddpexp.rank.evaluation import check_metric_names, evaluate
from ddpexp.rank.fsdp2 import FSDP2
from ddpexp.rank.meter import Meter, line_due
from ddpexp.rank.model import autocast_for, seed_everything
from ddpexp.rank.resume import Checkpointer, Position, Resumed, restore
from ddpexp.rank.signals import REQUEUE

log = logging.getLogger("ddpexp")

STRATEGIES = {"ddp": DDPStrategy, "fsdp2": FSDP2}  # strategy=NAME: how the ranks hold the model (ddpexp.strategies)


@dataclass
class Parts:
    """What one run trains, built the same way on every rank."""

    splits: Any
    task: Any
    task_name: str
    model: torch.nn.Module  # the module itself (sharded in place by fsdp2): evaluation and checkpoints use it
    strategy: (
        Any  # rank/ddp.py or rank/fsdp2.py: wraps the model, syncs and clips gradients, says what a checkpoint holds
    )
    wrapped: torch.nn.Module  # DDP(model), or the sharded model itself
    step_model: Any  # what the steps call: the wrapped model, compiled or not
    loader: Any  # the TrainLoader interface: set_epoch(epoch, start_batch, start_sample), len(), iter()
    n_batches: int | None  # None: an IterableDataset, whose epochs end when the first rank runs dry
    epoch_samples: int | None  # what one epoch of the global order trains on (None: an IterableDataset)
    total_steps: int
    optimizer: Any
    scheduler: Any
    scaler: Any
    autocast: Any
    precision: str
    channels_last: bool
    memory_format: Any


def build(cfg: Config, job: Job, device: torch.device, resumed: Resumed | None) -> Parts:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    # The same seed on every rank gives identical initial replicas (DDP broadcasts rank 0's weights too).
    seed_everything(cfg.seed)
    splits = instantiate(cfg.data)
    task, task_name = instantiate(cfg.task, _convert_="all"), f"task={cfg.task['_target_']}"
    strategy = STRATEGIES[cfg.strategy.name](cfg.strategy, device)
    model, precision, channels_last = strategy.build(cfg, splits, resumed)  # with its weights, if resumed
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    wrapped = strategy.wrap(model, cfg, precision, job.checkpoint_dir)  # fsdp2: the weights of its shards only
    seed_everything(cfg.seed + rank)  # per-rank streams for anything random from here on (dropout, augmentation)

    loader = train_loader(splits, cfg, rank, world_size, device)
    n_batches = _length(loader)
    epoch_samples = loader.order.end if getattr(loader, "order", None) is not None else None
    steps_per_epoch = -(-n_batches // cfg.grad_accum) if n_batches is not None else None
    total_steps = min(cfg.max_steps or sys.maxsize, planned_steps(cfg, resumed, steps_per_epoch, epoch_samples,
                                                                 cfg.batch_size * world_size))  # fmt: skip
    optimizer = build_optimizer(instantiate(cfg.optimizer), strategy.parameters(), device)
    scheduler = (
        call_accepting(instantiate(cfg.scheduler), optimizer, total_steps=total_steps) if cfg.scheduler else None
    )
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    autocast = autocast_for(device, precision)
    log.info(
        "rank %d/%d on %s: %s train / %s val samples, %s steps/epoch, %d steps",
        rank, world_size, device, _length(splits.train), _length(splits.val), steps_per_epoch, total_steps,
    )  # fmt: skip
    if rank == 0:
        warn_about_sizes(_length(splits.train), world_size, cfg.batch_size)
    step_model = torch.compile(wrapped) if cfg.compile else wrapped
    return Parts(splits, task, task_name, model, strategy, wrapped, step_model, loader, n_batches, epoch_samples,
                 total_steps, optimizer, scheduler, scaler, autocast, precision, channels_last, memory_format)  # fmt: skip


def train(cfg: Config, job: Job, device: torch.device, tracker: Any, resumed: Resumed | None, stop: Any) -> dict:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    p = build(cfg, job, device, resumed)
    task, loader, total_steps, optimizer = p.task, p.loader, p.total_steps, p.optimizer
    # Which way the objective (and each metric) is better, for the record: `ddpexp report` sorts by it. As the
    # parent resolved it, again on the task the ranks built; None (unknown: the parent warned) keeps no best.pt.
    objective = {
        "name": cfg.objective,
        "mode": objective_mode(task, cfg.objective, cfg.objective_mode, job.stated_mode),
    }
    # The task's metric names, on one val batch of each rank: a collision fails before step 1, not an epoch later.
    check_metric_names(task, p.model, p.splits.val, cfg.batch_size, device, p.autocast, p.memory_format, p.task_name,
                       p.strategy.lockstep)  # fmt: skip

    # Restore: the weights are in; now the optimizer, schedule, position, pending loss and (below) RNG streams.
    pos, final = Position(), {}
    if resumed is not None:
        restore(resumed, p.strategy, p.model, optimizer, p.scheduler, p.scaler)
        pos, final = resumed.position, dict(resumed.state.get("final", {}))
        where = f"sample {pos.samples}" if pos.samples is not None else f"batch {pos.batch}"
        log.info("rank %d resumed from %s: step %d, epoch %d, %s", rank, resumed.path, pos.step, pos.epoch, where)
    best = Best.restore(objective["mode"], resumed.state.get("best") if resumed is not None else None)
    if resumed is None and rank == 0:
        checkpoint.drop_best(job.checkpoint_dir)
    items = getattr(task, "items", "items") if hasattr(task, "count") else None
    meter = Meter(device, pos.last_log_step, items, total_steps, pos.step)
    meter.loss += resumed.state["loss_sum"] if resumed is not None else 0.0
    checkpointer = Checkpointer(cfg, job, p.strategy, p.model, optimizer, p.scheduler, p.scaler, tracker)
    control = dist.new_group(backend="gloo", timeout=timedelta(seconds=cfg.dist_timeout_s))
    agreement = distributed.StepAgreement(control, p.n_batches)
    debug = DebugFaults(cfg.debug, rank, resumed=resumed is not None)

    def save(position: Position, as_best: bool = False) -> str:
        meter.check_finite(cfg, job, position.step)  # never a checkpoint of weights that a NaN step has spoilt
        midway = None if as_best else debug.in_save(position.step)
        return checkpointer.save(position, meter.loss, final, best.state(), as_best, midway)

    # Epochs of optimizer steps.
    step, first_step_at, scored, stopped_early = pos.step, None, None, False
    epoch = pos.epoch - 1  # epochs run = epoch + 1, also when a finished run is resumed
    trained: list[int] = []  # samples trained per epoch, over all ranks (the resumed epoch: with its earlier part)
    for epoch in range(pos.epoch, cfg.epochs):
        if step >= total_steps:
            break
        skip, start = (pos.batch, pos.samples) if epoch == pos.epoch else (0, 0)
        loader.set_epoch(epoch, skip, start)
        if resumed is not None and epoch == pos.epoch and skip == 0:
            checkpoint.set_rng_state(resumed.state["rng"])
        batches = iter(loader)  # draws the loader's base seed from torch's RNG, as the uninterrupted run did
        if resumed is not None and epoch == pos.epoch and skip > 0:
            checkpoint.set_rng_state(resumed.state["rng"])  # after that draw, which it made before the checkpoint
        p.wrapped.train()
        # Micro-batches and samples (of the global order) of this epoch behind us; a step checkpoint left to its end.
        consumed, seen, due = skip, loader.order.start if p.epoch_samples is not None else None, False
        mine = 0  # samples this rank trained on in this epoch (this attempt)
        while step < total_steps:
            # One step: its micro-batches on the device, the ranks' agreement (stop? epoch over? how many samples?),
            # forward/backward of each, weighted by its share of the step's items, then the optimizer.
            drawn = list(itertools.islice(batches, cfg.grad_accum))
            group = [to_device(task, b, device, p.memory_format) for b, _, _ in drawn]
            sizes = [samples(b) if own is None else own for (_, own, _), b in zip(drawn, group)]
            ended, all_samples = agreement.before_step(stop.reason, len(group), sum(sizes))
            if ended:
                break
            consumed += len(group)
            if seen is not None:  # the global order: every rank knows the step's samples over all ranks
                all_samples = sum(total for _, _, total in drawn)
                seen += all_samples
            mine += sum(sizes)
            divisors, items = weights(task, p.task_name, group, sizes, all_samples, world_size)
            step += 1
            meter.add(optimizer_step(cfg, p, group, divisors), items, step)
            if p.scheduler is not None:
                p.scheduler.step()
            if first_step_at is None:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)  # the step has run, not just been queued
                first_step_at = time.time()
            reason = agreement.after_step()
            debug.after_step(step)
            tracker.progress(f"epoch {epoch} step {step}/{total_steps}")
            line = line_due(step, pos.step, cfg.log_every_n_steps, total_steps)
            if line == "log":
                final["train/loss"] = meter.log(cfg, job, tracker, optimizer, step, epoch)
            elif line == "started":  # the pace and ETA soon, even when an epoch is shorter than the log interval
                meter.started(step, epoch)
            if reason:  # after the step of the batches already drawn (augmentation draws RNG): a resume redoes none
                path = save(Position(epoch, consumed, step, meter.last[1], seen))
                raise Stopped(stop.signame or "a rank's stop signal", reason == REQUEUE, step, path)
            if cfg.checkpoint_every_n_steps and step % cfg.checkpoint_every_n_steps == 0 and step < total_steps:
                # At the epoch's last step it is written after the epoch's evaluation (below), so it holds it: a
                # run resumed from it neither records that evaluation again nor counts it twice for the patience.
                due = epoch_over(p, consumed, seen)
                if not due:
                    save(Position(epoch, consumed, step, meter.last[1], seen))

        # The epoch's end: an exact evaluation, then a checkpoint. Stopped by max_steps inside the epoch, the
        # checkpoint keeps that position, so a larger max_steps continues with the epoch's next batch.
        last_epoch = step >= total_steps or epoch == cfg.epochs - 1
        if step >= total_steps and not epoch_over(p, consumed, seen):
            position = Position(epoch, consumed, step, meter.last[1], seen)
        else:
            position = Position(epoch + 1, 0, step, meter.last[1], 0 if seen is not None else None)
        counted = torch.tensor(mine, dtype=torch.int64)
        dist.all_reduce(counted, group=control)  # once an epoch: the samples trained, each once, for the record
        trained.append(int(counted) + resumed_part(resumed, pos, epoch))
        if (epoch + 1) % cfg.eval_every_n_epochs == 0 or last_epoch:
            metrics, scored = evaluate(
                task, p.model, p.splits.val, cfg.batch_size, device, p.autocast, p.memory_format, p.task_name,
                lockstep=p.strategy.lockstep,
            )  # fmt: skip
            tracker.log(metrics, step, epoch)
            final.update(metrics)
            check_objective(cfg, final)
            sound = meter.check_metrics(cfg, job, metrics, step)  # weights a NaN step has spoilt are never the best
            log.info("epoch %d step %d: %s", epoch, step, " ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
            # The best evaluation and the patience, decided from the all-reduced metrics: the same on every rank.
            if best.update(final.get(cfg.objective) if sound else None, step, epoch, cfg.early_stop.min_delta):
                best.checkpoint = os.path.join(job.checkpoint_dir, checkpoint.BEST)
                save(position, as_best=True)
            best.check_agreement()
            stopped_early = best.should_stop(cfg.early_stop)
            if stopped_early:
                log.info("early stop at step %d: %s has not improved for %d evaluations (best %.6g at step %d)",
                         step, cfg.objective, best.since, best.value, best.step)  # fmt: skip
        every_n_epochs = cfg.checkpoint_every_n_epochs and (epoch + 1) % cfg.checkpoint_every_n_epochs == 0
        if last_epoch or stopped_early or due or every_n_epochs:
            save(position)
        if stopped_early:
            break

    result: dict[str, Any] = {"final": final, "objective": objective, "steps": step, "epochs": epoch + 1}
    result.update(best=best.record(), stopped_early=stopped_early)
    if cfg.early_stop.patience is not None:
        result["early_stop"] = best.early_stop_record(cfg.early_stop, step if stopped_early else None)
    result.update(directions=directions(task), val_samples=_length(p.splits.val))
    result.update(
        train_samples_per_epoch=trained, val_scored=scored, data_path=type(loader).__name__, precision=p.precision
    )
    result.update(channels_last=p.channels_last, **p.strategy.record())
    result["first_step_at"] = first_step_at  # unix time the first optimizer step of this attempt ended
    if cfg.debug.check_replicas:
        result["replicas"] = p.strategy.replicas(p.model)
    return result


def epoch_over(p: Parts, consumed: int, seen: int | None) -> bool:
    """Whether the epoch's micro-batches are all behind us: its samples of the global order (an IterableDataset:
    never known ahead, its epoch ends when a rank runs dry)."""
    if seen is not None and p.epoch_samples is not None:
        return seen >= p.epoch_samples
    return consumed >= (p.n_batches or sys.maxsize)


def optimizer_step(cfg: Config, p: Parts, group: list[Any], divisors: list[Any]) -> torch.Tensor:
    """Forward/backward over the micro-batches of one step (no all-reduce until the last), then step. Returns the
    step's loss on this rank (its items' share), on the device."""
    total = torch.zeros((), device=next(p.model.parameters()).device)
    for j, (batch, divisor) in enumerate(zip(group, divisors)):
        sync = j == len(group) - 1
        with p.strategy.micro_batch(sync), p.autocast:
            loss = check_loss(p.task.loss(p.step_model, batch), p.task_name) / divisor
        p.scaler.scale(loss).backward()
        total += loss.detach()
    if cfg.clip_grad_norm:
        p.scaler.unscale_(p.optimizer)
        p.strategy.clip_grad_norm(cfg.clip_grad_norm)
    p.scaler.step(p.optimizer)
    p.scaler.update()
    p.optimizer.zero_grad(set_to_none=True)
    return total


def _length(obj: Any) -> int | None:
    try:
        return len(obj)
    except TypeError:
        return None
