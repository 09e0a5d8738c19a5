"""Rank 0's tracker: the local run record (metrics.jsonl, summary.json) and one W&B run; a no-op elsewhere."""

from __future__ import annotations

import json
import logging
import netrc
import os
import sys
from typing import Any

from ddpexp.config import WandbConfig
from ddpexp.job import Job, finite, write_json

log = logging.getLogger("ddpexp")


class NullTracker:
    """What ranks other than 0 get, so the loop never needs `if rank == 0` around logging."""

    def log(self, metrics: dict[str, float], step: int, epoch: int) -> None:
        pass

    def progress(self, text: str) -> None:
        pass

    def finish(self, summary: dict[str, Any]) -> None:
        pass


class Tracker(NullTracker):
    def __init__(
        self,
        job: Job,
        wandb_cfg: WandbConfig,
        config: dict[str, Any],
        progress_bar: bool,
        resume_step: int | None = None,
        wandb_id: str | None = None,
    ):
        self.job = job
        # Resuming from step s: the lines after s go (the resumed run writes them again, identically), while W&B,
        # which cannot rewrite history, gets nothing up to the last step it already has.
        if resume_step is not None:
            self.logged_until = truncate_metrics(job.metrics_path, resume_step)
        else:  # a fresh start redoes an earlier attempt of this config that left no checkpoint (the parent checked)
            truncate_metrics(job.metrics_path, -1)
            self.logged_until = -1
        self.metrics = open(job.metrics_path, "a", buffering=1)
        self.tty = progress_bar and sys.stderr.isatty()
        self.run, self.wandb_info = init_wandb(wandb_cfg, job, config, wandb_id)
        self.wandb_id = self.wandb_info["id"]

    def log(self, metrics: dict[str, float], step: int, epoch: int) -> None:
        self.metrics.write(json.dumps(finite({"step": step, "epoch": epoch, **metrics}), allow_nan=False) + "\n")
        if self.run is not None and step > self.logged_until:
            try:
                self.run.log({**metrics, "epoch": epoch}, step=step)
            except Exception as e:  # e.g. its service got the job's SIGTERM: the local record goes on alone
                self._lost(e)

    def _lost(self, e: Exception) -> None:
        log.warning("W&B failed (%s: %s); metrics go on to %s only", type(e).__name__, e, self.job.metrics_path)
        self.run, self.wandb_info = None, {**self.wandb_info, "failed": f"{type(e).__name__}: {e}"}
        try:  # let go of the dead service now, not in a noisy atexit hook
            import wandb

            wandb.teardown()
        except Exception:
            pass

    def progress(self, text: str) -> None:
        if self.tty:
            sys.stderr.write(f"\r{text}\033[K")
            sys.stderr.flush()

    def finish(self, summary: dict[str, Any]) -> None:
        if self.tty:
            sys.stderr.write("\n")
        summary = {**summary, "wandb": self.wandb_info}
        write_json(self.job.summary_path, summary)
        self.metrics.close()
        if self.run is not None:
            try:
                self.run.summary.update({"status": summary["status"], **summary.get("final", {})})
                self.run.finish(exit_code=0 if summary["status"] == "completed" else 1)
            except Exception as e:  # a tracker failure must never turn a finished run into a failed one
                log.warning("W&B finish failed: %s", e)


def truncate_metrics(path: str, step: int) -> int:
    """Keep metrics.jsonl's lines up to `step`; return the last step it held (what W&B has seen too)."""
    try:
        with open(path) as f:
            rows = [line for line in f if line.strip()]
    except FileNotFoundError:
        return -1
    steps = [json.loads(line)["step"] for line in rows]
    with open(f"{path}.tmp", "w") as f:
        f.writelines(line for line, s in zip(rows, steps) if s <= step)
    os.replace(f"{path}.tmp", path)
    return max(steps, default=-1)


def has_api_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("://")[-1]
        return netrc.netrc().authenticators(host) is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


def init_wandb(
    cfg: WandbConfig, job: Job, config: dict[str, Any], run_id: str | None = None
) -> tuple[Any | None, dict[str, Any]]:
    """Start the job's W&B run. Failing online falls back to offline, failing offline to disabled: never raise."""
    mode = cfg.mode
    if mode == "auto":
        mode = "online" if has_api_key() else "offline"
    for attempt in [mode] + (["offline"] if mode == "online" else []):
        if attempt == "disabled":
            break
        try:
            run = _wandb_init(cfg, job, config, attempt, run_id)
        except Exception as e:  # no network, bad key, service error: warn and go on
            then = "trying offline instead" if attempt == "online" else "going on without W&B (metrics.jsonl only)"
            log.warning("W&B %s init failed (%s: %s); %s", attempt, type(e).__name__, str(e).strip(), then)
            continue
        run_dir = os.path.dirname(run.dir)
        if attempt == "offline":
            log.info("W&B offline run %s; upload later with: wandb sync %s", run.id, run_dir)
        return run, {"mode": attempt, "id": run.id, "dir": run_dir, "project": cfg.project, "group": run.group or None}
    return None, {"mode": "disabled", "id": None, "dir": None}


def _wandb_init(cfg: WandbConfig, job: Job, config: dict[str, Any], mode: str, run_id: str | None) -> Any:
    import wandb

    return wandb.init(
        id=run_id,
        resume="allow" if run_id else None,
        project=cfg.project,
        entity=cfg.entity,
        group=cfg.group or job.group,
        name=cfg.name or job.name,
        tags=list(cfg.tags),
        notes=cfg.notes,
        job_type=cfg.job_type,
        config=config,
        dir=job.dir,
        mode=mode,
        settings=wandb.Settings(init_timeout=cfg.init_timeout_s, console="off", silent=True),
    )
