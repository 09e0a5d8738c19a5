"""What a run saves to continue exactly, and how it continues: its position (epoch, batches consumed, steps), the
weights, optimizer, schedule and scaler, every rank's RNG streams and pending loss sum, the best evaluation and
early stopping's count, the config and the trackers' run ids; and, at start, the choice of checkpoint."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ddpexp.config import Config
from ddpexp.exceptions import ConfigError
from ddpexp.job import Job
from ddpexp.rank import checkpoint, distributed

log = logging.getLogger("ddpexp")


@dataclass
class Position:
    """Where a run stands: the next batch to train on, as (epoch, micro-batches of it consumed, samples of its
    global order consumed), and steps taken."""

    epoch: int = 0
    batch: int = 0
    step: int = 0
    last_log_step: int = 0  # where the pending loss sum of the log interval started
    samples: int | None = None  # None: an IterableDataset's epoch, or a checkpoint from before the count


@dataclass
class Resumed:
    """A checkpoint chosen to continue from, as this rank needs it."""

    path: str
    own: bool  # this job's own checkpoint: its record and W&B run continue (resume=PATH starts new ones)
    position: Position
    state: dict[str, Any]  # model, optimizer (or sharded: the folder's), scheduler, scaler, final, best, trackers;
    # this rank's rng and loss_sum


class Checkpointer:
    """Saves everything an exact resume needs; every rank calls `save` (the RNG states are gathered), rank 0
    writes the file, or, for a sharded strategy, every rank its shards and rank 0 the rest."""

    def __init__(
        self, cfg: Config, job: Job, strategy: Any, model: Any, optimizer: Any, scheduler: Any, scaler: Any,
        tracker: Any,
    ) -> None:  # fmt: skip
        self.cfg, self.job, self.tracker, self.strategy = cfg, job, tracker, strategy
        self.model, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, scaler
        self.tmp_suffix = str(distributed.broadcast(os.getpid())) if strategy.sharded else ""

    def save(
        self, position: Position, pending_loss: torch.Tensor, final: dict[str, float], best: dict[str, Any],
        as_best: bool = False, midway: Callable[[], None] | None = None,
    ) -> str:  # fmt: skip
        """The next step-N.pt (rotated), or with `as_best` best.pt (kept). Returns its path on rank 0, else ''.
        `midway`: run once step-N.pt's bytes are written, before it is renamed (a test's fault)."""
        per_rank = distributed.all_gather((checkpoint.rng_state(), pending_loss.detach().cpu().clone()))
        shards = self.strategy.shards(self.model, self.optimizer) if self.strategy.sharded else None
        if dist.get_rank() != 0:
            if shards is not None:
                checkpoint.save_sharded(None, shards, self.job.checkpoint_dir, None if as_best else position.step,
                                        self.cfg.keep_last_checkpoints, self.tmp_suffix)  # fmt: skip
            return ""
        trackers = self.tracker.states()
        state = {
            **self.strategy.state(self.model, self.optimizer),  # ddp: the model and optimizer; fsdp2: nothing
            "strategy": self.cfg.strategy.name,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else None,
            "epoch": position.epoch,
            "batch_in_epoch": position.batch,
            "samples_in_epoch": position.samples,  # continues the same global order at any world size
            "step": position.step,
            "last_log_step": position.last_log_step,
            "world_size": dist.get_world_size(),
            "rng": [rng for rng, _ in per_rank],
            "loss_sum": [loss for _, loss in per_rank],
            "final": dict(final),
            "best": best,
            "config": self.job.config_yaml,
            "config_sha256": self.job.config_sha256,
            "trackers": trackers,  # each tracker's run to continue (W&B's id, MLflow's run id)
            "wandb_id": trackers.get("wandb", {}).get("id"),  # where a release before trackers read it
        }
        if shards is not None:
            return checkpoint.save_sharded(
                state, shards, self.job.checkpoint_dir, None if as_best else position.step,
                self.cfg.keep_last_checkpoints, self.tmp_suffix, None if as_best else midway,
            )  # fmt: skip
        if as_best:
            return checkpoint.save_best(state, self.job.checkpoint_dir)
        return checkpoint.save(state, self.job.checkpoint_dir, position.step, self.cfg.keep_last_checkpoints, midway)


def load(cfg: Config, job: Job) -> Resumed | None:
    """Rank 0 finds the checkpoint and tells the others: the job dir's own newest valid one (this attempt is a
    restart, a requeue, or the parent found it there), else the one the parent chose (`resume=PATH`), else none."""
    choice = None
    if dist.get_rank() == 0:
        choice = checkpoint.find_latest(job.checkpoint_dir) or job.resume_from
    choice = distributed.broadcast(choice)
    if choice is None:
        return None
    state = checkpoint.load(choice)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    saved_world = state.get("world_size", world_size)
    if saved_world != world_size and not cfg.resume_allow_config_change:
        raise ConfigError(
            f"resume: {choice} was written by {saved_world} ranks, this job has {world_size}; "
            "set resume_allow_config_change=true to continue anyway (the epoch's global order goes on)"
        )
    epoch, batch, seen = state["epoch"], state.get("batch_in_epoch", 0), state.get("samples_in_epoch")
    rng, pending = state["rng"], state.get("loss_sum")
    if isinstance(rng, dict):  # a checkpoint of rank 0's RNG only
        rng = [rng] * saved_world
    if seen is None and batch > 0 and rank == 0:  # the rule of before the count: micro-batches, the next epoch
        then = f"epoch {epoch + 1}'s start" if saved_world != world_size else f"micro-batch {batch} of epoch {epoch}"
        log.warning("warning: %s holds no sample count of its epoch (an IterableDataset's, or written before ddpexp"
                    " counted them): the job continues from %s", choice, then)  # fmt: skip
    if saved_world != world_size:  # the same global order goes on; each rank with rank 0's streams
        if seen is None and batch > 0:
            epoch, batch = epoch + 1, 0
        rng = [rng[0]] * world_size
        pending = [sum(pending) / world_size] * world_size if pending is not None else None
    state.update(rng=rng[rank], loss_sum=pending[rank] if pending is not None else 0.0)
    position = Position(epoch, batch, state["step"], state.get("last_log_step", state["step"]), seen)
    own = os.path.dirname(os.path.abspath(choice)) == os.path.abspath(job.checkpoint_dir)
    return Resumed(choice, own, position, state)


def restore(resumed: Resumed, strategy: Any, model: Any, optimizer: Any, scheduler: Any, scaler: Any) -> None:
    """Optimizer, schedule and scaler state; the strategy loads the optimizer's (and, sharded, the weights: a
    ddp run loaded them before DDP wrapped the model)."""
    strategy.restore(resumed, model, optimizer)
    if scheduler is not None and resumed.state.get("scheduler") is not None:
        scheduler.load_state_dict(resumed.state["scheduler"])
    if scaler.is_enabled() and resumed.state.get("scaler") is not None:
        scaler.load_state_dict(resumed.state["scaler"])
