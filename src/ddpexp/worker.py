"""The one DDP train loop: every launcher starts ranks with env:// variables and calls `main(cfg, job)` in each.

The worker owns the process group, seeding, data, model, optimizer, the loop, evaluation, checkpoints and
tracking; it reads RANK / LOCAL_RANK / WORLD_SIZE / LOCAL_WORLD_SIZE and nothing launcher-specific.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import platform
import random
import socket
import subprocess
import sys
import time
import traceback
from contextlib import nullcontext
from datetime import timedelta
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hydra.utils import instantiate
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpexp import checkpoint, data, speed
from ddpexp import resume as resume_mod
from ddpexp.config import Config
from ddpexp.faults import REQUEUE, DebugFaults, StopSignals, detach_from_terminal, die_with_parent
from ddpexp.inmemory import eval_batches
from ddpexp.job import Job, write_json
from ddpexp.optim import build_optimizer, call_accepting
from ddpexp.tracking import NullTracker, Tracker

log = logging.getLogger("ddpexp")


def main(cfg: Config, job: Job) -> None:
    die_with_parent()
    if job.launcher != "slurm":  # a Slurm task stays in its step's process group: slurmstepd tracks it there
        detach_from_terminal()
    stop = StopSignals(os.environ.get("DDPEXP_REQUEUE_SIGNAL"))
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    handlers = _setup_logging(job, rank)
    device = _device(cfg, local_rank)
    threads = speed.limit_threads(int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    keep_freed = cfg.keep_freed_memory and speed.keep_freed_memory()
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method="env://",
        timeout=timedelta(seconds=cfg.dist_timeout_s),
        device_id=device if device.type == "cuda" else None,
    )
    tracker: NullTracker = NullTracker()
    summary: dict[str, Any] = {"status": "failed", "launcher": job.launcher, "world_size": world_size}
    start = time.time()
    try:
        hosts: list[Any] = [None] * world_size
        dist.all_gather_object(hosts, (socket.gethostname(), hashlib.sha256(job.config_yaml.encode()).hexdigest()))
        resume = resume_mod.load(cfg, job)
        if rank == 0:
            own = resume if resume is not None and resume["own"] else None  # resume=PATH: a new record, new W&B run
            tracker = Tracker(job, cfg.wandb, _config_dict(job), cfg.progress_bar, own)
        summary.update(device=str(device), hostnames=sorted({h for h, _ in hosts}), **_environment())
        summary["config_sha256_per_rank"] = [c for _, c in hosts]
        summary["restarts"] = int(
            os.environ.get("TORCHELASTIC_RESTART_COUNT", os.environ.get("SLURM_RESTART_COUNT", 0))
        )
        if "SLURM_JOB_ID" in os.environ:
            summary["slurm"] = {k: os.environ.get(f"SLURM_{k.upper()}") for k in ("job_id", "job_nodelist", "ntasks")}
        if resume is not None:
            summary["resumed_from"] = {"path": resume["path"], "step": resume["step"]}
        summary["threads_per_rank"], summary["keep_freed_memory"] = threads, keep_freed
        summary.update(train(cfg, job, device, tracker, resume, stop))
        summary["peak_rss_mb"] = _peak_rss_mb()
        summary["status"] = "completed"
    except Interrupted as e:
        requeue = e.requeue and rank == 0 and "SLURM_JOB_ID" in os.environ
        summary.update(
            status="requeued" if requeue else "interrupted", signal=e.signal, steps=e.step, checkpoint=e.path
        )
        log.warning("%s: stopped at step %d, checkpoint %s", e.signal, e.step, e.path)
    except BaseException as e:
        # The traceback to this rank's log file only: the launcher shows the failing rank's once, not every echo.
        handlers[0].handle(
            log.makeRecord(log.name, logging.ERROR, __file__, 0, "rank %d failed", (rank,), sys.exc_info())
        )
        summary["error"] = f"{type(e).__name__}: {e} (rank {rank})"
        write_json(job.error_path(rank), {"rank": rank, "time": time.time(), "traceback": traceback.format_exc()})
        raise
    finally:
        summary["wall_time_s"] = round(time.time() - start, 3)
        tracker.finish(summary)
        dist.destroy_process_group()
        stop.restore()
        # Last: Slurm ends the job's processes when it requeues it, so the record and W&B are closed first.
        if summary["status"] == "requeued" and not resume_mod.requeue():
            write_json(job.summary_path, {**summary, "status": "interrupted"})
        for h in handlers:
            logging.getLogger("ddpexp").removeHandler(h)
            h.close()


class Interrupted(Exception):
    """A stop signal, agreed on by every rank at a step boundary, after the checkpoint was written."""

    def __init__(self, signal: str, requeue: bool, step: int, path: str):
        super().__init__(f"{signal} at step {step}")
        self.signal, self.requeue, self.step, self.path = signal, requeue, step, path


class StepAgreement:
    """Every rank learns whether any rank was asked to stop (then all checkpoint after the same step) and, when
    shards may be uneven, whether any rank ran out of batches (then all end the epoch): one tiny CPU all-reduce
    per step. Without it, a rank that stops alone leaves the others in a collective.

    With equal shards (every rank's loader has the same length: DistributedSampler pads), nobody runs dry alone,
    so the stop flags are all-reduced in the background during the step and read after it: the same decision,
    without a second rendezvous per step (a blocking one cost 2-4 % of a 2-rank CPU step here)."""

    def __init__(self, group: Any, n_batches: int | None):
        self.group = group
        n = -1 if n_batches is None else n_batches
        lengths = torch.tensor([n, -n], dtype=torch.int64)
        dist.all_reduce(lengths, op=dist.ReduceOp.MAX, group=group)  # [max, -min] over the ranks
        self.even = n_batches is not None and int(lengths[0]) == -int(lengths[1])
        self.flags, self.work, self.reason = torch.zeros(2, dtype=torch.int32), None, 0

    def before_step(self, reason: int, exhausted: bool) -> bool:
        """Post this rank's flags; True when the epoch ends here (for every rank)."""
        if self.even and exhausted:
            return True  # every rank ran dry at this same batch
        self.flags[0], self.flags[1] = reason, int(exhausted)
        self.work = dist.all_reduce(self.flags, op=dist.ReduceOp.MAX, group=self.group, async_op=self.even)
        if not self.even:
            self.reason, self.work = int(self.flags[0]), None
        return bool(self.flags[1])

    def after_step(self) -> int:
        """The stop reason agreed for the step just taken (0: go on)."""
        if self.work is not None:
            self.work.wait()
            self.reason, self.work = int(self.flags[0]), None
        return self.reason


def train(cfg: Config, job: Job, device: torch.device, tracker: NullTracker, resume: dict | None, stop) -> dict:  # type: ignore[no-untyped-def]
    rank, world_size = dist.get_rank(), dist.get_world_size()
    # Same seed everywhere so every replica starts from the same weights (DDP also broadcasts them).
    _seed(cfg.seed)
    splits = instantiate(cfg.data)
    model = call_accepting(
        instantiate(cfg.model, _partial_=True),
        num_classes=splits.num_classes, in_channels=splits.in_channels, image_size=splits.image_size,
    ).to(device)  # fmt: skip
    precision, channels_last = speed.speed_defaults(cfg, device, model)
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    model = model.to(memory_format=memory_format)
    if cfg.ddp.sync_batchnorm:
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    if resume is not None:
        model.load_state_dict(resume["model"])
    ddp = DDP(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        find_unused_parameters=cfg.ddp.find_unused_parameters,
        static_graph=cfg.ddp.static_graph,
        gradient_as_bucket_view=cfg.ddp.gradient_as_bucket_view,
        bucket_cap_mb=cfg.ddp.bucket_cap_mb,
    )
    step_model = torch.compile(ddp) if cfg.compile else ddp
    _seed(cfg.seed + rank)  # per-rank streams for anything random after this point (dropout, augmentation)

    loader = data.train_loader(splits, cfg, rank, world_size, device)
    try:
        n_batches: int | None = len(loader)
    except TypeError:  # an IterableDataset: epochs end when the first rank runs dry
        n_batches = None
    steps_per_epoch = -(-n_batches // cfg.grad_accum) if n_batches is not None else None
    total_steps = min(cfg.max_steps or sys.maxsize, cfg.epochs * (steps_per_epoch or sys.maxsize))
    optimizer = build_optimizer(instantiate(cfg.optimizer), ddp.parameters(), device)
    scheduler = (
        call_accepting(instantiate(cfg.scheduler), optimizer, total_steps=total_steps) if cfg.scheduler else None
    )
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    autocast = torch.autocast(
        device.type, dtype=torch.bfloat16 if precision == "bf16" else torch.float16, enabled=precision != "fp32"
    )
    log.info(
        "rank %d/%d on %s: %d train / %d val samples, %s steps/epoch, %d steps",
        rank, world_size, device, _len(splits.train), len(splits.val), steps_per_epoch, total_steps,
    )  # fmt: skip

    step, final, first_step_at = 0, {}, None
    loss_sum = torch.zeros((), device=device)
    last_log = (time.perf_counter(), 0)  # (time, step) of the last log line
    start_epoch, start_batch = 0, 0
    if resume is not None:
        optimizer.load_state_dict(resume["optimizer"])
        if scheduler is not None and resume.get("scheduler") is not None:
            scheduler.load_state_dict(resume["scheduler"])
        if scaler.is_enabled() and resume.get("scaler") is not None:
            scaler.load_state_dict(resume["scaler"])
        step, final = resume["step"], dict(resume.get("final", {}))
        start_epoch, start_batch = resume["epoch"], resume.get("batch_in_epoch", 0)
        loss_sum += resume["loss_sum"][rank] if "loss_sum" in resume else 0.0
        last_log = (time.perf_counter(), resume.get("last_log_step", step))
        log.info(
            "rank %d resumed from %s: step %d, epoch %d, batch %d", rank, resume["path"], step, start_epoch, start_batch
        )
    save = partial(resume_mod.save, cfg, job, model, optimizer, scheduler, scaler, tracker)
    # The per-step agreement stays on the CPU, off the GPU's stream; new_group's default timeout is 30 min.
    control = dist.new_group(backend="gloo", timeout=timedelta(seconds=cfg.dist_timeout_s))
    agreement = StepAgreement(control, n_batches)
    debug = DebugFaults(cfg.debug, rank, resumed=resume is not None)

    epoch = start_epoch - 1  # epochs run = epoch + 1, also when a finished run is resumed
    for epoch in range(start_epoch, cfg.epochs):
        if step >= total_steps:
            break
        skip = start_batch if epoch == start_epoch else 0
        loader.set_epoch(epoch, skip)
        if resume is not None and epoch == start_epoch and skip == 0:
            checkpoint.set_rng_state(resume["rng"][rank])
        batches = iter(loader)  # draws the loader's base seed from torch's RNG, as the uninterrupted run did
        if resume is not None and epoch == start_epoch and skip > 0:
            checkpoint.set_rng_state(resume["rng"][rank])  # after that draw, which it made before the checkpoint
        ddp.train()
        consumed = skip  # micro-batches of this epoch behind us
        while step < total_steps:
            group = [
                (x.to(device, non_blocking=True, memory_format=memory_format), y.to(device, non_blocking=True))
                for x, y in itertools.islice(batches, cfg.grad_accum)
            ]
            if agreement.before_step(stop.reason, exhausted=not group):
                break
            consumed += len(group)
            loss_sum += _optimizer_step(cfg, step_model, ddp, optimizer, scaler, autocast, group)
            if scheduler is not None:
                scheduler.step()
            step += 1
            if first_step_at is None:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)  # the step has run, not just been queued
                first_step_at = time.time()
            reason = agreement.after_step()
            debug.after_step(step)
            tracker.progress(f"epoch {epoch} step {step}/{total_steps}")
            if step % cfg.log_every_n_steps == 0 or step == total_steps:
                final["train/loss"], last_log = _log_train(cfg, tracker, optimizer, loss_sum, step, epoch, last_log)
                loss_sum.zero_()
            if reason:  # after the step of the batches already drawn (augmentation draws RNG): a resume redoes none
                path = save(epoch, consumed, step, loss_sum, last_log[1], final)
                raise Interrupted(stop.signame or "a rank's stop signal", reason == REQUEUE, step, path)
            if cfg.checkpoint_every_n_steps and step % cfg.checkpoint_every_n_steps == 0 and step < total_steps:
                save(epoch, consumed, step, loss_sum, last_log[1], final)
        last_epoch = step >= total_steps or epoch == cfg.epochs - 1
        # Stopped by max_steps inside the epoch: the checkpoint keeps that position, so a larger max_steps
        # continues with the epoch's next batch, as an uninterrupted run would.
        position = (
            (epoch, consumed) if step >= total_steps and consumed < (n_batches or sys.maxsize) else (epoch + 1, 0)
        )
        if (epoch + 1) % cfg.eval_every_n_epochs == 0 or last_epoch:
            metrics = evaluate(model, splits.val, cfg.batch_size, device, autocast, memory_format)
            tracker.log(metrics, step, epoch)
            final.update(metrics)
            log.info(
                "epoch %d step %d: val/loss %.4f val/acc %.4f", epoch, step, metrics["val/loss"], metrics["val/acc"]
            )
        if last_epoch or (cfg.checkpoint_every_n_epochs and (epoch + 1) % cfg.checkpoint_every_n_epochs == 0):
            save(*position, step, loss_sum, last_log[1], final)

    result: dict[str, Any] = {"final": final, "steps": step, "epochs": epoch + 1, "val_samples": len(splits.val)}
    result.update(data_path=type(loader).__name__, precision=precision, channels_last=channels_last)
    result["ddp_buckets"] = _bucket_sizes(ddp)
    result["first_step_at"] = first_step_at  # unix time the first optimizer step of this attempt ended
    if cfg.debug.check_replicas:
        result["replicas"] = _compare_replicas(model)
    return result


def _bucket_sizes(ddp: DDP) -> list[int] | None:
    """DDP's gradient buckets in bytes, in all-reduce order, as rebuilt after the first step (None if unknown)."""
    try:
        data = ddp._get_ddp_logging_data()  # private, but the one place DDP tells
    except (AttributeError, RuntimeError):
        return None
    sizes = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes")
    return [int(s) for s in str(sizes).split(",")] if sizes else None


def _optimizer_step(cfg, step_model, ddp, optimizer, scaler, autocast, group) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Forward/backward over the micro-batches of one step (no all-reduce until the last), then step."""
    total = torch.zeros((), device=group[0][0].device)
    for j, (x, y) in enumerate(group):
        sync = j == len(group) - 1
        with nullcontext() if sync else ddp.no_sync(), autocast:
            loss = F.cross_entropy(step_model(x), y) / len(group)
        scaler.scale(loss).backward()
        total += loss.detach()
    if cfg.clip_grad_norm:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), cfg.clip_grad_norm)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return total


def _log_train(cfg, tracker, optimizer, loss_sum, step, epoch, last_log):  # type: ignore[no-untyped-def]
    """The only host sync of the train loop: once per log interval, on every rank (an all-reduce)."""
    reduced = loss_sum.clone()
    dist.all_reduce(reduced)
    steps = step - last_log[1]
    loss = reduced.item() / (steps * dist.get_world_size())
    now = time.perf_counter()
    samples = steps * cfg.grad_accum * cfg.batch_size * dist.get_world_size()
    metrics = {
        "train/loss": loss,
        "lr": optimizer.param_groups[0]["lr"],
        "samples_per_s": samples / (now - last_log[0]),
    }
    tracker.log(metrics, step, epoch)
    log.info("epoch %d step %d: train/loss %.4f lr %.3g samples/s %.0f", epoch, step, *metrics.values())
    return loss, (now, step)


@torch.no_grad()
def evaluate(model, dataset, batch_size, device, autocast, memory_format=torch.contiguous_format) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """Exact evaluation: rank r scores samples r, r+N, ... (each sample once, no padding), then sums are reduced.

    Runs on the unwrapped module: DDP's forward would broadcast buffers, a collective that hangs when the
    ranks hold different numbers of batches. So rank 0's buffers (BatchNorm's running stats, which each rank
    updated from its own last batch) are broadcast first, as DDP's next forward would: every rank scores the
    model the checkpoint holds. Evaluation draws nothing from the training RNG streams (a DataLoader draws its
    seed), so a run resumed after it continues exactly as one that never stopped there."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    for buffer in model.buffers():
        dist.broadcast(buffer, 0)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        return _evaluate(model, dataset, batch_size, device, autocast, memory_format, rank, world_size)


def _evaluate(model, dataset, batch_size, device, autocast, memory_format, rank, world_size) -> dict[str, float]:  # type: ignore[no-untyped-def]
    was_training = model.training
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, count
    for x, y in eval_batches(dataset, rank, world_size, batch_size, device):
        x, y = x.to(device, memory_format=memory_format), y.to(device)
        with autocast:
            out = model(x)
        sums[0] += F.cross_entropy(out.float(), y, reduction="sum")
        sums[1] += (out.argmax(1) == y).sum()
        sums[2] += len(y)
    dist.all_reduce(sums)
    model.train(was_training)
    loss, correct, count = sums.tolist()
    return {"val/loss": loss / count, "val/acc": correct / count}


def _compare_replicas(model: torch.nn.Module) -> dict[str, Any]:
    """All-gather every rank's flattened parameters and compare them with rank 0's."""
    flat = torch.cat([p.detach().flatten().float() for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    diff = max((g - gathered[0]).abs().max().item() for g in gathered)
    return {"identical": diff == 0.0, "max_abs_diff": diff, "numel": flat.numel()}


def _device(cfg: Config, local_rank: int) -> torch.device:
    use_cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if not use_cuda:
        return torch.device("cpu")
    torch.cuda.set_device(local_rank)
    torch.backends.cudnn.benchmark = True
    return torch.device("cuda", local_rank)


def _peak_rss_mb() -> list[float]:
    """Every rank's peak resident memory (MB), gathered to all."""
    import resource

    mine = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, round(mine, 1))
    return every


def _seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _setup_logging(job: Job, rank: int) -> list[logging.Handler]:
    logger = logging.getLogger("ddpexp")
    logger.setLevel(logging.INFO)
    os.makedirs(os.path.dirname(job.log_path(rank)), exist_ok=True)
    handlers: list[logging.Handler] = [logging.FileHandler(job.log_path(rank))]
    if rank == 0 and not logging.getLogger().handlers:  # a spawned process: Hydra's console handler is not here
        handlers.append(logging.StreamHandler(sys.stdout))
    for h in handlers:
        h.setFormatter(logging.Formatter(f"[%(asctime)s][rank{rank}] %(message)s", "%H:%M:%S"))
        logger.addHandler(h)
    return handlers


def _len(dataset: Any) -> int | str:
    try:
        return len(dataset)
    except TypeError:
        return "?"


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
    return {"versions": versions, "git_sha": sha or None, "ddpexp_path": os.path.dirname(os.path.abspath(__file__))}
