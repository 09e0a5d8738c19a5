"""One rank of a job: every launcher starts ranks with env:// variables and calls `main(cfg, job)` in each.

The worker owns the process around the loop (rank/train.py): logging, device, threads, the process group, the
checkpoint to resume from, the tracker, the run record and cleanup. It reads RANK / LOCAL_RANK / WORLD_SIZE /
LOCAL_WORLD_SIZE; what a launcher adds (restarts, a requeue hook) comes in the Job.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import socket
import subprocess
import sys
import time
import traceback
from typing import Any

import torch

from ddpexp.config import Config
from ddpexp.exceptions import ConfigError, NonFinite, Stopped
from ddpexp.job import Job, remove_partial, write_json
from ddpexp.rank import distributed, resume, speed
from ddpexp.rank.signals import StopSignals
from ddpexp.rank.tracking import NullTracker, Tracker
from ddpexp.rank.train import train

log = logging.getLogger("ddpexp")


def main(cfg: Config, job: Job) -> str:
    """The rank, to its end; returns the status it recorded (completed, interrupted, requeued); raises on failure."""
    stop = StopSignals(job.requeue_signal)
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    handlers = _setup_logging(job, rank)
    device = device_for(cfg, local_rank)
    quota = speed.cpu_quota()  # a container's CPU limit, in cores (None: none)
    threads = speed.limit_threads(int(os.environ.get("LOCAL_WORLD_SIZE", world_size)), quota)
    keep_freed = cfg.keep_freed_memory and speed.keep_freed_memory()
    distributed.init(device, cfg.dist_timeout_s)
    tracker: NullTracker = NullTracker()
    summary: dict[str, Any] = {"status": "failed", "launcher": job.launcher, "world_size": world_size}
    start = time.time()
    summary["started_at"] = round(start, 3)  # unix time: when this attempt's ranks began (a sweep's jobs overlap?)
    try:
        # Each rank hashes the config it received: a sweep's ranks must all train the parameters of their job.
        config_sha256 = hashlib.sha256(job.config_yaml.encode()).hexdigest()
        hosts = distributed.all_gather((socket.gethostname(), config_sha256, _affinity()))
        resumed = resume.load(cfg, job)
        if rank == 0:  # resume=PATH starts a new record and W&B run; the job's own checkpoint continues its own
            _remove_partial(job)
            own = resumed if resumed is not None and resumed.own else None
            tracker = Tracker(
                job, cfg.tracker, _config_dict(job), cfg.progress_bar,
                resume_step=own.position.step if own else None, states=_tracker_states(own.state) if own else None,
            )  # fmt: skip
        summary.update(device=str(device), hostnames=sorted({h for h, _, _ in hosts}), **_environment())
        summary["config_sha256_per_rank"] = [c for _, c, _ in hosts]
        summary["cpu_affinity_per_rank"] = [cores for _, _, cores in hosts]  # the cores each rank may run on
        summary.update(restarts=job.restarts, **job.record)
        if resumed is not None:
            summary["resumed_from"] = {"path": resumed.path, "step": resumed.position.step}
        summary["threads_per_rank"], summary["keep_freed_memory"] = threads, keep_freed
        summary["cpu_quota"] = quota  # the threads follow it
        summary.update(train(cfg, job, device, tracker, resumed, stop))
        summary["peak_rss_mb"] = distributed.peak_rss_mb()
        if device.type == "cuda":  # what the model, gradients and optimizer state took of each rank's GPU
            summary["peak_cuda_mb"] = distributed.all_gather(round(torch.cuda.max_memory_allocated(device) / 2**20, 1))
        summary["status"] = "completed"
    except Stopped as e:
        requeue = e.requeue and rank == 0 and job.requeue is not None
        summary.update(
            status="requeued" if requeue else "interrupted", signal=e.signal, steps=e.step, checkpoint=e.path
        )
        log.warning("%s: stopped at step %d, checkpoint %s", e.signal, e.step, e.path)
    except BaseException as e:
        # The traceback to this rank's log file only: the launcher shows the failing rank's once, not every echo.
        # A non-finite loss is no crash: its one line says all (every rank stopped at the same step); so does a
        # ConfigError (a task's metric name found on the ranks' first val batch), whose traceback the log keeps.
        if isinstance(e, NonFinite):
            log.error("%s", e)
        else:
            handlers[0].handle(
                log.makeRecord(log.name, logging.ERROR, __file__, 0, "rank %d failed", (rank,), sys.exc_info())
            )
        one_line = isinstance(e, (NonFinite, ConfigError))
        detail = f"{type(e).__name__}: {e}" if one_line else traceback.format_exc()
        summary["error"] = f"{type(e).__name__}: {e} (rank {rank})"
        write_json(job.error_path(rank), {"rank": rank, "time": time.time(), "traceback": detail})
        raise
    finally:
        summary["ended_at"] = round(time.time(), 3)
        summary["wall_time_s"] = round(summary["ended_at"] - start, 3)
        tracker.finish(summary)
        distributed.teardown()
        stop.restore()
        # Last: a scheduler ends the job's processes when it requeues it, so the record and W&B are closed first.
        if summary["status"] == "requeued" and not job.requeue():  # type: ignore[misc]
            write_json(job.summary_path, {**summary, "status": "interrupted"})
        for h in handlers:
            logging.getLogger("ddpexp").removeHandler(h)
            h.close()
        logging.getLogger("ddpexp").propagate = True  # the command's own lines, after an in-process rank
    return str(summary["status"])


def _tracker_states(state: dict[str, Any]) -> dict[str, Any]:
    """Each tracker's run to continue, as the checkpoint names it (one from before the tracker group: W&B's id)."""
    if "trackers" in state:
        return state["trackers"]
    return {"wandb": {"id": state.get("wandb_id")}}


def _affinity() -> list[int] | None:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None


def device_for(cfg: Config, local_rank: int) -> torch.device:
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if not use_cuda:
        return torch.device("cpu")
    torch.cuda.set_device(local_rank)
    torch.backends.cudnn.benchmark = True
    return torch.device("cuda", local_rank)


def _remove_partial(job: Job) -> None:
    """Before this attempt writes anything: the partial files that saves and records cut short left (a rank
    killed mid-save), each one checkpoint's size of disk that nothing else would ever free."""
    removed = remove_partial([job.checkpoint_dir, job.dir, os.path.join(job.dir, "eval")])
    if removed:
        names = ", ".join(os.path.relpath(p, job.dir) for p in removed)
        log.warning("removed %d partial file(s) of writes cut short: %s", len(removed), names)


def _setup_logging(job: Job, rank: int) -> list[logging.Handler]:
    """Each rank to logs/rank{N}.log, rank 0 also to stdout, in one format whether the rank runs in the command's
    own process (gpus=1: Hydra's handlers are there, and would print its lines a second time, in Hydra's format)
    or in a process of its own."""
    logger = logging.getLogger("ddpexp")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    os.makedirs(os.path.dirname(job.log_path(rank)), exist_ok=True)
    handlers: list[logging.Handler] = [logging.FileHandler(job.log_path(rank))]
    if rank == 0:
        handlers.append(logging.StreamHandler(sys.stdout))
    for h in handlers:
        h.setFormatter(logging.Formatter(f"[%(asctime)s][rank{rank}] %(message)s", "%H:%M:%S"))
        logger.addHandler(h)
    return handlers


def _config_dict(job: Job) -> dict[str, Any]:
    import yaml

    return yaml.safe_load(job.config_yaml)


def _environment() -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        git = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        sha = git.stdout.strip() if git.returncode == 0 else ""
    except (OSError, subprocess.TimeoutExpired):
        sha = ""
    versions = {"python": platform.python_version()}
    for pkg in ("torch", "torchvision", "hydra-core", "wandb", "ddpexp"):
        try:
            versions[pkg] = version(pkg)
        except PackageNotFoundError:
            versions[pkg] = None
    return {"versions": versions, "git_sha": sha or None, "ddpexp_path": _package_dir()}


def _package_dir() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this file is in ddpexp/rank/
