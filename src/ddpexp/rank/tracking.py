"""Rank 0's tracker: the local run record (metrics.jsonl, summary.json), always, and the runs of the trackers the
job names (ddpexp.trackers: W&B by default); a no-op elsewhere. A tracker that fails is let go with one warning
and the record goes on: a tracker never turns a run into a failed one."""

from __future__ import annotations

import importlib
import json
import logging
import os
import sys
from typing import Any

from ddpexp.exceptions import ConfigError
from ddpexp.job import Job, finite, write_json
from ddpexp.trackers.base import Resume, TrackerConfig, TrackerError

log = logging.getLogger("ddpexp")


class NullTracker:
    """What ranks other than 0 get, so the loop never needs `if rank == 0` around logging."""

    def log(self, metrics: dict[str, float], step: int, epoch: int) -> None:
        pass

    def progress(self, text: str) -> None:
        pass

    def states(self) -> dict[str, Any]:
        return {}

    def finish(self, summary: dict[str, Any]) -> None:
        pass


class Tracker(NullTracker):
    def __init__(
        self,
        job: Job,
        trackers: dict[str, TrackerConfig],
        config: dict[str, Any],
        progress_bar: bool,
        resume_step: int | None = None,
        states: dict[str, Any] | None = None,
    ):
        self.job = job
        # Resuming from step s: the lines after s go (the resumed run writes them again, identically); each tracker
        # is told where the record stands, to log every row once (base.Resume).
        resume = None
        if resume_step is not None:
            logged_until = truncate_metrics(job.metrics_path, resume_step)
            resume = Resume(resume_step, logged_until, read_rows(job.metrics_path))
        else:  # a fresh start redoes an earlier attempt of this config that left no checkpoint (the parent checked)
            truncate_metrics(job.metrics_path, -1)
        self.metrics = open(job.metrics_path, "a", buffering=1)
        self.tty = progress_bar and sys.stderr.isatty()
        self.runs: dict[str, Any] = {}
        self.infos: dict[str, dict[str, Any]] = {}
        for name, cfg in trackers.items():
            self._start(name, cfg, config, (states or {}).get(name), resume)

    def _start(self, name: str, cfg: TrackerConfig, config: dict[str, Any], state: Any, resume: Resume | None) -> None:
        module = importlib.import_module(cfg._target_.rpartition(".")[0])
        try:
            run = module.start(cfg, self.job, config, state, resume)
        except Exception as e:  # a tracker the parent's check passed that fails here (a store gone since)
            error = f"{type(e).__name__}: {e}" if not isinstance(e, TrackerError) else str(e)
            if cfg.on_error == "fail":
                raise ConfigError(f"tracker={name}: {error} (tracker.{name}.on_error=warn: go on without it)") from e
            log.warning("%s failed to start (%s); going on without it", _label(module, name), error)
            self.infos[name] = {"failed": error}
            return
        self.runs[name] = run
        self.infos[name] = run.info()

    def log(self, metrics: dict[str, float], step: int, epoch: int) -> None:
        self.metrics.write(json.dumps(finite({"step": step, "epoch": epoch, **metrics}), allow_nan=False) + "\n")
        for name, run in list(self.runs.items()):
            try:
                run.log({**metrics, "epoch": epoch}, step)
            except Exception as e:  # e.g. its service got the job's SIGTERM: the local record goes on without it
                self._lost(name, e)

    def _lost(self, name: str, e: Exception) -> None:
        run = self.runs.pop(name)
        module = sys.modules.get(type(run).__module__)
        log.warning("%s failed (%s: %s); metrics go on to %s", _label(module, name), type(e).__name__, e,
                    self.job.metrics_path if not self.runs else f"{self.job.metrics_path} and {', '.join(self.runs)}")  # fmt: skip
        self.infos[name] = {**self.infos[name], "failed": f"{type(e).__name__}: {e}"}
        close = getattr(run, "close", None)
        if close is not None:
            try:
                close()
            except Exception:
                pass

    def progress(self, text: str) -> None:
        if self.tty:
            sys.stderr.write(f"\r{text}\033[K")
            sys.stderr.flush()

    def states(self) -> dict[str, Any]:
        """What a checkpoint keeps to continue each tracker's run."""
        out = {}
        for name, run in self.runs.items():
            try:
                out[name] = run.state()
            except Exception as e:
                log.warning("%s: state() failed (%s: %s)", name, type(e).__name__, e)
        return out

    def finish(self, summary: dict[str, Any]) -> None:
        if self.tty:
            sys.stderr.write("\n")
        for name, run in list(self.runs.items()):
            try:
                run.finish(summary["status"], summary.get("final", {}))
                self.infos[name] = run.info()
            except Exception as e:  # a tracker failure must never turn a finished run into a failed one
                log.warning("%s finish failed: %s", _label(sys.modules.get(type(run).__module__), name), e)
                self.infos[name] = {**self.infos[name], "failed": f"{type(e).__name__}: {e}"}
        summary = {**summary, "trackers": list(self.infos), **self.infos}
        write_json(self.job.summary_path, summary)
        self.metrics.close()


def _label(module: Any, name: str) -> str:
    return getattr(module, "LABEL", name)


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


def read_rows(path: str) -> list[dict[str, Any]]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []
