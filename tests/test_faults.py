"""Faults on real multi-process runs: whatever stops a job, the next attempt ends with the weights of a run that
was never stopped (same seed, same data order), and the record and W&B run continue without duplicates.

Every run here is compared with one uninterrupted reference run (the session fixture `reference`). The mlp has dropout, so the
per-rank RNG states must be restored too, not only weights, optimizer and data position."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import (
    COMMON,
    ROOT,
    alive,
    assert_same_run,
    children_of,
    load_weights,
    mtimes,
    read_metrics,
    read_summary,
    run_ddpexp,
    start,
    wait_for_step,
)
from ddpexp.job import remove_partial
from wandb_offline import find_offline_runs, read_offline_run

pytestmark = pytest.mark.slow


def test_resume_mid_epoch_continues_the_same_run_and_refuses_a_changed_config(tmp_path: Path, reference: Path) -> None:
    job = tmp_path / "job"
    args = ["launcher=spawn", *COMMON, f"hydra.run.dir={job}"]
    failed = run_ddpexp(*args, "debug.fail_at_step=17", cwd=tmp_path, check=False, wandb=True)
    assert failed.returncode == 1 and "debug.fail_at_step=17" in failed.stderr
    ckpts = sorted(p.name for p in (job / "checkpoints").glob("step-*.pt"))
    assert ckpts == ["step-00000010.pt", "step-00000015.pt"]  # keep-last-2; 15 is mid-epoch 1
    assert max(m["step"] for m in read_metrics(job)) == 16  # logged past the checkpoint before failing

    # A result-changing key differs: one line naming it, exit 2, and nothing touched.
    before = mtimes(job)
    drift = run_ddpexp(*args, "batch_size=32", "optimizer.lr=0.01", cwd=tmp_path, check=False)
    assert drift.returncode == 2 and drift.stderr.count("\n") == 1, drift.stderr
    assert "different batch_size, optimizer.lr;" in drift.stderr and "resume_allow_config_change=true" in drift.stderr
    after = mtimes(job)
    assert {p: t for p, t in after.items() if ".hydra" not in p.parts} == {
        p: t for p, t in before.items() if ".hydra" not in p.parts
    }

    resumed = run_ddpexp(*args, cwd=tmp_path, wandb=True)  # resume=auto is the default
    assert "resuming from" in resumed.stdout and "step-00000015.pt" in resumed.stdout
    summary = read_summary(job)
    assert summary["status"] == "completed" and summary["resumed_from"]["step"] == 15
    assert_same_run(job, reference)

    # One W&B run, continued: the second offline segment has the same id and only steps the first had not.
    runs = [read_offline_run(r) for r in sorted(find_offline_runs(job / "wandb"))]
    assert len(runs) == 2 and runs[0]["id"] == runs[1]["id"] == summary["wandb"]["id"]
    first, second = ({row["_step"] for row in r["history"]} for r in runs)
    assert max(first) == 16 and min(second) > 16 and first | second == {m["step"] for m in read_metrics(job)}

    again = run_ddpexp(*args, cwd=tmp_path)
    assert "already completed" in again.stdout and read_summary(job)["wall_time_s"] == summary["wall_time_s"]


def test_a_larger_max_steps_continues_a_finished_run_mid_epoch(tmp_path: Path, reference: Path) -> None:
    import torch

    job = tmp_path / "job"
    args = ["launcher=spawn", *COMMON, f"hydra.run.dir={job}"]
    run_ddpexp(*args, "max_steps=17", cwd=tmp_path)  # ends mid-epoch 1 (12 steps an epoch), evaluates
    assert read_summary(job)["steps"] == 17 and "val/acc" in read_summary(job)["final"]
    longer = run_ddpexp(*args, cwd=tmp_path)  # max_steps back to the reference's: the epoch goes on from step 18
    assert "resuming from" in longer.stdout and "step-00000017.pt" in longer.stdout
    summary = read_summary(job)
    assert (summary["status"], summary["steps"], summary["epochs"]) == ("completed", 24, 2)
    ours, ref = load_weights(job), load_weights(reference)
    assert all(torch.equal(ours[k], ref[k]) for k in ref)  # the evaluation at step 17 drew no training RNG
    assert summary["final"] == read_summary(reference)["final"]
    train = lambda j: [(m["step"], m["train/loss"]) for m in read_metrics(j) if "train/loss" in m]  # noqa: E731
    # The first run logged its last step, 17; its loss there and at 18 averages other steps than the reference's.
    assert [r for r in train(job) if r[0] not in (17, 18)] == [r for r in train(reference) if r[0] != 18]
    assert [r[0] for r in train(job)] == sorted([17, *(r[0] for r in train(reference))])


def test_a_rank_killed_midway_through_a_save_leaves_no_partial_file(tmp_path: Path, reference: Path) -> None:
    """torchrun's restart after a SIGKILLed rank: rank 0 killed once step-15.pt's bytes are written, before its
    rename. The restart starts from step 10 (the previous checkpoint stays the latest), removes the partial file
    in one log line, and ends bit-equal to the run never stopped."""
    job = tmp_path / "job"
    proc = run_ddpexp(
        "launcher=torchrun", "launcher.max_restarts=1", *COMMON, "debug.kill_in_save_at_step=15",
        f"hydra.run.dir={job}", cwd=tmp_path, timeout=180,
    )  # fmt: skip
    summary = read_summary(job)
    assert summary["status"] == "completed" and summary["restarts"] == 1
    assert summary["resumed_from"]["step"] == 10  # the checkpoint before the cut-short step 15
    removed = re.findall(
        r"removed 1 partial file\(s\) of writes cut short: checkpoints/step-00000015\.pt\.tmp\.\d+", proc.stdout
    )
    assert len(removed) == 1, proc.stdout
    kept = sorted(p.name for p in (job / "checkpoints").iterdir())
    newest = [f"step-{s:08d}.pt" for s in (20, 24)]  # keep_last_checkpoints=2
    assert kept == sorted([*newest, "best.pt", "last.pt", "latest"]), kept
    assert_same_run(job, reference)


def test_a_live_writers_partial_file_is_kept(tmp_path: Path) -> None:
    """remove_partial takes only files whose writer is gone: a live pid's stays, this process's own goes (it
    writes none between saves), and other files are never touched."""
    writer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        gone = subprocess.Popen([sys.executable, "-c", "pass"])
        gone.wait()
        names = [f"step-1.pt.tmp.{writer.pid}", f"step-2.pt.tmp.{gone.pid}", f"summary.json.tmp.{os.getpid()}",
                 "step-3.pt", "notes.tmp.txt", "a.tmp.12x"]  # fmt: skip
        for name in names:
            (tmp_path / name).write_text("x")
        removed = remove_partial([str(tmp_path), str(tmp_path / "missing")])
        assert sorted(removed) == sorted(str(tmp_path / n) for n in names[1:3])
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([names[0], *names[3:]])
        # A writer killed between moving the old best.pt aside and renaming the new one in: the old one comes back.
        (tmp_path / f"best.pt.old.tmp.{gone.pid}").mkdir()
        (tmp_path / f"best.pt.old.tmp.{gone.pid}" / "state.pt").write_text("old best")
        (tmp_path / f"last.pt.old.tmp.{gone.pid}").write_text("superseded")
        (tmp_path / "last.pt").write_text("new")
        assert remove_partial([str(tmp_path)]) == [str(tmp_path / f"last.pt.old.tmp.{gone.pid}")]
        assert (tmp_path / "best.pt" / "state.pt").read_text() == "old best" and (
            tmp_path / "last.pt"
        ).read_text() == "new"
    finally:
        writer.kill()
        writer.wait()


@pytest.mark.parametrize("launcher", ["spawn", "torchrun"])
def test_ctrl_c_checkpoints_prints_how_to_resume_and_resuming_ends_bit_equal(
    tmp_path: Path, reference: Path, launcher: str
) -> None:
    job = tmp_path / "job"
    proc = start([f"launcher={launcher}", *COMMON, "debug.step_delay_s=0.25", f"hydra.run.dir={job}"], tmp_path)
    try:
        wait_for_step(job, 4, proc)
        os.killpg(proc.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
        # Ranks stop after the next step (0.25 s); measured 4-8 s to the command's exit on 2 busy cores. torchrun's
        # agent used to wait out its 30 s shutdown timeout here, after which this hard timeout fails the test.
        out, err = proc.communicate(timeout=25)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    summary = read_summary(job)
    assert summary["status"] == "interrupted" and 4 <= summary["steps"] < 24
    assert summary["signal"] == "SIGINT"  # the signal the user sent, whatever the launcher passed on
    stopped = f"step-{summary['steps']:08d}.pt"
    assert (job / "checkpoints" / "latest").read_text() == stopped
    line = [x for x in err.splitlines() if x.startswith("ddpexp: interrupted by SIG")]
    assert len(line) == 1 and f"interrupted by SIGINT at step {summary['steps']}, checkpoint " in line[0], err
    command = shlex.split(line[0].split("resume with: ")[1])
    assert command[:3] == ["python", "-m", "ddpexp"] and f"hydra.run.dir={job}" in command

    run_ddpexp(*command[3:], cwd=tmp_path, timeout=180)
    assert read_summary(job)["resumed_from"]["step"] == summary["steps"]
    assert_same_run(job, reference)


@pytest.mark.parametrize("launcher", ["spawn", "torchrun"])
def test_a_second_ctrl_c_exits_at_once_and_takes_the_ranks_down(tmp_path: Path, launcher: str) -> None:
    job = tmp_path / "job"
    proc = start([f"launcher={launcher}", *COMMON, "debug.step_delay_s=5", f"hydra.run.dir={job}"], tmp_path)
    try:
        deadline = time.time() + 90  # until the ranks train (their first step then takes 5 s)
        while time.time() < deadline and proc.poll() is None and "steps/epoch" not in log_of(job):
            time.sleep(0.2)
        time.sleep(0.5)
        ranks = [pid for kid in children_of(proc.pid) for pid in [kid, *children_of(kid)]]
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(0.5)
        os.kill(proc.pid, signal.SIGINT)  # the ranks are in their own group now: the user's second Ctrl-C
        _, err = proc.communicate(timeout=10)  # at once: a rank's step takes 5 s, and the first stop waits for it
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert "interrupted again: ranks stopped at once" in err
    time.sleep(2)
    assert len(ranks) >= 2 and [p for p in ranks if alive(p)] == []


def log_of(job: Path) -> str:
    log = job / "logs" / "rank0.log"
    return log.read_text() if log.exists() else ""


def test_sigkills_at_random_moments_then_resume_ends_bit_equal(tmp_path: Path, reference: Path) -> None:
    """The whole command SIGKILLed (often inside a save: a checkpoint every step), twice; then it completes."""
    import random

    job = tmp_path / "job"
    args = ["launcher=spawn", *COMMON, "checkpoint_every_n_steps=1", f"hydra.run.dir={job}"]
    rng = random.Random(7)
    marker, stopped_at = job / "checkpoints" / "latest", []
    for _ in range(2):
        before = marker.read_text() if marker.exists() else ""
        proc = start([*args, "debug.step_delay_s=0.05"], tmp_path)
        try:
            deadline = time.time() + 90
            while time.time() < deadline and (not marker.exists() or marker.read_text() == before):
                time.sleep(0.05)  # this attempt has saved a checkpoint of its own
            time.sleep(rng.uniform(0.0, 0.5))
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        finally:
            proc.kill()
        stopped_at.append(marker.read_text())
    assert stopped_at[0] != "" and stopped_at[1] > stopped_at[0]  # the second attempt resumed and went further
    run_ddpexp(*args, cwd=tmp_path, timeout=180)
    assert read_summary(job)["resumed_from"]["step"] > 0
    assert_same_run(job, reference)


def test_a_hung_rank_is_ended_by_the_collective_timeout(tmp_path: Path) -> None:
    proc = run_ddpexp(
        "launcher=spawn", "gpus=2", "debug.hang_at_step=3", "debug.fail_rank=1", "dist_timeout_s=5",
        "wandb.mode=disabled", "hydra.run.dir=job", cwd=tmp_path, check=False, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1
    assert re.search(r"rank 0 failed: .*(Timed out|timeout|timed out)", proc.stderr), proc.stderr
    assert read_summary(tmp_path / "job")["status"] == "failed"


def test_concurrent_jobs_of_each_launcher_never_collide_on_a_port(tmp_path: Path) -> None:
    procs = []
    for i, launcher in enumerate(["spawn", "torchrun"] * 2):
        args = [
            f"launcher={launcher}",
            "gpus=2",
            "max_steps=3",
            "epochs=1",
            "wandb.mode=disabled",
            f"hydra.run.dir=j{i}",
        ]
        procs.append(start(args, tmp_path))
    results = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, [err[-2000:] for _, err in results]
    assert all(read_summary(tmp_path / f"j{i}")["steps"] == 3 for i in range(4))


def test_uneven_per_rank_batches_end_together(tmp_path: Path) -> None:
    """Rank 0's stream has 5 batches per epoch, rank 1's 9: every epoch ends when the first rank runs dry."""
    proc = run_ddpexp(
        "launcher=spawn", "gpus=2", "data._target_=uneven_data.splits", "batch_size=8", "model=mlp", "epochs=2",
        "debug.check_replicas=true", "wandb.mode=disabled", "hydra.run.dir=job", cwd=tmp_path, timeout=120,
        env={"PYTHONPATH": str(ROOT / "tests")},
    )  # fmt: skip
    summary = read_summary(tmp_path / "job")
    assert proc.returncode == 0 and summary["status"] == "completed" and summary["steps"] == 10
    assert summary["replicas"]["identical"] and summary["val_samples"] == 30


def test_resume_from_another_jobs_checkpoint_starts_a_new_record(tmp_path: Path, reference: Path) -> None:
    """resume=PATH: the parent resolves PATH (a job dir: its newest checkpoint) and the ranks start from that state,
    with a record and W&B run of their own; the other job's files stay untouched."""
    before = mtimes(reference)
    job = tmp_path / "longer"
    proc = run_ddpexp(
        "launcher=spawn", *COMMON, "epochs=3", f"resume={reference}", f"hydra.run.dir={job}", cwd=tmp_path, wandb=True
    )
    newest = reference / "checkpoints" / "step-00000024.pt"
    assert f"resuming from {newest}" in proc.stdout
    summary = read_summary(job)
    assert summary["status"] == "completed" and summary["resumed_from"] == {"path": str(newest), "step": 24}
    assert summary["steps"] == 36 and summary["epochs"] == 3
    assert min(m["step"] for m in read_metrics(job)) > 24  # its own record: only what it trained
    assert summary["wandb"]["id"] != read_summary(reference)["wandb"]["id"]
    assert mtimes(reference) == before


@pytest.mark.timeout(240)
@pytest.mark.parametrize("launcher", ["spawn", "torchrun"])
def test_a_rank_killed_by_a_signal_is_the_error_not_its_peers_echo(tmp_path: Path, launcher: str) -> None:
    """Rank 1 SIGKILLed (the OOM killer's way), no restarts: rank 0's gloo error ("Connection reset by peer") is an
    echo of its going, and was the one reported."""
    proc = run_ddpexp(f"launcher={launcher}", "gpus=2", "max_steps=4", "log_every_n_steps=2", "wandb.mode=disabled",
                      "debug.kill_at_step=2", "debug.fail_rank=1", "hydra.run.dir=job", cwd=tmp_path, check=False)  # fmt: skip
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.splitlines()[-1] == "ddpexp: error: rank 1 failed: its process died (SIGKILL)"
    assert read_summary(tmp_path / "job")["error"] == "rank 1 failed: its process died (SIGKILL)"
