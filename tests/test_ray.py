"""launcher=ray against a real Ray head (the session's `ray_head`, 2 CPUs): few runs, each checking several things."""

from __future__ import annotations

import contextlib
import csv
import os
import re
import shutil
import signal
import tempfile
import time
from pathlib import Path

import pytest

from conftest import (
    COMMON,
    assert_same_run,
    check_run_record,
    check_sharded_run,
    ctrl_c,
    ddpexp_env,
    read_summary,
    run_ddpexp,
    start,
    wait_for_step,
)
from wandb_offline import find_offline_runs, read_offline_run

pytestmark = [pytest.mark.ray, pytest.mark.slow]

RAY = ["launcher=ray", "device=cpu"]
TINY = ["data=digits", "epochs=1", "max_steps=4", "log_every_n_steps=2", "wandb.mode=disabled", "gpus=2"]


@pytest.mark.timeout(300)
def test_a_killed_rank_restarts_the_gang_and_the_run_is_bit_equal_to_spawn(
    tmp_path: Path, ray_head: dict[str, str], reference: Path
) -> None:
    """Rank 1's process SIGKILLed after step 7: the gang restarts once from step 5's checkpoint."""
    proc = run_ddpexp(*RAY, *COMMON, "launcher.max_restarts=1", "debug.kill_at_step=7", "debug.fail_rank=1",
                      "debug.check_replicas=true", "hydra.run.dir=job", cwd=tmp_path, env=ray_head, timeout=240, wandb=True)  # fmt: skip
    job = tmp_path / "job"
    summary = check_run_record(job, "ray", 2)
    assert summary["restarts"] == 1 and summary["ray"] == {"placement": "PACK", "restarts": 1}
    assert summary["resumed_from"]["step"] == 5
    assert "ddpexp: rank 1 failed: its process died" in proc.stdout and "restarting the gang" in proc.stdout
    assert "Traceback" not in proc.stdout + proc.stderr  # rank 0's gloo error, an echo, is not shown
    assert_same_run(job, reference)
    runs = [read_offline_run(r) for r in find_offline_runs(job / "wandb")]
    assert runs and {r["id"] for r in runs} == {summary["wandb"]["id"]}  # the restart continues the same W&B run


@pytest.mark.timeout(300)
def test_a_killed_rank_without_restarts_fails_the_job_in_one_line_naming_it(
    tmp_path: Path, ray_head: dict[str, str]
) -> None:
    proc = run_ddpexp(*RAY, *TINY, "debug.kill_at_step=2", "debug.fail_rank=1", "hydra.run.dir=job", cwd=tmp_path,
                      env=ray_head, check=False, timeout=240)  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert re.fullmatch(r"ddpexp: error: rank 1 failed: its process died \(.*\)\n", proc.stderr), proc.stderr
    summary = read_summary(tmp_path / "job")
    assert summary["status"] == "failed" and summary["error"].startswith("rank 1 failed: its process died (")
    assert "restarting" not in proc.stdout


@pytest.mark.timeout(300)
def test_ctrl_c_checkpoints_exits_130_and_the_rerun_resumes_bit_equal(
    tmp_path: Path, ray_head: dict[str, str], reference: Path
) -> None:
    job = tmp_path / "job"
    args = [*RAY, *COMMON, f"hydra.run.dir={job}"]
    proc = start([*args, "debug.step_delay_s=0.3"], tmp_path, ray_head)
    out, err = ctrl_c(
        proc, lambda: wait_for_step(job, 4, proc, timeout=120)
    )  # the command's group (the actors are not in it)
    summary = read_summary(job)
    assert proc.returncode == 130 and summary["status"] == "interrupted", out + err
    assert f"interrupted by SIGINT at step {summary['steps']}" in err and "resume with: python -m ddpexp" in err
    assert (job / "checkpoints" / "latest").read_text() == f"step-{summary['steps']:08d}.pt"
    deadline = time.time() + 10  # the ranks' actors (Ray titles their processes ray::Rank) end; the head runs on
    while processes_naming("ray::Rank") and time.time() < deadline:
        time.sleep(0.5)
    assert processes_naming("ray::Rank") == [], "a rank's actor outlived the interrupted job"
    resumed = run_ddpexp(*args, cwd=tmp_path, env=ray_head, timeout=240)
    assert f"resumed from {job}/checkpoints/step-{summary['steps']:08d}.pt" in resumed.stdout
    assert read_summary(job)["status"] == "completed"
    assert_same_run(job, reference)


@pytest.mark.timeout(300)
def test_a_sweep_submits_every_job_before_waiting(tmp_path: Path, ray_head: dict[str, str]) -> None:
    """2 jobs x 2 ranks on a 2-CPU head: the second job's placement group waits for the first's CPUs."""
    sweep = tmp_path / "sweep"
    tracked = [a for a in TINY if a != "wandb.mode=disabled"]  # offline W&B: one run per job, the sweep its group
    proc = run_ddpexp("-m", *RAY, *tracked, "seed=1,2", f"hydra.sweep.dir={sweep}", cwd=tmp_path, env=ray_head,
                      timeout=240, wandb=True)  # fmt: skip
    lines = proc.stdout.splitlines()
    submitted = [i for i, line in enumerate(lines) if line.startswith("ddpexp: submitted 2 rank(s) to Ray")]
    first_done = next(i for i, line in enumerate(lines) if line.startswith("ddpexp: completed"))
    assert len(submitted) == 2 and max(submitted) < first_done, proc.stdout
    for n in range(2):
        summary = read_summary(sweep / str(n))
        assert (summary["status"], summary["launcher"], summary["world_size"]) == ("completed", "ray", 2)
    runs = [read_offline_run(r) for r in find_offline_runs(sweep)]
    assert len(runs) == 2 and {r["group"] for r in runs} == {str(sweep)}
    report = run_ddpexp("report", str(sweep), cwd=tmp_path)
    assert "2 job(s): 2 completed" in report.stdout, report.stdout
    with open(sweep / "report.csv") as f:
        assert sorted(row["seed"] for row in csv.DictReader(f)) == ["1", "2"]


@pytest.mark.timeout(120)
def test_refusals_are_one_line_and_start_nothing(tmp_path: Path, ray_head: dict[str, str]) -> None:
    for args, message in [
        (["launcher.address=127.0.0.1:1"], r"launcher.address='127.0.0.1:1': no Ray cluster answers there \("),
        (["gpus=64"], r"gpus=64 x launcher.nodes=1: 64 ranks of \{'CPU': 1.0\} each, but the Ray cluster at "
                      r"127.0.0.1:\d+ can place at most 2 \(PACK over 1 node\(s\)\); ask for fewer"),
        (["launcher.placement=STRICT_SPREAD"], r"gpus=2 x launcher.nodes=1: 2 ranks .* can place at most 1 "
                                               r"\(STRICT_SPREAD over 1 node\(s\)\)"),
        (["device=cuda"], r"device=cuda: the Ray cluster at 127.0.0.1:\d+ has no GPUs; use device=cpu"),
        (["launcher.placement=PAKC"], r"launcher.placement='PAKC': must be one of"),
    ]:  # fmt: skip
        proc = run_ddpexp(*RAY, *TINY, *args, "hydra.run.dir=job", cwd=tmp_path, env=ray_head, check=False, timeout=60)
        assert proc.returncode == 2 and re.fullmatch(f"ddpexp: error: {message}.*\n", proc.stderr), proc.stderr
        assert not (tmp_path / "job").exists()
    plan = run_ddpexp("launcher=ray", *TINY[:-1], "plan=true", cwd=tmp_path, env=ray_head)  # device=auto: the head's
    assert "rank 1: device=cpu RANK=1" in plan.stdout and "rank 2:" not in plan.stdout
    assert "placement group of 2 x {'CPU': 1.0} (PACK)" in plan.stdout


def test_plan_without_an_address_starts_no_runtime(tmp_path: Path) -> None:
    pytest.importorskip("ray", reason="Ray is not installed here: pip install -e '.[ray]'")
    env = {k: v for k, v in ddpexp_env().items() if k != "RAY_ADDRESS"}
    plan = run_ddpexp(*RAY, *TINY, "launcher.nodes=2", "launcher.placement=SPREAD", "plan=true", "hydra.run.dir=job",
                      cwd=tmp_path, env=env)  # fmt: skip
    assert "Ray (a local runtime of this command): placement group of 4 x {'CPU': 1.0} (SPREAD)" in plan.stdout
    assert "rank 3: device=cpu RANK=3" in plan.stdout and "WORLD_SIZE=4" in plan.stdout
    assert not (tmp_path / "job").exists()


def processes_naming(text: str) -> list[int]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text in cmdline.read_bytes().decode(errors="replace"):
                found.append(int(cmdline.parent.name))
        except OSError:
            continue
    return found


@pytest.mark.timeout(300)
def test_a_local_runtime_runs_a_sharded_job_and_is_gone_after(tmp_path: Path, reference: Path) -> None:
    """No address: the command starts a Ray runtime of its own (its processes name its temp dir) and ends it. The
    job is strategy=fsdp2: Ray's two actors train the ddp reference's model from their shards (ddp on Ray, bit-equal
    to spawn: the killed-rank test below and the launcher contract)."""
    pytest.importorskip("ray", reason="Ray is not installed here: pip install -e '.[ray]'")
    temp = tempfile.mkdtemp(prefix="rl", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
    env = {k: v for k, v in ddpexp_env().items() if k != "RAY_ADDRESS"}
    env.update(RAY_TMPDIR=temp, RAY_AUTH_MODE="disabled")
    try:
        proc = run_ddpexp(*RAY, *COMMON, "strategy=fsdp2", "hydra.run.dir=job", cwd=tmp_path, env=env,
                          timeout=240)  # fmt: skip
        assert "ddpexp: submitted 2 rank(s) to Ray (a local runtime of this command)" in proc.stdout
        assert list(Path(temp).glob("ray/session_*")), "the runtime was not this command's own"
        assert check_sharded_run(tmp_path / "job", 2, reference)["launcher"] == "ray"
        deadline = time.time() + 10
        while processes_naming(temp) and time.time() < deadline:
            time.sleep(0.5)
        assert processes_naming(temp) == [], "the command's Ray runtime outlived it"
    finally:
        for pid in processes_naming(temp):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(temp, ignore_errors=True)
