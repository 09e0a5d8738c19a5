"""The tracker contract: what a module must provide to be `tracker=NAME` (W&B, TensorBoard, MLflow here; a
project's or an installed package's too), and the helpers trackers share.

A tracker is a module with a `NameTrackerConfig` dataclass (`_target_`: the module's `start`; `on_error`: fail or
warn) and two functions. The parent calls `check(cfg, job)` before any rank starts: it resolves what only the
command's machine knows (a default store in the command's directory, the job dir's log dir) into `cfg`, and raises
TrackerError when the tracker cannot write (its package missing, a store that does not open). Rank 0 alone then
calls `start(cfg, job, config, state, resume)`, which starts the job's run, or continues the one `state` names
(what its Run's `state()` gave the checkpoint resumed from), and returns a Run. `resume` (None on a fresh start)
says where the record stands: a tracker that can tell what it already holds catches up from `resume.rows`, so
every row reaches it once."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from omegaconf import MISSING

from ddpexp.exceptions import ConfigError

ON_ERROR = ("fail", "warn")
CONTRACT = ("check", "start")


class TrackerError(Exception):
    """A tracker that cannot write: its message is one line that says why and what to do."""


@dataclass
class TrackerConfig:
    """Fields every tracker has; each tracker's dataclass extends it."""

    _target_: str = MISSING
    on_error: str = "fail"  # a tracker that cannot start: fail the job before any rank starts, or warn and go on

    def __post_init__(self) -> None:
        if self.on_error not in ON_ERROR:
            raise ConfigError(f"on_error={self.on_error!r}: must be one of {', '.join(ON_ERROR)}")


@dataclass
class Resume:
    """Where a resumed job's record stands when its tracker starts."""

    step: int  # the checkpoint's optimizer step: the rows after it come again, from the resumed run
    logged_until: int  # the last step earlier attempts logged (rows after `step` up to it, a tracker got already)
    rows: list[dict[str, Any]] = field(
        default_factory=list
    )  # metrics.jsonl's rows up to `step`: {"step", "epoch", ...}


@runtime_checkable
class Run(Protocol):
    """One job's run in a tracker, on rank 0. Every call after start may raise: the record goes on without it."""

    def log(self, row: dict[str, float], step: int) -> None:
        """A row of metrics.jsonl (its metrics and "epoch"), at optimizer step `step`."""

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps to continue this same run on resume (a run id)."""

    def info(self) -> dict[str, Any]:
        """summary.json's entry for this tracker: where to find the run."""

    def finish(self, status: str, final: dict[str, float]) -> None:
        """The job ended with `status` (completed, interrupted, requeued, failed); `final` its last metrics."""


class Tracker(Protocol):
    """What a tracker module provides (a module satisfies this Protocol: its functions are the methods)."""

    def check(self, cfg: Any, job: Any) -> None: ...

    def start(
        self, cfg: Any, job: Any, config: dict[str, Any], state: dict[str, Any] | None, resume: Resume | None
    ) -> Run: ...


def flat_params(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """The run's config as flat params, `optimizer.lr` -> "0.1", as MLflow and TensorBoard's hparams take them."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flat_params(value, f"{name}."))
        else:
            out[name] = "null" if value is None else str(value)
    return out


def status_of(status: str) -> str:
    """A job's status as the trackers that know three end states name them (MLflow's RunStatus)."""
    return {"completed": "FINISHED", "failed": "FAILED"}.get(status, "KILLED")
