"""The parent's wait for a started job: its handle waited on, then its run record read: the one-line result, a
failure recorded and raised (RankFailure), or the resume line after a signal (Interrupted)."""

from __future__ import annotations

import glob
import os
import shlex
import sys
import time
from typing import Any

import yaml
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode

from ddpexp.exceptions import Interrupted, RankFailure
from ddpexp.job import Job, read_json, write_json
from ddpexp.launchers.base import Handle, tail
from ddpexp.parent.command import Command


def wait(job: Job, handle: Handle, start: float) -> float | None:
    """Until the job's ranks ended: a failure (or a second Ctrl-C) is recorded in the job's summary.json, by the
    command that reports the job (launcher=env: each rank is a command, rank 0's reports)."""
    if not getattr(handle, "reports", True):
        handle.wait()
        print(f"ddpexp: this rank finished in {time.time() - start:.1f}s; rank 0's command reports the job")
        return None
    try:
        handle.wait()
    except RankFailure as e:
        raise record_failure(job, e if e.died else first_failure(job, start) or e, time.time() - start) from None
    except BaseException as e:  # a signal: where a peer rank raised first (torchrun then stops the rest), that peer
        record_failure(job, first_failure(job, start) or e, time.time() - start)
        raise
    return finish(job, start)


def wait_deferred(cmd: Command) -> None:
    """After a multirun's submissions: wait for each job; the failed ones join `cmd.failed` as "job_dir: error".
    The jobs running at once here (sweep.parallel) are all waited for first, even after one stopped on a signal."""
    if cmd.pool is not None:
        cmd.pool.drain(cmd)
    deferred = cmd.deferred
    while deferred:
        job, handle, start = deferred.pop(0)
        try:
            wait(job, handle, start)
        except RankFailure as e:
            cmd.failed.append(f"{job.dir}: {str(e).splitlines()[0]}")
            print(f"ddpexp: error: job {job.dir}: {e}", file=sys.stderr)


def finish(job: Job, start: float) -> float | None:
    summary = read_json(job.summary_path)
    if summary is None:  # multi-node: global rank 0, and with it the run record, is on another node
        print(f"ddpexp: this node's ranks finished in {time.time() - start:.1f}s; rank 0 holds the run record")
        return None
    stopped = summary.get("status") in ("interrupted", "requeued") or _signalled(summary)
    if stopped and (peer := first_failure(job, start)):  # torchrun stops the other ranks when one raised
        raise record_failure(job, peer, time.time() - start)
    if stopped:
        raise Interrupted(interrupted_message(job, summary))
    if summary.get("status") != "completed":
        raise RankFailure(summary.get("error", "?").rsplit("(", 1)[-1].rstrip(")"), summary.get("error", "no summary"))
    final = summary.get("final", {})
    ordered = sorted(final.items(), key=lambda kv: kv[0] != "train/loss")  # train/loss, then the task's metrics
    metrics = " ".join(f"{k}={v:.4f}" if isinstance(v, (int, float)) else f"{k}={v}" for k, v in ordered)
    early = f", stopped early at step {summary.get('steps')}" if summary.get("stopped_early") else ""
    print(f"ddpexp: {summary.get('status', 'finished')} in {time.time() - start:.1f}s{early}: {metrics} -> {job.dir}")
    return final.get(yaml.safe_load(job.config_yaml).get("objective", "val/acc"))


def _signalled(summary: dict[str, Any]) -> bool:
    return summary.get("status") == "failed" and "SignalException" in str(summary.get("error", ""))


def interrupted_message(job: Job, summary: dict[str, Any]) -> str:
    """The line a stopped job ends with: where it stopped and the exact command that continues it."""
    where = f"at step {summary['steps']}" if "steps" in summary else "before its first step"
    ckpt = f"checkpoint {summary['checkpoint']}" if summary.get("checkpoint") else "no checkpoint written"
    again = [a for a in job.command if not a.startswith(("hydra.run.dir=", "hydra.sweep.dir="))]
    hc = HydraConfig.get()
    where_dir = f"hydra.sweep.dir={hc.sweep.dir}" if hc.mode == RunMode.MULTIRUN else f"hydra.run.dir={job.dir}"
    command = shlex.join(["python", "-m", "ddpexp", *again, where_dir])
    if summary.get("started_by"):  # each rank is a command that another launcher started: it starts them again
        command = f"the same launch ({summary['started_by']}), each rank's ddpexp given {shlex.quote(where_dir)}"
    return f"interrupted by {summary.get('signal', 'a signal')} {where}, {ckpt}; resume with: {command}"


def first_failure(job: Job, since: float) -> RankFailure | None:
    """The rank that failed first, from the error files ranks write (a launcher sees whichever it polls first);
    `since`: this command's start (an earlier attempt's files, before a restart, are not this one's)."""
    records = [read_json(p) for p in glob.glob(os.path.join(job.dir, "logs", "rank*.error.json"))]
    records = [r for r in records if r and r.get("time", 0) >= since]
    if not records:
        return None
    first = min(records, key=lambda r: r["time"])
    return RankFailure(first["rank"], tail(first["traceback"]))


def record_failure(job: Job, error: BaseException, wall_time_s: float) -> BaseException:
    """The parent has the last word on a failed job: a rank killed before writing its summary leaves none."""
    summary: dict[str, Any] = read_json(job.summary_path) or {"launcher": job.launcher}
    first = str(error).splitlines()[0] if str(error) else type(error).__name__
    summary.update(status="failed", error=first, wall_time_s=round(wall_time_s, 3))
    summary.setdefault("config_sha256", job.config_sha256)
    if isinstance(error, RankFailure):
        summary["error_detail"] = error.detail
    write_json(job.summary_path, summary)
    return error
