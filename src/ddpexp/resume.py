"""What a run saves to continue exactly, and how it continues: the checkpoint's state (weights, optimizer, data
position, every rank's RNG and pending loss), the choice of checkpoint at start, and Slurm's requeue."""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
from typing import Any

import torch.distributed as dist

from ddpexp import checkpoint
from ddpexp.config import Config, ConfigError
from ddpexp.job import Job

log = logging.getLogger("ddpexp")


def save(
    cfg, job, model, optimizer, scheduler, scaler, tracker, epoch, batch_in_epoch, step, loss_sum, last_log_step, final
) -> str:  # type: ignore[no-untyped-def]
    """Everything an exact resume needs: weights, optimizer/scheduler/scaler, the data position (epoch, batches
    consumed in it), every rank's RNG states, the pending loss sum of the log interval, the config and W&B id."""
    per_rank: list[Any] = [None] * dist.get_world_size()  # each rank's RNG streams and pending loss sum
    dist.all_gather_object(per_rank, (checkpoint.rng_state(), loss_sum.detach().cpu().clone()))
    if dist.get_rank() != 0:
        return ""
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "scaler": scaler.state_dict() if scaler.is_enabled() else None,
        "epoch": epoch,
        "batch_in_epoch": batch_in_epoch,
        "step": step,
        "world_size": dist.get_world_size(),
        "rng": [rng for rng, _ in per_rank],
        "loss_sum": [loss for _, loss in per_rank],
        "last_log_step": last_log_step,
        "final": dict(final),
        "config": job.config_yaml,
        "config_sha256": hashlib.sha256(job.config_yaml.encode()).hexdigest(),
        "wandb_id": getattr(tracker, "wandb_id", None),
    }
    return checkpoint.save(state, job.checkpoint_dir, step, cfg.keep_last_checkpoints)


def load(cfg: Config, job: Job) -> dict[str, Any] | None:
    """Rank 0 picks the checkpoint (this job's newest valid one, else `resume=PATH`) and tells the others."""
    choice: list[str | None] = [None]
    if dist.get_rank() == 0 and cfg.resume != "never":
        choice[0] = checkpoint.find_latest(job.checkpoint_dir)
        if choice[0] is None and cfg.resume != "auto":
            choice[0] = checkpoint.resolve(cfg.resume)
    dist.broadcast_object_list(choice, src=0)
    if choice[0] is None:
        return None
    state = checkpoint.load(choice[0])
    if state.get("world_size", dist.get_world_size()) != dist.get_world_size() and not cfg.resume_allow_config_change:
        raise ConfigError(
            f"resume: {choice[0]} was written by {state['world_size']} ranks, this job has {dist.get_world_size()}; "
            "set resume_allow_config_change=true to continue anyway (from the next epoch)"
        )
    if state.get("world_size", dist.get_world_size()) != dist.get_world_size():
        state.update(epoch=state["epoch"] + (state.get("batch_in_epoch", 0) > 0), batch_in_epoch=0)
        state["rng"] = [state["rng"][0]] * dist.get_world_size()
        state["loss_sum"] = [sum(state["loss_sum"]) / dist.get_world_size()] * dist.get_world_size()
    if isinstance(state["rng"], dict):  # a checkpoint of rank 0's RNG only
        state["rng"] = [state["rng"]] * dist.get_world_size()
    state["path"] = choice[0]
    state["own"] = os.path.dirname(os.path.abspath(choice[0])) == os.path.abspath(job.checkpoint_dir)
    return state


def requeue() -> bool:
    """Slurm: put this job back in the queue (same job id, same job dir: it resumes from the checkpoint)."""
    job_id = os.environ.get("SLURM_ARRAY_JOB_ID", os.environ.get("SLURM_JOB_ID"))
    if job_id and "SLURM_ARRAY_TASK_ID" in os.environ:
        job_id = f"{job_id}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    if not job_id:
        return False
    done = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True)
    if done.returncode != 0:
        log.error("scontrol requeue %s failed: %s", job_id, done.stderr.strip())
        return False
    log.warning("requeued Slurm job %s; it resumes from the checkpoint", job_id)
    return True
