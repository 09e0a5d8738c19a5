"""launcher=slurm against a real Slurm cluster (slurmctld + two slurmd on loopback), through submitit."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest
import torch

from conftest import check_run_record, check_sharded_run, load_weights, read_summary, run_ddpexp, scontrol_job
from wandb_offline import find_offline_runs, read_offline_run

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

SLURM = ["launcher=slurm", "device=cpu", "gpus=2", "launcher.poll_interval_s=0.5"]
TRAIN = ["max_steps=8", "log_every_n_steps=4", "seed=5", "debug.check_replicas=true"]


def test_device_auto_asks_slurm_and_runs_cpu_ranks_on_nodes_without_gpus(tmp_path: Path, slurm: dict[str, str]) -> None:
    """The test cluster's nodes declare no GRES (tests/slurm/cluster.sh): sinfo says `(null)` for them."""
    auto = ["launcher=slurm", "gpus=2", "launcher.poll_interval_s=0.5"]  # device=auto, the default
    plan = run_ddpexp(*auto, "plan=true", "hydra.run.dir=plan", cwd=tmp_path, env=slurm)
    assert "rank 1: device=cpu RANK=1" in plan.stdout and "--gpus-per-node" not in plan.stdout
    unsized = run_ddpexp("launcher=slurm", "plan=true", "hydra.run.dir=unsized", cwd=tmp_path, env=slurm)
    assert "rank 1: device=cpu RANK=1" in unsized.stdout and "rank 2:" not in unsized.stdout  # 2 CPU ranks, as spawn
    refused = run_ddpexp(*auto, "device=cuda", "hydra.run.dir=cuda", cwd=tmp_path, env=slurm, check=False)
    assert refused.returncode == 2 and refused.stderr == (
        "ddpexp: error: device=cuda: the nodes of Slurm partition 'debug' have no GPUs (sinfo's GRES); "
        "use device=cpu or another launcher.partition\n"
    )
    run_ddpexp(*auto, "max_steps=4", "wandb.mode=disabled", "hydra.run.dir=job", cwd=tmp_path, env=slurm, timeout=180)
    summary = read_summary(tmp_path / "job")
    assert (summary["status"], summary["device"], summary["world_size"]) == ("completed", "cpu", 2)


@pytest.mark.parametrize(
    ("gres", "gpus"),
    [("(null)", 0), ("gpu:4", 4), ("gpu:a100:4(S:0-1)", 4), ("gpu:a100:2,gpu:v100:2,mps:200", 4),
     ("gpu:2(S:0,1),mps:100", 2), ("mygpu:3", 0), ("gpu:a100_1g.5gb:14(S:0-1)", 14)],
)  # fmt: skip
def test_gpus_per_node_from_sinfo_gres(gres: str, gpus: int) -> None:
    """sinfo's %G field as Slurm prints it (`Gres=` of slurm.conf, with sockets in parentheses)."""
    from ddpexp.launchers.slurm import gres_gpus

    assert gres_gpus(gres) == gpus


def test_slurm_job_completes_and_matches_spawn_bit_for_bit(tmp_path: Path, slurm: dict[str, str]) -> None:
    proc = run_ddpexp(*SLURM, *TRAIN, "hydra.run.dir=slurm_job", cwd=tmp_path, env=slurm, timeout=180, wandb=True)
    job = tmp_path / "slurm_job"
    summary = check_run_record(job, "slurm", 2)
    job_id = summary["slurm"]["job_id"]
    assert (
        f"submitted Slurm job {job_id}" in proc.stdout and "step 8: val/loss" in proc.stdout
    )  # rank 0's log, followed
    assert summary["slurm"]["ntasks"] == "2" and scontrol_job(job_id, slurm)["JobState"] == "COMPLETED"
    assert (job / "submitit" / f"{job_id}_submitted.pkl").exists()  # submitit's files in a subfolder of the job dir
    assert read_offline_run(find_offline_runs(job)[0])["summary"]["val/acc"] == summary["final"]["val/acc"]

    run_ddpexp("launcher=spawn", "gpus=2", *TRAIN, "wandb.mode=disabled", "hydra.run.dir=spawn_job", cwd=tmp_path)
    slurm_w, spawn_w = load_weights(job), load_weights(tmp_path / "spawn_job")
    assert all(torch.equal(slurm_w[k], spawn_w[k]) for k in spawn_w)  # same seed, same data order: same bits


def test_two_nodes_make_world_size_four_of_a_sharded_job(tmp_path: Path, slurm: dict[str, str]) -> None:
    """strategy=fsdp2 over 2 nodes: 4 ranks, each writing its shards (ddp on Slurm: the bit-for-bit test above)."""
    args = [*SLURM, "launcher.nodes=2", *TRAIN, "strategy=fsdp2", "wandb.mode=disabled", "hydra.run.dir=job"]
    run_ddpexp(*args, cwd=tmp_path, env=slurm)
    summary = check_sharded_run(tmp_path / "job", 4)
    assert summary["launcher"] == "slurm" and summary["steps"] == 8
    assert summary["slurm"]["job_nodelist"] == "node[1-2]" and summary["slurm"]["ntasks"] == "4"


def test_a_task_killed_by_a_signal_is_the_error_not_its_peers_echo(tmp_path: Path, slurm: dict[str, str]) -> None:
    """Rank 1 SIGKILLed (the OOM killer's way): rank 0's gloo error ("Connection reset by peer") is an echo of its
    going, and was the one reported; srun's own line says which task a signal ended."""
    proc = run_ddpexp(*SLURM, "max_steps=4", "log_every_n_steps=2", "wandb.mode=disabled", "debug.kill_at_step=2",
                      "debug.fail_rank=1", "hydra.run.dir=job", cwd=tmp_path, env=slurm, timeout=180, check=False)  # fmt: skip
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.splitlines()[-1] == "ddpexp: error: rank 1 failed: its process died (SIGKILL)"
    assert read_summary(tmp_path / "job")["error"] == "rank 1 failed: its process died (SIGKILL)"
    assert re.search(r"ended FAILED; logs in ", proc.stdout), proc.stdout


def test_srun_lines_name_the_task_a_signal_ended() -> None:
    from ddpexp.launchers.slurm import killed_task

    exited = "srun: error: node1: task 0: Exited with exit code 1\n"
    assert (
        str(killed_task(exited + "srun: error: node1: task 1: Killed\n")) == "rank 1 failed: its process died (SIGKILL)"
    )
    segv = killed_task("srun: error: node2: tasks 2-3: Segmentation fault (core dumped)")
    assert segv is not None and segv.died and str(segv) == "rank 2 failed: its process died (SIGSEGV)"
    assert killed_task(exited) is None and killed_task("") is None


def test_sweep_without_waiting_submits_every_job_and_the_cluster_fits_them_at_once(
    tmp_path: Path, slurm: dict[str, str]
) -> None:
    """What ddpexp controls: every job is in the queue before the command returns (it waits for none), and what
    each asks for lets the cluster run them at once. Whether they overlapped is the scheduler's timing, not ours."""
    sweep = tmp_path / "sweep"
    proc = run_ddpexp(
        "-m", *SLURM, "launcher.wait=false", "optimizer.lr=1e-3,2e-3,3e-3", "max_steps=30", f"hydra.sweep.dir={sweep}",
        cwd=tmp_path, env=slurm, timeout=120, wandb=True,
    )  # fmt: skip
    ids = re.findall(r"submitted Slurm job (\d+)", proc.stdout)
    assert len(ids) == 3 and "[rank0]" not in proc.stdout  # returned without following (or waiting for) any job
    deadline = time.time() + 240
    while time.time() < deadline and any(scontrol_job(i, slurm)["JobState"] in ("PENDING", "RUNNING") for i in ids):
        time.sleep(1)
    jobs = [scontrol_job(i, slurm) for i in ids]
    assert [j["JobState"] for j in jobs] == ["COMPLETED"] * 3
    nodes = subprocess.run(["scontrol", "-o", "show", "node"], env=slurm, capture_output=True, text=True).stdout
    total_cpus = sum(int(n) for n in re.findall(r"CPUTot=(\d+)", nodes))
    assert total_cpus > 0 and sum(int(j["NumCPUs"]) for j in jobs) <= total_cpus, (nodes, jobs)
    summaries = [read_summary(sweep / str(n)) for n in range(3)]
    assert [s["status"] for s in summaries] == ["completed"] * 3
    assert sorted(s["slurm"]["job_id"] for s in summaries) == sorted(ids)
    runs = [read_offline_run(r) for r in find_offline_runs(sweep)]
    assert len(runs) == 3 and {r["group"] for r in runs} == {str(sweep)}


def squeue_ids(env: dict[str, str]) -> list[str]:
    return subprocess.run(["squeue", "-h", "-o", "%i"], env=env, capture_output=True, text=True).stdout.split()


def test_plan_prints_the_sbatch_script_and_submits_nothing(tmp_path: Path, slurm: dict[str, str]) -> None:
    before = squeue_ids(slurm)
    proc = run_ddpexp(*SLURM, "launcher.nodes=2", "launcher.partition=debug", "plan=true", "hydra.run.dir=job",
                      cwd=tmp_path, env=slurm)  # fmt: skip
    assert "#SBATCH --nodes=2" in proc.stdout and "#SBATCH --ntasks-per-node=2" in proc.stdout
    assert "#SBATCH --partition=debug" in proc.stdout and "srun --unbuffered" in proc.stdout
    assert "rank 3: device=cpu RANK=3 LOCAL_RANK=1 WORLD_SIZE=4" in proc.stdout
    assert squeue_ids(slurm) == before and not (tmp_path / "job" / "submitit").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["launcher.partition=nope"], "sbatch refused the job: sbatch: error: invalid partition specified: nope"),
        (["device=auto", "launcher.gpus_per_node=4"], "launcher.gpus_per_node=4 but gpus=2 ranks per node"),
    ],
)
def test_slurm_refusals_are_one_clear_line(
    tmp_path: Path, slurm: dict[str, str], args: list[str], message: str
) -> None:
    proc = run_ddpexp(*SLURM, *args, "hydra.run.dir=job", cwd=tmp_path, env=slurm, check=False)
    assert proc.returncode == 2
    assert (
        proc.stderr.strip().splitlines()[-1] == f"ddpexp: error: {message}" or message in proc.stderr.splitlines()[-1]
    )


def test_usr2_checkpoints_requeues_once_and_the_job_resumes_bit_equal(
    tmp_path: Path, slurm: dict[str, str], reference: Path
) -> None:
    """`scancel --signal=USR2` (what Slurm sends before a time limit or preemption) on a running job."""
    from conftest import COMMON, assert_same_run, start, wait_for_step

    job = tmp_path / "job"
    proc = start([*SLURM, *COMMON, "debug.step_delay_s=0.3", f"hydra.run.dir={job}"], tmp_path, slurm, wandb=True)
    try:
        wait_for_step(job, 4, proc, timeout=120)
        deadline = time.time()
        job_id = next((job / "submitit").glob("*_submitted.pkl")).name.split("_")[0]
        subprocess.run(["scancel", "--signal=USR2", job_id], env=slurm, check=True)
        # Slurm holds a requeued job ~2 min before it may start again; the test cluster lets it go at once.
        while time.time() < deadline + 60 and scontrol_job(job_id, slurm).get("Restarts") != "1":
            time.sleep(0.5)
        while time.time() < deadline + 90 and scontrol_job(job_id, slurm)["JobState"] != "PENDING":
            time.sleep(0.5)
        subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], env=slurm, check=True)
        out, err = proc.communicate(timeout=240)
    finally:
        proc.kill()
    assert proc.returncode == 0, out + err
    info, summary = scontrol_job(job_id, slurm), read_summary(job)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1"
    assert summary["status"] == "completed" and summary["restarts"] == 1 and summary["slurm"]["job_id"] == job_id
    stopped = summary["resumed_from"]["step"]
    assert 4 <= stopped < 24 and f"SIGUSR2: stopped at step {stopped}" in (job / "logs" / "rank0.log").read_text()
    assert_same_run(job, reference)
    runs = [read_offline_run(r) for r in find_offline_runs(job / "wandb")]
    assert len(runs) == 2 and runs[0]["id"] == runs[1]["id"] == summary["wandb"]["id"]


def test_ctrl_c_on_the_waiting_command_stops_the_job_at_a_checkpoint(tmp_path: Path, slurm: dict[str, str]) -> None:
    from conftest import COMMON, ctrl_c, start, wait_for_step

    job = tmp_path / "job"
    proc = start([*SLURM, *COMMON, "debug.step_delay_s=0.3", f"hydra.run.dir={job}"], tmp_path, slurm)
    out, err = ctrl_c(proc, lambda: wait_for_step(job, 4, proc, timeout=120))
    summary = read_summary(job)
    assert proc.returncode == 130 and summary["status"] == "interrupted", out + err
    assert f"interrupted by SIGTERM at step {summary['steps']}" in err and "resume with: python -m ddpexp" in err
    assert (job / "checkpoints" / "latest").read_text() == f"step-{summary['steps']:08d}.pt"
    info = scontrol_job(summary["slurm"]["job_id"], slurm)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "0"
