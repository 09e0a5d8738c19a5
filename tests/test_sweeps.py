"""A real Optuna search through the command line: 3 trials of 2 DDP ranks each, one trial failing on purpose.
The study survives the failure, every trial's ranks trained with the parameters Optuna chose for it, the study's
best value is the best job's record, and `ddpexp report` tabulates and plots it. (The search on Slurm, where each
trial is waited for before the sweeper reads it: README's command, tests/test_readme.py.)"""

from __future__ import annotations

import csv
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, ckpt_config, ddpexp_env, read_summary, run_ddpexp
from ddpexp.report.main import fmt

pytestmark = pytest.mark.slow

TRIALS = 3
SWEPT = ("optimizer.lr", "optimizer.weight_decay", "batch_size", "model")


@pytest.fixture(scope="module")
def study(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """hparams_search=digits_optuna, 3 trials x 2 spawn ranks, 1 epoch each; trial 1 fails after its first step."""
    root = tmp_path_factory.mktemp("optuna")
    sweep = root / "sweep"
    proc = run_ddpexp(
        "hparams_search=digits_optuna", f"hydra.sweeper.n_trials={TRIALS}", "launcher=spawn", "gpus=2", "epochs=1",
        "wandb.mode=disabled", "hydra.sweeper.custom_search_space=sweep_faults.fail_trial_1",
        f"hydra.sweep.dir={sweep}", cwd=root, check=False, timeout=200,
        env={"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "tests"), os.environ.get("PYTHONPATH")]))},
    )  # fmt: skip
    return sweep, proc


def overrides(job: Path) -> dict[str, str]:
    return dict(o.split("=", 1) for o in yaml.safe_load((job / ".hydra" / "overrides.yaml").read_text()))


@pytest.mark.timeout(240)
def test_a_failed_trial_is_failed_in_the_study_which_goes_on(study: tuple[Path, subprocess.CompletedProcess]) -> None:
    sweep, proc = study
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out, out
    assert proc.returncode == 1 and "ddpexp: 1 job(s) of the sweep failed:" in proc.stderr, out
    assert f"{sweep / '1'}: rank 0 failed: RuntimeError: debug.fail_at_step=1" in proc.stderr
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == [str(i) for i in range(TRIALS)]
    statuses = [read_summary(sweep / str(i))["status"] for i in range(TRIALS)]
    assert statuses == ["completed", "failed", *["completed"] * (TRIALS - 2)]
    assert "debug.fail_at_step=1: rank 0 fails on purpose" in read_summary(sweep / "1")["error"]
    # What Optuna itself recorded, as the extender read it from the study when the last trial was asked:
    states = json.loads((sweep / "trial_states.json").read_text())
    assert states == {str(i): "FAIL" if i == 1 else "COMPLETE" for i in range(TRIALS - 1)}


@pytest.mark.timeout(240)
def test_each_trial_ran_its_own_params_on_every_rank(study: tuple[Path, subprocess.CompletedProcess]) -> None:
    sweep, _ = study
    seen = set()
    for i in range(TRIALS):
        job = sweep / str(i)
        params, summary = overrides(job), read_summary(job)
        assert set(SWEPT) <= set(params) and summary["world_size"] == 2
        seen.add(tuple(params[k] for k in SWEPT))
        # Written by the worker: each rank hashes the config YAML it received.
        hashes = summary["config_sha256_per_rank"]
        assert len(hashes) == 2 and len(set(hashes)) == 1, hashes
        if summary["status"] != "completed":
            continue
        config_yaml = ckpt_config(job)
        assert hashes[0] == hashlib.sha256(config_yaml.encode()).hexdigest()
        config = yaml.safe_load(config_yaml)
        assert config["optimizer"]["lr"] == float(params["optimizer.lr"])
        assert config["optimizer"]["weight_decay"] == float(params["optimizer.weight_decay"])
        assert config["batch_size"] == int(params["batch_size"])
        assert config["model"]["_target_"] == f"ddpexp.models.{params['model']}"
        assert config["objective"] == "val/acc" and summary["epochs"] == 1
    assert len(seen) == TRIALS  # Optuna proposed a new point each time


@pytest.mark.timeout(240)
def test_the_best_value_is_the_best_jobs_record(study: tuple[Path, subprocess.CompletedProcess]) -> None:
    sweep, _ = study
    results = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    finals = {i: read_summary(sweep / str(i)).get("final", {}).get("val/acc") for i in range(TRIALS)}
    best = max((i for i in finals if finals[i] is not None), key=lambda i: finals[i])
    assert results["best_value"] == finals[best] and 0.1 < results["best_value"] <= 1.0
    assert {k: str(v) for k, v in results["best_params"].items()} == {k: overrides(sweep / str(best))[k] for k in SWEPT}


@pytest.mark.timeout(240)
def test_report_on_the_study(study: tuple[Path, subprocess.CompletedProcess]) -> None:
    sweep, _ = study
    proc = subprocess.run(
        [sys.executable, "-m", "ddpexp", "report", str(sweep)], env=ddpexp_env(), capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    results = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    with open(sweep / "report.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == TRIALS and list(rows[0])[3:8] == [*SWEPT, "debug.fail_at_step"]
    assert float(rows[0]["val/acc"]) == results["best_value"] and rows[0]["status"] == "completed"
    accs = [float(r["val/acc"]) for r in rows if r["status"] == "completed"]
    assert accs == sorted(accs, reverse=True) and len(accs) == TRIALS - 1
    failed = rows[-1]
    assert (failed["job"], failed["status"], failed["debug.fail_at_step"]) == ("1", "failed", "1")
    assert "debug.fail_at_step=1: rank 0 fails on purpose" in failed["error"]
    assert "job 1 (failed): rank 0 failed: RuntimeError: debug.fail_at_step=1" in proc.stdout
    assert f"optuna (optimization_results.yaml): best_value={fmt(results['best_value'])}," in proc.stdout
    for name in ("report.md", "report_curves.png", "report_objective.png"):
        assert (sweep / name).stat().st_size > 1000, name
    assert (sweep / "report_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(180)
def test_a_study_whose_every_trial_failed_ends_with_the_list_not_a_traceback(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    proc = run_ddpexp(
        "hparams_search=digits_optuna", "hydra.sweeper.n_trials=2", "launcher=spawn", "gpus=1", "epochs=1",
        "debug.fail_at_step=1", "wandb.mode=disabled", f"hydra.sweep.dir={sweep}", cwd=tmp_path, check=False,
        timeout=150,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    # One line per failed job, as for spawned ranks (the traceback is in its logs/), even for a rank run in-process;
    # nothing from the sweeper, whose study has no completed trial to report.
    assert "Traceback" not in out and "No trials are completed yet" not in out, out
    assert all("Traceback" in (sweep / str(i) / "logs" / "rank0.log").read_text() for i in range(2))
    assert proc.returncode == 1, out
    assert "ddpexp: every trial of the study failed: 2 job(s) of the sweep failed:" in proc.stderr, out
    for i in range(2):
        assert f"{sweep / str(i)}: rank 0 failed: RuntimeError: debug.fail_at_step=1" in proc.stderr
        assert read_summary(sweep / str(i))["status"] == "failed"
    assert not (sweep / "optimization_results.yaml").exists()


@pytest.mark.timeout(240)
def test_a_sweep_of_a_minimized_objective_reports_the_lowest_first(tmp_path: Path) -> None:
    """experiment=diabetes_mlp optimizes val/mse, which task=regression declares minimized: every job records that
    mode (and each metric's direction), and the report names the job of the lowest val/mse best (by the metric's
    name alone it maximized val/mse, and val/mae)."""
    sweep = tmp_path / "sweep"
    run_ddpexp(
        "-m", "experiment=diabetes_mlp", "optimizer.lr=1e-4,1e-2", "epochs=2", "gpus=1", "wandb.mode=disabled",
        f"hydra.sweep.dir={sweep}", cwd=tmp_path, timeout=200,
    )  # fmt: skip
    summaries = [read_summary(sweep / str(i)) for i in range(2)]
    assert [s["objective"] for s in summaries] == [{"name": "val/mse", "mode": "min"}] * 2
    assert summaries[0]["directions"] == {"train/loss": "min", "val/mse": "min", "val/mae": "min", "val/r2": "max"}
    mse = [s["final"]["val/mse"] for s in summaries]
    best = mse.index(min(mse))
    assert mse[1 - best] > mse[best]
    report = run_ddpexp("report", str(sweep), cwd=tmp_path)
    assert "2 job(s): 2 completed; objective val/mse (minimize)" in report.stdout
    assert f"best: job {best}, val/mse={fmt(mse[best])}" in report.stdout
    with open(sweep / "report.csv", newline="") as f:
        assert [float(r["val/mse"]) for r in csv.DictReader(f)] == sorted(mse)
    mae = [s["final"]["val/mae"] for s in summaries]  # another metric: its direction is in the record too
    report = run_ddpexp("report", str(sweep), "--objective", "val/mae", cwd=tmp_path)
    assert "objective val/mae (minimize)" in report.stdout and f"best: job {mae.index(min(mae))}," in report.stdout
