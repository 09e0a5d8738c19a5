"""The best checkpoint and early stopping: the rules as functions, then one real 2-rank run whose val/loss bottoms
out mid-run, and the same run killed mid-patience and restarted by torchrun, resumed from a checkpoint taken at an
epoch's last step."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import assert_same_run, read_metrics, read_summary, run_ddpexp

# 2 ranks x 12 steps an epoch on the real digits; the mlp at this lr reaches its lowest val/loss at step 48 (epoch 3)
# and does worse after it. A checkpoint every 12 steps is one at every epoch's last step.
PEAKS = ["gpus=2", "model=mlp", "optimizer.lr=0.03", "objective=val/loss", "epochs=6", "log_every_n_steps=4",
         "checkpoint_every_n_steps=12", "keep_last_checkpoints=2", "wandb.mode=disabled"]  # fmt: skip


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("uninterrupted")
    run_ddpexp("launcher=spawn", *PEAKS, "hydra.run.dir=job", cwd=root, timeout=150)
    return root / "job"


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_resumed_from_an_epoch_s_last_step_the_record_is_the_uninterrupted_one(
    tmp_path: Path, uninterrupted: Path
) -> None:
    job = tmp_path / "job"
    run_ddpexp(
        "launcher=torchrun", "launcher.max_restarts=1", *PEAKS, "debug.kill_at_step=64", "debug.fail_rank=1",
        f"hydra.run.dir={job}", cwd=tmp_path, timeout=240,
    )  # fmt: skip
    summary = read_summary(job)
    assert summary["status"] == "completed" and summary["restarts"] == 1
    assert summary["resumed_from"]["step"] == 60  # the checkpoint at epoch 4's last step, after its evaluation
    val_steps = [m["step"] for m in read_metrics(job) if "val/loss" in m]
    assert val_steps == sorted(set(val_steps))  # step 60's evaluation is recorded once
    assert_same_run(job, uninterrupted)
