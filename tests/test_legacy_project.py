"""A user project written against the README before tasks declared `directions` (tests/projects/userlab: its task
declares none, its experiment sets objective=val/bits_per_char, its own model and data) runs after the upgrade as it
ran before: a single job, a sweep, an Optuna search and the Python API. Without a known direction the run trains and
records, says once what it does without (no best.pt, an unsorted report); a sweeper's direction declares it; early
stopping, which cannot work without one, is one line; a broken task's first error names its real defect."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, ddpexp_env, read_metrics, read_summary

PROJECT = ROOT / "tests" / "projects" / "userlab"
DDPEXP = Path(sys.executable).parent / "ddpexp"
WARNING = (
    "ddpexp: warning: objective_mode=auto: task=userlab.tasks.CharLM declares no direction for "
    "objective=val/bits_per_char (it has no directions); set objective_mode=min or objective_mode=max, or add "
    "'bits_per_char' to the task's directions; without it no best.pt is kept and `ddpexp report` lists the runs "
    "unsorted"
)


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("legacy") / "userlab"
    shutil.copytree(PROJECT, dest, ignore=shutil.ignore_patterns("__pycache__", "outputs", "multirun"))
    return dest


def ddpexp(project: Path, *args: str, timeout: float = 150) -> subprocess.CompletedProcess[str]:
    flags = [a for a in args if a == "-m"]
    args = tuple(a for a in args if a != "-m")
    return subprocess.run([str(DDPEXP), *flags, "experiment=charlm", *args], cwd=project, env=ddpexp_env(),
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_single_run_trains_records_and_reports_without_a_direction(project: Path) -> None:
    proc = ddpexp(project, "gpus=2", "checkpoint_every_n_epochs=1", "hydra.run.dir=job")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("ddpexp: warning:") == 1 and WARNING in proc.stderr.splitlines(), proc.stderr
    summary = read_summary(project / "job")
    assert summary["status"] == "completed" and summary["world_size"] == 2
    assert summary["objective"] == {"name": "val/bits_per_char", "mode": None} and summary["best"] is None
    assert 0 < summary["final"]["val/bits_per_char"] < 6 and summary["steps"] == 3 * 8  # 900 train chars / 2 ranks / 64
    evals = [m["val/bits_per_char"] for m in read_metrics(project / "job") if "val/bits_per_char" in m]
    assert len(evals) == 3 and evals[-1] == summary["final"]["val/bits_per_char"]
    ckpts = sorted(p.name for p in (project / "job" / "checkpoints").iterdir())
    assert "best.pt" not in ckpts and "last.pt" in ckpts and "step-00000024.pt" in ckpts

    report = subprocess.run([str(DDPEXP), "report", "job"], cwd=project, env=ddpexp_env(), capture_output=True,
                            text=True, timeout=60)  # fmt: skip
    assert report.returncode == 0, report.stderr
    assert "objective val/bits_per_char (unknown)" in report.stdout and "best:" not in report.stdout

    # Early stopping cannot work without a direction: one line, before any rank, nothing made.
    proc = ddpexp(project, "early_stop.patience=2", "hydra.run.dir=refused", timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "ddpexp: error: early_stop.patience=2 needs to know which way is better: "
        + WARNING.removeprefix("ddpexp: warning: ").split("; without it")[0]
    )
    assert not (project / "refused").exists()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_sweep_a_search_and_the_api_run_and_broken_tasks_name_their_defect(project: Path) -> None:
    # A basic sweep: the warning once for the command, every job trains, the report keeps the job order.
    proc = ddpexp(project, "-m", "optimizer.lr=0.001,0.03", "gpus=1", "hydra.sweep.dir=sweep")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("ddpexp: warning:") == 1 and WARNING in proc.stderr.splitlines(), proc.stderr
    bits = [read_summary(project / "sweep" / n)["final"]["val/bits_per_char"] for n in ("0", "1")]
    assert bits[1] < bits[0]  # lr 0.03 learns more in 3 epochs than 0.001: sorted, job 1 would come first
    report = subprocess.run([str(DDPEXP), "report", "sweep"], cwd=project, env=ddpexp_env(), capture_output=True,
                            text=True, timeout=60)  # fmt: skip
    assert report.returncode == 0, report.stderr
    rows = [line.split() for line in report.stdout.splitlines() if line.split()[3:4] == ["completed"]]
    assert [r[1] for r in rows] == ["0", "1"], report.stdout  # the job order: none is better
    assert "(unknown)" in report.stdout

    # An Optuna search that says minimize: that is the declaration, so there is a best and no warning.
    proc = ddpexp(project, "-m", "hydra/sweeper=optuna", "hydra.sweeper.direction=minimize",
                  "hydra.sweeper.n_trials=1", "hydra.sweeper.sampler.seed=1", "optimizer.lr=interval(0.01,0.05)",
                  "gpus=1", "hydra.sweep.dir=search", timeout=200)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "ddpexp: warning:" not in proc.stderr, proc.stderr
    trial = project / "search" / "0"
    assert not (project / "search" / "1").exists()  # the one trial asked for
    summary = read_summary(trial)
    assert summary["objective"] == {"name": "val/bits_per_char", "mode": "min"}
    assert summary["best"]["value"] == min(
        m["val/bits_per_char"] for m in read_metrics(trial) if "val/bits_per_char" in m
    )
    assert (trial / "checkpoints" / "best.pt").is_file()

    # The Python API, as the project's train.py calls it.
    proc = subprocess.run([sys.executable, "train.py", "gpus=1", "hydra.run.dir=api"], cwd=project,
                          env=ddpexp_env(), capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["job_dir"] == str(project / "api") and out["final"] == read_summary(project / "api")["final"]

    # Broken tasks: the first error names the defect, not the missing direction.
    for task, defect in (
        ("PerCharLoss", "task=userlab.tasks.PerCharLoss.loss: must return a scalar float tensor"),
        ("TrainLossMetric", "task=userlab.tasks.TrainLossMetric.metrics: metric name 'train/loss'"),
    ):
        proc = ddpexp(project, f"task._target_=userlab.tasks.{task}", "gpus=1", f"hydra.run.dir={task}")
        errors = [line for line in proc.stderr.splitlines() if line.startswith("ddpexp: error:")]
        assert proc.returncode != 0 and len(errors) == 1 and defect in errors[0], proc.stderr
