"""Trackers beside W&B, read back with their own readers: the tracker contract (ddpexp.testing.TrackerContract) on
TensorBoard (EventAccumulator) and MLflow (MlflowClient); Ctrl-C and a rerun; a sweep with all three trackers; and
bad input, one line before any rank starts."""

from __future__ import annotations

import csv
import signal
import sqlite3
from pathlib import Path

import pytest

from conftest import ROOT, ctrl_c, make_config, read_metrics, read_summary, run_ddpexp, start, wait_for_step
from ddpexp.exceptions import ConfigError
from ddpexp.testing import TrackerContract
from wandb_offline import find_offline_runs

pytestmark = pytest.mark.slow


def tensorboard_rows(log_dir: Path) -> list[dict]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})  # 0: keep every value
    events.Reload()
    return [
        {"step": e.step, "key": tag, "value": e.value} for tag in events.Tags()["scalars"] for e in events.Scalars(tag)
    ]


def mlflow_client(summary: dict):
    from mlflow.tracking import MlflowClient

    return MlflowClient(summary["mlflow"]["tracking_uri"])


def mlflow_rows(summary: dict) -> list[dict]:
    client, run_id = mlflow_client(summary), summary["mlflow"]["run_id"]
    return [
        {"step": m.step, "key": key, "value": m.value}
        for key in client.get_run(run_id).data.metrics
        for m in client.get_metric_history(run_id, key)
    ]


class TestTensorboard(TrackerContract):
    tracker, module = "tensorboard", "ddpexp.trackers.tensorboard"

    def read_rows(self, job: Path, summary: dict) -> list[dict]:
        return tensorboard_rows(Path(summary["tensorboard"]["log_dir"]))

    def check_one_run(self, job: Path, summary: dict) -> None:
        assert summary["tensorboard"]["log_dir"] == str(job / "tensorboard")
        assert len(list((job / "tensorboard").glob("events.out.tfevents.*"))) == 2  # one a start, in one log dir


class TestMlflow(TrackerContract):
    tracker, module = "mlflow", "ddpexp.trackers.mlflow"

    def read_rows(self, job: Path, summary: dict) -> list[dict]:
        return mlflow_rows(summary)

    def check_one_run(self, job: Path, summary: dict) -> None:
        assert summary["mlflow"]["tracking_uri"] == f"sqlite:///{job.parent / 'mlflow.db'}"  # MLflow's default, here
        runs = mlflow_client(summary).search_runs([summary["mlflow"]["experiment_id"]])
        assert [r.info.run_id for r in runs] == [summary["mlflow"]["run_id"]]  # the killed run, continued
        run = runs[0]
        assert run.info.status == "FINISHED" and run.data.tags["ddpexp.job_dir"] == str(job)
        assert run.data.params["optimizer.lr"] == "0.001" and run.data.params["model._target_"] == "ddpexp.models.cnn"


class TestProjectTracker(TrackerContract):
    """A tracker in the user's own project (conf/tracker/csv.yaml names myproject.csvlog.start)."""

    tracker, module, config_dir = "csv", "myproject.csvlog", str(ROOT / "examples" / "myproject" / "conf")

    @pytest.fixture(autouse=True)
    def _importable_here(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.syspath_prepend(str(ROOT / "examples" / "myproject"))

    def read_rows(self, job: Path, summary: dict) -> list[dict]:
        with open(summary["csv"]["path"], newline="") as f:
            return [{"step": int(r["step"]), "key": r["key"], "value": float(r["value"])} for r in csv.DictReader(f)]


@pytest.mark.timeout(300)
def test_ctrl_c_and_rerun_give_one_mlflow_run_and_no_tensorboard_step_twice(tmp_path: Path) -> None:
    args = ["tracker=[tensorboard,mlflow]", "gpus=1", "epochs=1", "log_every_n_steps=2", "debug.step_delay_s=0.2",
            "hydra.run.dir=job"]  # fmt: skip
    proc = start(args, cwd=tmp_path)
    assert signal.getsignal(signal.SIGINT) is not signal.SIG_IGN  # a Ctrl-C here reaches the command
    out, err = ctrl_c(proc, lambda: wait_for_step(tmp_path / "job", 6, proc))
    assert proc.returncode == 130, f"{out}\n{err}"
    job = tmp_path / "job"
    interrupted = read_summary(job)
    assert interrupted["status"] == "interrupted" and interrupted["signal"] == "SIGINT"
    client = mlflow_client(interrupted)
    assert client.get_run(interrupted["mlflow"]["run_id"]).info.status == "KILLED"

    run_ddpexp(*args[:-2], "hydra.run.dir=job", cwd=tmp_path, timeout=180)
    summary = read_summary(job)
    assert summary["status"] == "completed" and summary["resumed_from"]["step"] == interrupted["steps"]
    assert summary["mlflow"]["run_id"] == interrupted["mlflow"]["run_id"]
    runs = client.search_runs([summary["mlflow"]["experiment_id"]])
    assert len(runs) == 1 and runs[0].info.status == "FINISHED"
    expected = sorted((r["step"], k) for r in read_metrics(job) for k in r if k != "step")  # epoch: twice at an eval
    for rows in (tensorboard_rows(job / "tensorboard"), mlflow_rows(summary)):
        assert sorted((r["step"], r["key"]) for r in rows) == expected  # every (tag, step) once


@pytest.mark.timeout(300)
def test_a_sweep_with_three_trackers_gives_each_job_one_run_in_each_grouped(tmp_path: Path) -> None:
    run_ddpexp("-m", "tracker=[wandb,tensorboard,mlflow]", "gpus=1", "max_steps=3", "log_every_n_steps=1",
               "optimizer.lr=0.01,0.001", "hydra.sweep.dir=sweep", cwd=tmp_path, timeout=240, wandb=True)  # fmt: skip
    jobs = [tmp_path / "sweep" / str(n) for n in range(2)]
    summaries = [read_summary(job) for job in jobs]
    assert [len(find_offline_runs(job / "wandb")) for job in jobs] == [1, 1]
    assert {s["wandb"]["group"] for s in summaries} == {"sweep"}  # the sweep dir, as given
    assert all(s["trackers"] == ["wandb", "tensorboard", "mlflow"] for s in summaries), summaries
    assert {s["mlflow"]["tracking_uri"] for s in summaries} == {f"sqlite:///{tmp_path / 'mlflow.db'}"}  # the default
    for job in jobs:
        assert {r["key"] for r in tensorboard_rows(job / "tensorboard")} >= {"train/loss", "val/acc", "epoch"}
    client = mlflow_client(summaries[0])
    runs = client.search_runs([summaries[0]["mlflow"]["experiment_id"]], "tags.`ddpexp.sweep` = 'sweep'")
    assert sorted(r.info.run_id for r in runs) == sorted(s["mlflow"]["run_id"] for s in summaries)
    assert sorted(r.data.params["optimizer.lr"] for r in runs) == ["0.001", "0.01"]
    assert sorted(r.info.run_name for r in runs) == ["optimizer.lr=0.001", "optimizer.lr=0.01"]


def test_an_unknown_tracker_is_one_line_with_the_choices(tmp_path: Path) -> None:
    proc = run_ddpexp("tracker=[wandb,tensorbord]", cwd=tmp_path, check=False)
    assert proc.returncode == 2 and proc.stdout == "" and not (tmp_path / "outputs").exists()
    assert proc.stderr == (
        "ddpexp: error: In 'config': Could not find 'tracker/tensorbord'. "
        "Available options in 'tracker': mlflow, none, tensorboard, wandb\n"
    )


def test_a_store_that_does_not_open_is_one_line_before_any_rank_or_a_warning(tmp_path: Path) -> None:
    """A server nothing listens on; a log dir under a file. on_error=fail: exit 2 before any rank (no job dir's
    logs); on_error=warn: the job runs with the others and says which it went on without."""
    proc = run_ddpexp("tracker=mlflow", "tracker.mlflow.tracking_uri=http://127.0.0.1:9", "max_steps=2", "gpus=1",
                      "hydra.run.dir=job", cwd=tmp_path, check=False)  # fmt: skip
    assert proc.returncode == 2 and not (tmp_path / "job" / "logs").exists(), proc.stderr
    line = "ddpexp: error: tracker=mlflow: cannot open the MLflow store http://127.0.0.1:9 ("
    assert proc.stderr.startswith(line) and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.rstrip().endswith("(tracker.mlflow.on_error=warn: go on without it)")

    (tmp_path / "file").write_text("")
    # ...and the job, which fails on purpose after step 2, ends its MLflow run FAILED, each of its rows there.
    proc = run_ddpexp("tracker=[tensorboard,mlflow]", f"tracker.tensorboard.log_dir={tmp_path / 'file' / 'tb'}",
                      "tracker.tensorboard.on_error=warn", "max_steps=4", "log_every_n_steps=1", "gpus=1",
                      "debug.fail_at_step=2", "hydra.run.dir=job", cwd=tmp_path, check=False)  # fmt: skip
    assert proc.returncode == 1 and "debug.fail_at_step=2: rank 0 fails on purpose" in proc.stderr, proc.stderr
    assert (
        f"ddpexp: warning: tracker=tensorboard: cannot write its log dir {tmp_path / 'file' / 'tb'}: "
        f"{tmp_path / 'file'} is not a writable directory; going on without it (tracker.tensorboard.on_error=warn)\n"
    ) in proc.stderr
    summary = read_summary(tmp_path / "job")
    assert summary["status"] == "failed" and summary["trackers"] == ["mlflow"]
    assert mlflow_client(summary).get_run(summary["mlflow"]["run_id"]).info.status == "FAILED"
    rows = read_metrics(tmp_path / "job")
    assert [r["step"] for r in rows] == [1]  # the failure comes after step 2, before its row
    assert sorted((r["step"], r["key"]) for r in mlflow_rows(summary)) == sorted(
        (r["step"], k) for r in rows for k in r if k != "step"
    )


def test_tracker_keys_are_checked_in_the_parent() -> None:
    with pytest.raises(
        ConfigError,
        match=r"^tracker\.tensorboard\.logdir: no such key \(did you mean tracker\.tensorboard\.log_dir\?\)",
    ):
        make_config("tracker=tensorboard", "+tracker.tensorboard.logdir=x")
    with pytest.raises(ConfigError, match=r"^tracker\.mlflow\.on_error='never': must be one of fail, warn$"):
        make_config("tracker=mlflow", "tracker.mlflow.on_error=never")
    assert list(make_config().tracker) == ["wandb"] and make_config("tracker=none").tracker == {}
    cfg = make_config("tracker=[wandb,tensorboard]", "wandb.mode=disabled")
    assert list(cfg.tracker) == ["wandb", "tensorboard"] and cfg.tracker["wandb"].settings.mode == "disabled"


def test_a_config_from_before_the_tracker_group_is_the_same_run() -> None:
    import yaml

    from ddpexp.parent.compat import same_run_configs

    now = {"seed": 0, "wandb": {"mode": "offline"}, "tracker": {"wandb": {"_target_": "ddpexp.trackers.wandb.start",
           "on_error": "warn"}}, "data": {"_target_": "ddpexp.data.digits", "test_fraction": None}}  # fmt: skip
    dump = lambda c: yaml.safe_dump(c, sort_keys=False)  # noqa: E731
    older = {k: v for k, v in now.items() if k != "tracker"}
    oldest = {**older, "data": {"_target_": "ddpexp.data.digits"}}
    assert {dump(older), dump(oldest)} <= same_run_configs(dump(now))
    with_tb = {**now, "tracker": {**now["tracker"], "tensorboard": {"_target_": "ddpexp.trackers.tensorboard.start"}}}
    assert dump(older) not in same_run_configs(dump(with_tb))  # another tracker: not the default's config


def test_a_missing_package_is_said_with_its_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from ddpexp.trackers import mlflow, tensorboard
    from ddpexp.trackers.base import TrackerError

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    for module, cfg, extra in ((tensorboard, tensorboard.TensorboardTrackerConfig(), "tensorboard"),
                               (mlflow, mlflow.MlflowTrackerConfig(), "mlflow")):  # fmt: skip
        with pytest.raises(
            TrackerError, match=rf'^the {extra} package is not installed \(pip install "ddpexp\[{extra}\]"\)$'
        ):
            module.check(cfg, None)
    assert sqlite3  # the default store's engine ships with Python


def test_mlflow_tracking_uri_from_the_environment_and_relative_stores_made_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ddpexp.job import Job
    from ddpexp.trackers import mlflow

    monkeypatch.chdir(tmp_path)
    assert mlflow.absolute_uri("sqlite:///mlflow.db") == f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert mlflow.absolute_uri("./mlruns") == str(tmp_path / "mlruns")
    assert mlflow.absolute_uri("file:mlruns") == f"file://{tmp_path / 'mlruns'}"
    for kept in ("sqlite:////abs/x.db", "http://host:5000", "databricks", "file:///abs/mlruns"):
        assert mlflow.absolute_uri(kept) == kept
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///from_env.db")
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "lab")
    cfg = mlflow.MlflowTrackerConfig()
    mlflow.check(cfg, Job(dir=str(tmp_path / "job"), name="n", group=None, launcher="spawn", config_yaml=""))
    assert cfg.tracking_uri == f"sqlite:///{tmp_path / 'from_env.db'}" and cfg.experiment_name == "lab"
    assert (tmp_path / "from_env.db").is_file() and cfg.experiment_id is not None
    set_here = mlflow.MlflowTrackerConfig(tracking_uri=f"sqlite:///{tmp_path / 'set.db'}", experiment_name="mine")
    mlflow.check(set_here, Job(dir=str(tmp_path / "job"), name="n", group=None, launcher="spawn", config_yaml=""))
    assert set_here.tracking_uri == f"sqlite:///{tmp_path / 'set.db'}" and set_here.experiment_name == "mine"


def test_a_checkpoint_from_before_the_tracker_group_continues_its_wandb_run() -> None:
    from ddpexp.rank.worker import _tracker_states

    assert _tracker_states({"wandb_id": "abc123", "step": 5}) == {"wandb": {"id": "abc123"}}
    now = {"trackers": {"wandb": {"id": "x"}, "mlflow": {"run_id": "r"}}, "wandb_id": "x"}
    assert _tracker_states(now) == {"wandb": {"id": "x"}, "mlflow": {"run_id": "r"}}
