"""`tracker=mlflow`: one MLflow run per job in one experiment (a sweep's jobs tagged `ddpexp.sweep`), continued on
resume (the run id is in the checkpoint and summary.json), ended FINISHED, FAILED or KILLED as the job ends. By
default the store is MLflow's own default for the installed version, in the directory the command runs in (so
`mlflow ui` there shows the runs); MLFLOW_TRACKING_URI or `tracker.mlflow.tracking_uri` name another."""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import re
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ddpexp.trackers.base import Resume, TrackerConfig, TrackerError, flat_params, status_of

LABEL = "MLflow"
# MLflow's HTTP client retries a request 7 times over minutes: a server that does not answer is said in seconds.
HTTP_LIMITS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "15"}
MAX_PARAM_LENGTH = 6000  # MLflow 3's limit on a param's value
PENDING = 32  # asynchronous log calls in flight before the oldest is waited for (its error, if any, said then)


@dataclass
class MlflowTrackerConfig(TrackerConfig):
    _target_: str = "ddpexp.trackers.mlflow.start"
    on_error: str = "fail"
    tracking_uri: str | None = None  # null: MLFLOW_TRACKING_URI, else MLflow's default, in the command's directory
    experiment_name: str | None = None  # null: MLFLOW_EXPERIMENT_NAME, else ddpexp
    run_name: str | None = None  # null: the job's name (its overrides), as W&B's
    tags: dict[str, str] = field(default_factory=dict)
    experiment_id: str | None = field(default=None, init=False)  # the parent's check resolves it


def check(cfg: MlflowTrackerConfig, job: Any) -> None:
    if importlib.util.find_spec("mlflow") is None:
        raise TrackerError('the mlflow package is not installed (pip install "ddpexp[mlflow]")')
    import mlflow

    _quiet()
    uri = cfg.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or mlflow.get_tracking_uri()
    cfg.tracking_uri = absolute_uri(uri)  # ranks may start elsewhere (a Slurm node): the command's directory
    cfg.experiment_name = cfg.experiment_name or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "ddpexp"
    try:
        with _http_limits():
            client = mlflow.tracking.MlflowClient(cfg.tracking_uri)
            experiment = client.get_experiment_by_name(cfg.experiment_name)
            if experiment is None:
                cfg.experiment_id = client.create_experiment(cfg.experiment_name)
            elif experiment.lifecycle_stage != "active":
                raise TrackerError(
                    f"experiment {cfg.experiment_name!r} is deleted in {cfg.tracking_uri}: restore it "
                    "(mlflow experiments restore) or set tracker.mlflow.experiment_name"
                )
            else:
                cfg.experiment_id = experiment.experiment_id
    except TrackerError:
        raise
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0][:300]
        raise TrackerError(f"cannot open the MLflow store {cfg.tracking_uri} ({type(e).__name__}: {first})") from None


def absolute_uri(uri: str) -> str:
    """A store named relative to the command's directory, named absolutely: `sqlite:///mlflow.db`, `./mlruns`."""
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        return "sqlite:///" + os.path.abspath(uri[len("sqlite:///") :])
    if uri.startswith("file:") and not uri.startswith("file:/"):
        return "file://" + os.path.abspath(uri[len("file:") :])
    if "://" not in uri and not uri.startswith(("databricks", "file:")):
        return os.path.abspath(uri)
    return uri


def start(
    cfg: MlflowTrackerConfig, job: Any, config: dict[str, Any], state: dict[str, Any] | None, resume: Resume | None
) -> MlflowRun:
    for key, value in HTTP_LIMITS.items():
        os.environ.setdefault(key, value)
    from mlflow.tracking import MlflowClient

    _quiet()

    client = MlflowClient(cfg.tracking_uri)
    params = {_key(k): v[:MAX_PARAM_LENGTH] for k, v in flat_params(config).items()}
    run_id = (state or {}).get("run_id")
    if run_id:  # the same run, continued: RUNNING again, and only what it lacks
        client.update_run(run_id, status="RUNNING")
        held = client.get_run(run_id).data
        params = {k: v for k, v in params.items() if k not in held.params}  # params cannot change in MLflow
        logged = {key: max(m.step for m in client.get_metric_history(run_id, key)) for key in held.metrics}
    else:
        tags = {"ddpexp.job_dir": job.dir, "ddpexp.launcher": job.launcher, **cfg.tags}
        if job.group:
            tags["ddpexp.sweep"] = job.group  # a sweep's jobs, listed together
        run_id = client.create_run(cfg.experiment_id, run_name=cfg.run_name or job.name, tags=tags).info.run_id
        logged = {}
    run = MlflowRun(client, run_id, cfg, logged)
    run.log_params(params)
    for row in resume.rows if resume is not None else []:  # what the store lacks of the record's rows (a kill
        run.log({k: v for k, v in row.items() if k != "step"}, row["step"])  # cut short the async calls)
    return run


class MlflowRun:
    def __init__(self, client: Any, run_id: str, cfg: MlflowTrackerConfig, logged: dict[str, int]):
        self.client, self.run_id, self.cfg = client, run_id, cfg
        # A metric's last step the store holds: a resumed run's steps up to it (after its checkpoint, before a
        # kill) are not logged again (MLflow keeps every value logged; the resumed run's are the same, throughput
        # aside).
        self.logged = logged
        self.pending: list[Any] = []  # asynchronous log calls: logging costs no step any time

    def log_params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(k, v) for k, v in params.items()]
        for i in range(0, len(items), 100):  # MLflow takes 100 params a call
            self.client.log_batch(self.run_id, params=items[i : i + 100])

    def log(self, row: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [
            Metric(k, float(v), now, step)
            for k, v in row.items()
            if isinstance(v, (int, float)) and math.isfinite(v) and step > self.logged.get(k, -1)
        ]
        if metrics:
            self.pending.append(self.client.log_batch(self.run_id, metrics=metrics, synchronous=False))
        while len(self.pending) > PENDING:
            self.pending.pop(0).wait()  # raises what failed: the tracker is let go, said in one warning

    def state(self) -> dict[str, Any]:
        return {"run_id": self.run_id}

    def info(self) -> dict[str, Any]:
        return {"tracking_uri": self.cfg.tracking_uri, "experiment": self.cfg.experiment_name,
                "experiment_id": self.cfg.experiment_id, "run_id": self.run_id}  # fmt: skip

    def finish(self, status: str, final: dict[str, float]) -> None:
        self._drain()
        self.client.set_terminated(self.run_id, status_of(status))

    def close(self) -> None:
        self.pending = []

    def _drain(self) -> None:
        while self.pending:
            self.pending.pop(0).wait()


def _key(name: str) -> str:
    return re.sub(r"[^\w\-. /]", "_", name)  # the characters MLflow takes in a name


def _quiet() -> None:
    for name in (
        "mlflow",
        "alembic",
    ):  # the store's first use logs its table creation at INFO (after `import mlflow`, which sets it)
        logging.getLogger(name).setLevel(logging.WARNING)


@contextmanager
def _http_limits():
    saved = {k: os.environ.get(k) for k in HTTP_LIMITS}
    os.environ.update({k: os.environ.get(k) or v for k, v in HTTP_LIMITS.items()})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
