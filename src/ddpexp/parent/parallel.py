"""`sweep.parallel=N`: a basic sweep's jobs run N at once on this machine (a launcher whose SWEEP_PARALLEL is
"local": spawn, torchrun). Each job, once its checks passed, is a child process of the command (forked, so the
launcher needs nothing picklable) that takes its share of the devices (its GPUs by CUDA_VISIBLE_DEVICES, else its
CPU cores by affinity, which its ranks inherit and split into torch threads), then calls the launcher's `launch`
and waits on the handle, as the command does for a sequential sweep. The command waits for the oldest job when N
run, hands its first Ctrl-C/SIGTERM on to every running job once, starts no job after it, and waits for them all."""

from __future__ import annotations

import multiprocessing
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

from hydra.core.hydra_config import HydraConfig

from ddpexp.exceptions import ConfigError, Interrupted, RankFailure
from ddpexp.job import Job, read_json, write_json
from ddpexp.launchers.processes import STOP_SIGNALS, die_with_parent, forward_signals, stop_signals_blocked, terminate
from ddpexp.parent.command import Command
from ddpexp.parent.wait import first_failure, interrupted_message, record_failure, wait

LOCAL, SCHEDULER = "local", "scheduler"  # a launcher module's SWEEP_PARALLEL (launchers/base.py)


def devices(device: str) -> list[str]:
    """What a job's ranks take one each of: the visible GPUs' ids, or the CPU cores this command may run on."""
    if device == "cuda":
        import torch

        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
        ids = [d.strip() for d in visible.split(",") if d.strip()] if visible else []
        return ids[: torch.cuda.device_count()] or [str(i) for i in range(torch.cuda.device_count())]
    cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    return [str(c) for c in sorted(cores)]


def check(cfg: Any, launcher: Any, name: str, config: dict[str, Any]) -> str | None:
    """Refuse a `sweep.parallel` that cannot run as asked (ConfigError); a warning line where it is ignored."""
    n = cfg.sweep.parallel
    if n == 1:
        return None
    kind = getattr(launcher, "SWEEP_PARALLEL", None)
    if kind == SCHEDULER:
        return f"sweep.parallel={n}: ignored with launcher={name}, whose jobs run at once already (each its own job)"
    if kind != LOCAL:
        raise ConfigError(
            f"sweep.parallel={n}: launcher={name} does not run its ranks on this machine (its module sets no "
            f"SWEEP_PARALLEL = 'local'); use sweep.parallel=1, or launcher=spawn or torchrun"
        )
    if launcher.world_size(config) != cfg.gpus:
        raise ConfigError(
            f"sweep.parallel={n}: a job of launcher={name} spans several nodes here; use sweep.parallel=1"
        )
    port = fixed_port(cfg.launcher)
    if port is not None:
        raise ConfigError(
            f"sweep.parallel={n} with {port}: the jobs at once would all bind that port; leave the port free "
            "(null, or port 0) so that each job binds its own"
        )
    have = len(devices(cfg.device))
    if n * cfg.gpus > have:
        what = f"GPUs, {have} visible here" if cfg.device == "cuda" else f"CPU ranks, on {have} CPU core(s) here"
        raise ConfigError(
            f"sweep.parallel={n} x gpus={cfg.gpus}: {n * cfg.gpus} {what} (each job needs its own); "
            f"use sweep.parallel<={max(1, have // cfg.gpus)} or gpus<={max(1, have // n)}"
        )
    return None


def fixed_port(lc: Any) -> str | None:
    """The rendezvous port a launcher's config fixes, as `key=value`: spawn's master_port, torchrun's rdzv_endpoint
    (without a port it is c10d's default, 29400); None where each job binds a free one."""
    if getattr(lc, "master_port", None):
        return f"launcher.master_port={lc.master_port}"
    endpoint = getattr(lc, "rdzv_endpoint", None)
    if endpoint is not None and str(endpoint).rpartition(":")[2] != "0":
        return f"launcher.rdzv_endpoint={endpoint!r}"
    return None


def make_room(cmd: Command, cfg: Any, job: Job) -> None:
    """Wait until fewer than `sweep.parallel` jobs run; after a stop signal, for all of them, then raise."""
    if cmd.pool is None:
        cmd.pool = Pool(cfg.sweep.parallel, devices(cfg.device))
    pool: Pool = cmd.pool
    while len(pool.running) >= pool.n and not pool.forwarding.received:
        pool.wait_oldest(cmd)
    if pool.forwarding.received:  # stopped: no new job; this one's resume line is the sweep's
        pool.drain(cmd)
        raise Interrupted(interrupted_message(job, {"signal": pool.forwarding.received}))


def start(cmd: Command, launch: Callable[..., Any], worker: Callable[..., None], cfg: Any, job: Job, t0: float) -> None:
    """Start `job` in a child process with its share of the devices (make_room first)."""
    pool: Pool = cmd.pool
    slot = min(set(range(pool.n)) - {s for _, s in pool.running})
    share = pool.slots[slot][: cfg.gpus] if cfg.device == "cuda" else pool.slots[slot]
    with stop_signals_blocked():  # the child takes a signal only once it has set its own handlers
        process = multiprocessing.get_context("fork").Process(
            target=_job_process, args=(launch, worker, cfg, job, cfg.device, share, t0), name=f"ddpexp-{job.dir}"
        )
        process.start()
    handle = JobProcess(process, job, HydraConfig.get().job.num, t0)
    pool.running.append((handle, slot))
    cmd.deferred.append((job, handle, t0))


class JobProcess:
    """The Handle of a job running in a child process of the command: `wait` joins it, then raises the failure
    its run record names."""

    queued = False

    def __init__(self, process: Any, job: Job, num: int, t0: float):
        self.process, self.job, self.num, self.t0 = process, job, num, t0

    def wait(self) -> None:
        self.process.join()
        summary = read_json(self.job.summary_path) or {}
        if self.process.exitcode == 0 or summary.get("status") in ("completed", "interrupted"):
            return
        error = str(summary.get("error") or f"the job's process exited with code {self.process.exitcode}")
        rank = re.match(r"rank (\S+) failed: ", error)
        raise RankFailure(rank.group(1) if rank else "?", summary.get("error_detail") or error)


class Pool:
    """The jobs running at once (oldest first) and their device slots; from the first job's start until the
    command waited for the last, the command's first stop signal goes to every running job."""

    def __init__(self, n: int, have: list[str]):
        share = len(have) // n
        self.n, self.slots = n, [have[i * share : (i + 1) * share] for i in range(n)]
        self.running: list[tuple[JobProcess, int]] = []
        self.forwarding = forward_signals(self._forward).__enter__()

    def _forward(self, signum: int) -> None:
        terminate([handle.process.pid for handle, _ in self.running], signum)

    def wait_oldest(self, cmd: Command) -> None:
        handle, _ = self.running[0]
        try:
            self._wait(cmd, handle)
        except Interrupted:
            self.drain(cmd)
            raise

    def _wait(self, cmd: Command, handle: JobProcess) -> None:
        """As a sequential sweep's job: its result line, or its failure in one line and counted."""
        entry = next(e for e in cmd.deferred if e[1] is handle)
        cmd.deferred.remove(entry)
        try:
            wait(*entry)
        except RankFailure as e:
            line = str(e).splitlines()[0]
            cmd.failed.append(f"{handle.job.dir}: {line}")
            print(f"ddpexp: error: job {handle.num} failed: {line}", file=sys.stderr)
        finally:
            self.running = [(h, s) for h, s in self.running if h is not handle]

    def drain(self, cmd: Command) -> None:
        """Wait for every running job; then the first one that a signal stopped is raised (its resume line)."""
        stopped: Interrupted | None = None
        while self.running:
            try:
                self._wait(cmd, self.running[0][0])
            except Interrupted as e:
                stopped = stopped or e
        self.close()
        if stopped is not None:
            raise stopped

    def close(self) -> None:
        """The command ends: a job still running (a second Ctrl-C, an error) goes with it (its ranks die with it),
        its record saying so, as a sequential job's does."""
        self.forwarding.__exit__()
        for handle, _ in self.running:
            if handle.process.is_alive():
                handle.process.kill()
                handle.process.join(timeout=10)
                record_failure(handle.job, KeyboardInterrupt(), time.time() - handle.t0)
        self.running = []


class _Early(BaseException):
    """A stop signal in a job's process before its launcher set its own handlers: no rank has started."""


def _early(signum: int, frame: object) -> None:
    raise _Early(signal.Signals(signum).name)


def _job_process(
    launch: Callable[..., Any],
    worker: Callable[..., None],
    cfg: Any,
    job: Job,
    device: str,
    share: list[str],
    t0: float,
) -> None:
    """One job, in its own process: its devices, then the launcher's launch and wait, as the command does."""
    die_with_parent()
    os.setpgid(0, 0)  # out of the terminal's group: the command hands a Ctrl-C on, once
    for sig in STOP_SIGNALS:
        signal.signal(sig, _early)
    if device == "cuda":
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(share)
    else:
        os.sched_setaffinity(0, [int(c) for c in share])
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # one that came since the fork arrives here
        launch(worker, cfg, job).wait()
    except _Early as e:  # before the ranks started, or after they ended (a completed record stays so)
        earlier = read_json(job.summary_path) or {"launcher": job.launcher, "config_sha256": job.config_sha256}
        if earlier.get("status") == "completed":
            sys.exit(0)
        write_json(job.summary_path, {**earlier, "status": "interrupted", "signal": str(e)})
        sys.exit(130)
    except RankFailure as e:
        record_failure(job, first_failure(job, t0) or e, time.time() - t0)
        sys.exit(1)
    except KeyboardInterrupt as e:  # a second signal: the ranks stopped at once
        record_failure(job, e, time.time() - t0)
        sys.exit(130)
    except BaseException as e:
        record_failure(job, e, time.time() - t0)
        raise
