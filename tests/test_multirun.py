"""Multiruns that meet failures and kills: the sweep goes on past a failed job and says so in its exit code; a
sweep killed midway and run again finishes only the missing work, leaving completed jobs' files untouched."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ctrl_c, ddpexp_env, mtimes, read_summary, run_ddpexp, until

pytestmark = pytest.mark.slow

# One rank per job runs in the command's own process: four quick jobs in one Python.
ONE_RANK = ["gpus=1", "max_steps=10", "log_every_n_steps=2", "checkpoint_every_n_steps=2", "wandb.mode=disabled"]


def test_a_failed_job_is_recorded_and_the_sweep_goes_on(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    proc = run_ddpexp(
        "-m", *ONE_RANK, "debug.fail_at_step=3", "debug.fail_rank=0,1", f"hydra.sweep.dir={sweep}",
        cwd=tmp_path, check=False, timeout=180,
    )  # fmt: skip
    statuses = [read_summary(sweep / str(i))["status"] for i in range(2)]
    assert statuses == ["failed", "completed"]
    assert "debug.fail_at_step=3: rank 0 fails on purpose" in read_summary(sweep / "0")["error"]
    assert proc.returncode == 1 and "ddpexp: 1 job(s) of the sweep failed:" in proc.stderr
    assert f"{sweep / '0'}: rank 0 failed: RuntimeError: debug.fail_at_step=3" in proc.stderr

    report = run_ddpexp("report", str(sweep), cwd=tmp_path)
    assert "2 job(s): 1 completed, 1 failed" in report.stdout
    rows = [r for r in map(str.split, report.stdout.splitlines()) if len(r) > 3 and r[0].isdigit() and r[1].isdigit()]
    assert sorted(row[2] for row in rows) == ["0", "1"] and [r[3] for r in rows].count("failed") == 1
    assert "job 0 (failed): rank 0 failed: RuntimeError: debug.fail_at_step=3" in report.stdout
    assert (sweep / "report.csv").read_text().count("\n") == 3 and (sweep / "report_curves.png").stat().st_size


def test_a_bad_value_in_the_last_job_stops_the_sweep_before_the_first_starts(tmp_path: Path) -> None:
    """Every job of a basic sweep is composed and checked (the typed config, the parts' dry build) before job 0
    trains: one line, exit 2, and no sweep dir left behind."""
    sweep = tmp_path / "sweep"
    proc = run_ddpexp("-m", "model._target_=ddpexp.models.cnn,no_such_module.Net", "gpus=1", "max_steps=2",
                      "wandb.mode=disabled", f"hydra.sweep.dir={sweep}", cwd=tmp_path, check=False)  # fmt: skip
    why = "model._target_='no_such_module.Net': no such callable (a dotted path like mypkg.module.fn)"
    assert (proc.returncode, proc.stderr.strip()) == (2, f"ddpexp: error: job 1 of the sweep: {why}"), proc.stderr
    assert "Launching 2 jobs" not in proc.stdout and not sweep.exists()
    proc = run_ddpexp("-m", "gpus=1", "optimizer.lr=1e-3,-1", f"hydra.sweep.dir={sweep}", cwd=tmp_path, check=False)
    assert (proc.returncode, proc.stderr.strip()) == (2, "ddpexp: error: job 1 of the sweep: optimizer.lr=-1: must "
                                                         "be a number >= 0"), proc.stderr  # fmt: skip
    assert not sweep.exists()


def test_a_killed_sweep_run_again_finishes_only_the_missing_work(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    args = ["-m", *ONE_RANK, "seed=0,1,2", f"hydra.sweep.dir={sweep}"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddpexp", *args, "debug.step_delay_s=0.2"], cwd=tmp_path, env=ddpexp_env(),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        marker = sweep / "1" / "checkpoints" / "latest"
        deadline = time.time() + 120
        while time.time() < deadline and not (marker.exists() and marker.read_text() >= "step-00000004.pt"):
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGKILL)  # job 1 midway, job 2 never started
        proc.wait(timeout=30)
    finally:
        proc.kill()
    assert read_summary(sweep / "0")["status"] == "completed"
    assert not (sweep / "1" / "summary.json").exists() and not (sweep / "2").exists()
    done = mtimes(sweep / "0")

    again = run_ddpexp(*args, "debug.step_delay_s=0.2", cwd=tmp_path, timeout=180)
    assert again.stdout.count("already completed in") == 1
    assert mtimes(sweep / "0") == done
    resumed = read_summary(sweep / "1")
    assert resumed["status"] == "completed" and resumed["resumed_from"]["step"] >= 4 and resumed["steps"] == 10
    assert read_summary(sweep / "2")["status"] == "completed" and "resumed_from" not in read_summary(sweep / "2")


def test_ctrl_c_stops_the_whole_sweep_with_the_command_that_resumes_it(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddpexp", "-m", *ONE_RANK, "seed=0,1", "debug.step_delay_s=0.3",
         f"hydra.sweep.dir={sweep}"], cwd=tmp_path, env=ddpexp_env(), text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    metrics = sweep / "0" / "metrics.jsonl"
    _, err = ctrl_c(proc, lambda: until(lambda: metrics.exists() and bool(metrics.read_text().strip()), proc), wait=60)
    assert proc.returncode == 130, err
    assert read_summary(sweep / "0")["status"] == "interrupted" and not (sweep / "1").exists()
    assert (
        f"resume with: python -m ddpexp -m {' '.join(ONE_RANK)} seed=0,1" in err and f"hydra.sweep.dir={sweep}" in err
    )
