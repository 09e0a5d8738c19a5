"""A job dir's record (.hydra/, summary.json, metrics.jsonl, checkpoints/) is never overwritten by a command that
does not run there, nor mixed with another config's run: one line, exit 2, every file as it was."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from conftest import read_metrics, read_summary, run_ddpexp

pytestmark = pytest.mark.slow

ONE_RANK = ["gpus=1", "max_steps=4", "log_every_n_steps=1", "wandb.mode=disabled"]


def files(job: Path) -> dict[str, bytes]:
    """Every file of the record but Hydra's own log, which each command appends to."""
    return {str(p.relative_to(job)): p.read_bytes() for p in job.rglob("*") if p.is_file() and p.suffix != ".log"}


def refused(args: list[str], cwd: Path, words: str) -> None:
    proc = run_ddpexp(*args, cwd=cwd, check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and proc.stderr.startswith("ddpexp: error:")
    assert words in proc.stderr, proc.stderr


@pytest.mark.timeout(300)
def test_a_finished_run_s_record_survives_every_command_that_does_not_run_there(tmp_path: Path) -> None:
    job = tmp_path / "job"
    args = [*ONE_RANK, f"hydra.run.dir={job}"]
    run_ddpexp(*args, "seed=0", cwd=tmp_path)
    record = files(job)
    assert ".hydra/config.yaml" in record and "checkpoints/last.pt" in record

    refused([*args, "seed=1"], tmp_path, "different data.seed, seed;")  # checkpoints of another config
    refused([*args, "seed=0", "resume=never"], tmp_path, "resume=never")
    refused([*args, "seed=0", "optimizer.lr=-1"], tmp_path, "optimizer.lr")  # bad input in a finished dir
    plan = run_ddpexp(*args, "seed=7", "plan=true", cwd=tmp_path)
    assert "seed" in plan.stdout
    assert files(job) == record  # .hydra/ too, though Hydra rewrote it before each of these commands
    done = run_ddpexp(*args, "seed=0", cwd=tmp_path)
    assert "already completed" in done.stdout and files(job) == record

    # Without its checkpoints the record still says which config it is.
    shutil.rmtree(job / "checkpoints")
    record = files(job)
    refused([*args, "seed=5"], tmp_path, "holds the record of another run")
    assert files(job) == record
    done = run_ddpexp(*args, "seed=0", cwd=tmp_path)
    assert "already completed" in done.stdout and files(job) == record

    # Killed before any checkpoint or summary: the same command starts over, and the record holds each step once.
    (job / "summary.json").unlink()
    rows = read_metrics(job)
    again = run_ddpexp(*args, "seed=0", cwd=tmp_path)
    assert "resuming" not in again.stdout and read_summary(job)["status"] == "completed"
    strip = lambda rows: [{k: v for k, v in r.items() if k != "samples_per_s"} for r in rows]  # noqa: E731
    assert strip(read_metrics(job)) == strip(rows)  # each step once, with the values it had

    # Another config into it, still without a summary: its .hydra/config.yaml tells them apart.
    (job / "summary.json").unlink()
    shutil.rmtree(job / "checkpoints")
    record = files(job)
    refused([*args, "seed=6"], tmp_path, "holds the record of another run")
    assert files(job) == record


@pytest.mark.timeout(300)
def test_another_sweep_into_a_finished_sweep_dir_leaves_its_jobs_as_they_were(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    run_ddpexp("-m", *ONE_RANK, "seed=0,1", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    record = {i: files(sweep / str(i)) for i in (0, 1)}
    sweep_yaml = (sweep / "multirun.yaml").read_bytes()
    other = run_ddpexp("-m", *ONE_RANK, "seed=2,3", f"hydra.sweep.dir={sweep}", cwd=tmp_path, check=False)
    assert other.returncode == 1 and "2 job(s) of the sweep failed" in other.stderr, other.stderr
    assert other.stderr.count("failed: resume:") == 2 and "different data.seed, seed;" in other.stderr
    assert {i: files(sweep / str(i)) for i in (0, 1)} == record
    assert (sweep / "multirun.yaml").read_bytes() == sweep_yaml  # no job of the other sweep ran
