"""`tracker=wandb` (the default): one W&B run per job, grouped per sweep. Its keys are `wandb.*` (where they were
before the tracker group: `wandb.mode=disabled` ...); it never stops a job unless told to: failing online falls
back to offline, failing offline to the run record alone."""

from __future__ import annotations

import logging
import netrc
import os
from dataclasses import dataclass, field
from typing import Any

from ddpexp.config import WandbConfig
from ddpexp.trackers.base import Resume, TrackerConfig, TrackerError

log = logging.getLogger("ddpexp")
LABEL = "W&B"  # how warnings name it


@dataclass
class WandbTrackerConfig(TrackerConfig):
    _target_: str = "ddpexp.trackers.wandb.start"
    on_error: str = "warn"  # fail: a run that starts in no mode (online, then offline) fails the job
    settings: WandbConfig = field(default_factory=WandbConfig, init=False)  # the run's `wandb.*`, set by the parent


def check(cfg: WandbTrackerConfig, job: Any) -> None:
    pass  # wandb is one of ddpexp's own dependencies; whether it can reach its server, only wandb.init tells


def start(
    cfg: WandbTrackerConfig, job: Any, config: dict[str, Any], state: dict[str, Any] | None, resume: Resume | None
) -> WandbRun:
    run, info = init_wandb(cfg.settings, job, config, (state or {}).get("id"))
    if run is None and cfg.on_error == "fail" and cfg.settings.mode != "disabled":
        raise TrackerError(f"W&B started in no mode ({info.get('error')})")
    # W&B cannot rewrite its history: a resumed run logs only the steps after the last one it already has.
    return WandbRun(run, info, resume.logged_until if resume is not None else -1)


class WandbRun:
    def __init__(self, run: Any, info: dict[str, Any], logged_until: int):
        self.run, self._info, self.logged_until = run, info, logged_until

    def log(self, row: dict[str, float], step: int) -> None:
        if self.run is not None and step > self.logged_until:
            self.run.log(row, step=step)

    def state(self) -> dict[str, Any]:
        return {"id": self._info["id"]}

    def info(self) -> dict[str, Any]:
        return self._info

    def finish(self, status: str, final: dict[str, float]) -> None:
        if self.run is not None:
            self.run.summary.update({"status": status, **final})
            self.run.finish(exit_code=0 if status == "completed" else 1)

    def close(self) -> None:
        """After a failed call: let go of a dead service now, not in a noisy atexit hook."""
        self.run = None
        try:
            import wandb

            wandb.teardown()
        except Exception:
            pass


def has_api_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("://")[-1]
        return netrc.netrc().authenticators(host) is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


def init_wandb(
    cfg: WandbConfig, job: Any, config: dict[str, Any], run_id: str | None = None
) -> tuple[Any | None, dict[str, Any]]:
    """Start the job's W&B run. Failing online falls back to offline, failing offline to disabled: never raise."""
    mode = cfg.mode
    if mode == "auto":
        mode = "online" if has_api_key() else "offline"
    error = None
    for attempt in [mode] + (["offline"] if mode == "online" else []):
        if attempt == "disabled":
            break
        try:
            run = _wandb_init(cfg, job, config, attempt, run_id)
        except Exception as e:  # no network, bad key, service error: warn and go on
            then = "trying offline instead" if attempt == "online" else "going on without W&B (metrics.jsonl only)"
            error = f"{type(e).__name__}: {str(e).strip()}"
            log.warning("W&B %s init failed (%s); %s", attempt, error, then)
            continue
        run_dir = os.path.dirname(run.dir)
        if attempt == "offline":
            log.info("W&B offline run %s; upload later with: wandb sync %s", run.id, run_dir)
        return run, {"mode": attempt, "id": run.id, "dir": run_dir, "project": cfg.project, "group": run.group or None}
    return None, {"mode": "disabled", "id": None, "dir": None, **({"error": error} if error else {})}


def _wandb_init(cfg: WandbConfig, job: Any, config: dict[str, Any], mode: str, run_id: str | None) -> Any:
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
