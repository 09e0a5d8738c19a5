"""launcher=env: the command is one rank of a world another launcher started (torchrun, srun, the bare
MASTER_ADDR/MASTER_PORT/WORLD_SIZE/RANK of a Kubeflow PyTorchJob). Real outside launchers: torchrun's elastic agent,
srun on the test Slurm cluster, two processes started here; each run bit-equal to launcher=spawn gpus=2 (the
session's `reference`). Plus the job dir's lock, for every launcher."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import (
    COMMON,
    assert_same_run,
    check_sharded_run,
    ddpexp_env,
    read_metrics,
    read_summary,
    run_ddpexp,
    wait_for_step,
)

ONE_JOB = [*(a for a in COMMON if a != "gpus=2"), "debug.check_replicas=true"]  # the world says how many ranks
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_dirs(root: Path) -> list[Path]:
    return sorted(p.parent for p in root.rglob("summary.json"))


def check_env_record(job: Path, started_by: str, reference: Path, restarts: int = 0) -> None:
    summary = read_summary(job)
    assert (summary["status"], summary["launcher"], summary["started_by"]) == ("completed", "env", started_by)
    assert (summary["world_size"], summary["restarts"]) == (2, restarts)
    assert summary["replicas"]["identical"]
    assert {"rank0.log", "rank1.log"} <= {p.name for p in (job / "logs").iterdir()}  # (a killed attempt's errors)
    assert len(list(job.rglob(".hydra"))) == 1 and not (job / "job.lock").exists()
    assert_same_run(job, reference)


@pytest.mark.timeout(240)
def test_torchrun_started_ranks_one_job_and_a_killed_rank_restarted_bit_equal(tmp_path: Path, reference: Path) -> None:
    """torchrun --max-restarts=1, rank 1 SIGKILLed at step 8: torchrun restarts both ranks, rank 0 takes the first
    attempt's job dir (the timestamped dir Hydra proposes is a new one), and the ranks resume from step 5."""
    proc = subprocess.run(
        [*TORCHRUN, "--standalone", "--nproc_per_node=2", "--max-restarts=1", "-m", "ddpexp", *ONE_JOB,
         "debug.kill_at_step=8", "debug.fail_rank=1"],
        cwd=tmp_path, env={**ddpexp_env(), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}, capture_output=True,
        text=True, timeout=200,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert sum(line.startswith("ddpexp: completed") for line in lines) == 1, proc.stdout
    assert "ddpexp: started by torchrun: rank 0 of 2 (launcher=env)" in lines
    [job] = job_dirs(tmp_path)  # one job dir, though each attempt's rank 0 had Hydra propose its own
    assert [p.parent for p in tmp_path.glob("outputs/*/*/.hydra")] == [job]
    check_env_record(job, "torchrun", reference, restarts=1)
    assert read_summary(job)["resumed_from"]["step"] == 5


@pytest.mark.timeout(240)
def test_srun_started_ranks_one_job_sharded(tmp_path: Path, reference: Path, slurm: dict[str, str]) -> None:
    """srun's two tasks as the ranks of one strategy=fsdp2 job (ddp under an outside launcher: the torchrun-started
    and bare-variable tests): the ddp reference's model, from each rank's shards."""
    proc = subprocess.run(
        ["srun", "-N1", "-n2", sys.executable, "-m", "ddpexp", *ONE_JOB, "strategy=fsdp2"],
        cwd=tmp_path, env={**ddpexp_env(), **slurm}, capture_output=True, text=True, timeout=200,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sum(line.startswith("ddpexp: completed") for line in proc.stdout.splitlines()) == 1, proc.stdout
    [job] = job_dirs(tmp_path)
    summary = check_sharded_run(job, 2, reference)
    assert (summary["launcher"], summary["started_by"], summary["restarts"]) == ("env", "srun", 0)
    assert len(list(job.rglob(".hydra"))) == 1 and not (job / "job.lock").exists()


def bare_rank(rank: int, port: int, args: list[str], cwd: Path) -> subprocess.Popen[str]:
    """A PyTorchJob's pod: only MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK (no LOCAL_RANK: one rank per host), and
    one core of its own (as a pod's CPU share: then it takes one thread, as each spawned rank does on 2 cores)."""
    env = {**ddpexp_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2", "RANK": str(rank)}
    return subprocess.Popen(
        ["taskset", "-c", str(rank % os.cpu_count()), sys.executable, "-m", "ddpexp", *args],  # type: ignore[operator]
        cwd=cwd, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip


@pytest.mark.timeout(300)
def test_bare_env_ranks_sigterm_checkpoint_refusals_and_resume_bit_equal(tmp_path: Path, reference: Path) -> None:
    """Two processes with the bare variables; while they run, a second command into their dir and the local
    launchers inside the world are refused untouched; SIGTERM to every rank (a pod deletion) stops both at a
    checkpoint with exit 130; the same commands again resume and finish bit-equal."""
    args = [*ONE_JOB, "hydra.run.dir=job", "debug.step_delay_s=0.5"]
    port = free_port()
    ranks = [bare_rank(r, port, args, tmp_path) for r in (1, 0)]
    job = tmp_path / "job"
    wait_for_step(job, 4, ranks[1], timeout=120)

    hydra_before = (job / ".hydra" / "config.yaml").read_bytes()
    second = run_ddpexp(*ONE_JOB, "gpus=2", "hydra.run.dir=job", cwd=tmp_path, check=False, timeout=120)
    assert second.returncode == 2, second.stderr
    [line] = second.stderr.strip().splitlines()
    # rank 0's command holds the lock (taskset execs python: the same pid)
    assert line.startswith(f"ddpexp: error: {job}: a job is running there (pid {ranks[1].pid} on ") and "wait" in line
    assert (job / ".hydra" / "config.yaml").read_bytes() == hydra_before and not (job / "logs" / "rank2.log").exists()

    # torchrun's variables, as a rank's command sees them
    inside = {**ddpexp_env(), "TORCHELASTIC_RUN_ID": "r", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2",
              "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}  # fmt: skip
    for argv, says in (
        (["launcher=spawn", "hydra.run.dir=other"], "launcher=spawn: this command is started by torchrun: rank 0 of 2"),
        (["-m", "optimizer.lr=1e-3,1e-2"], "-m: this command is started by torchrun: rank 0 of 2; each rank would"),
    ):
        proc = run_ddpexp(*argv, cwd=tmp_path, env=inside, check=False, timeout=120)
        assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith(f"ddpexp: error: {says}"), (
            argv, proc.stderr)  # fmt: skip
    assert not (tmp_path / "other").exists() and not (tmp_path / "multirun").exists()

    for p in ranks:
        os.kill(p.pid, signal.SIGTERM)
    outs = [p.communicate(timeout=120) for p in ranks]
    assert [p.returncode for p in ranks] == [130, 130], outs
    summary = read_summary(job)
    assert (summary["status"], summary["signal"]) == ("interrupted", "SIGTERM") and summary["checkpoint"], summary
    assert f"resume with: the same launch (env), each rank's ddpexp given hydra.run.dir={job}" in outs[1][1]
    stopped = summary["steps"]
    assert 4 <= stopped < 24 and not (job / "job.lock").exists()

    port = free_port()
    again = [bare_rank(r, port, [*ONE_JOB, "hydra.run.dir=job"], tmp_path) for r in (1, 0)]
    outs = [p.communicate(timeout=150) for p in again]
    assert [p.returncode for p in again] == [0, 0], outs
    assert "rank 0's command reports the job" in outs[0][0] and "ddpexp: completed" in outs[1][0]
    check_env_record(job, "env", reference)
    assert read_summary(job)["resumed_from"]["step"] == stopped
    assert [m["step"] for m in read_metrics(job)] == [m["step"] for m in read_metrics(reference)]


@pytest.mark.timeout(120)
def test_the_job_dir_lock_is_taken_over_from_a_dead_process_only(tmp_path: Path) -> None:
    from ddpexp.exceptions import ConfigError
    from ddpexp.job import release_lock, take_lock

    sleeper = subprocess.Popen(["sleep", "60"])
    dead = subprocess.Popen(["true"])
    dead.wait()
    lock = tmp_path / "job.lock"
    try:
        lock.write_text(f'{{"host": "{socket.gethostname()}", "pid": {sleeper.pid}, "since": {time.time()}}}')
        with pytest.raises(ConfigError, match=rf"a job is running there \(pid {sleeper.pid} on "):
            take_lock(str(tmp_path))
        lock.write_text(f'{{"host": "elsewhere", "pid": {dead.pid}, "since": 0}}')  # another host's: not ours to judge
        with pytest.raises(ConfigError, match=rf"on elsewhere, .*if it is gone, remove {lock}"):
            take_lock(str(tmp_path))
        lock.write_text(f'{{"host": "{socket.gethostname()}", "pid": {dead.pid}, "since": 0}}')
        assert take_lock(str(tmp_path)) == str(lock)
        assert read_summary_like(lock)["pid"] == os.getpid()
        release_lock(str(lock))
        assert not lock.exists()
    finally:
        sleeper.kill()
        sleeper.wait()


def read_summary_like(path: Path) -> dict:
    import json

    return json.loads(path.read_text())


@pytest.mark.parametrize(
    ("env", "want"),
    [
        (
            {
                "TORCHELASTIC_RUN_ID": "x",
                "RANK": "3",
                "LOCAL_RANK": "1",
                "WORLD_SIZE": "4",
                "LOCAL_WORLD_SIZE": "2",
                "MASTER_ADDR": "h0",
                "MASTER_PORT": "29500",
                "TORCHELASTIC_RESTART_COUNT": "2",
            },
            ("torchrun", 3, 1, 4, 2, "h0", 29500, 2),
        ),
        (
            {
                "SLURM_STEP_NUM_TASKS": "5",
                "SLURM_PROCID": "4",
                "SLURM_LOCALID": "0",
                "SLURM_NODEID": "2",
                "SLURM_STEP_TASKS_PER_NODE": "2(x2),1",
                "SLURM_STEP_NODELIST": "gpu[7-9]",
                "SLURM_JOB_ID": "3000",
                "SLURM_STEP_ID": "0",
            },
            ("srun", 4, 0, 5, 1, "gpu7", 21000, 0),  # 15000 + 3000 x 7 % 15000: below the ephemeral ports
        ),
        (
            {
                "OMPI_COMM_WORLD_RANK": "1",
                "OMPI_COMM_WORLD_SIZE": "2",
                "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
                "MASTER_ADDR": "a",
                "MASTER_PORT": "1234",
            },
            ("mpirun", 1, 1, 2, 2, "a", 1234, 0),
        ),
        (
            {"MASTER_ADDR": "svc-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "8", "RANK": "5"},
            ("env", 5, 0, 8, 1, "svc-master-0", 23456, 0),
        ),
        ({"MASTER_ADDR": "a", "MASTER_PORT": "1", "WORLD_SIZE": "1", "RANK": "0"}, None),  # a world of one: none
        ({}, None),
    ],
    ids=["torchrun", "srun", "mpirun", "pytorchjob", "world-of-one", "none"],
)
def test_the_outside_world_is_read_from_each_launchers_variables(env: dict[str, str], want: tuple | None) -> None:
    from ddpexp.launchers.world import outside_world

    world = outside_world(env)
    got = None if world is None else (world.source, world.rank, world.local_rank, world.world_size,
                                      world.local_world_size, world.master_addr, world.master_port, world.restarts)  # fmt: skip
    assert got == want


def test_a_slurm_task_rendezvous_port_is_below_the_ephemeral_ports() -> None:
    """launcher=slurm's tasks: submitit would draw MASTER_PORT from 20000-60000, where a port bound as port 0 (any
    spawn job's, here) can already hold it: the job's rank 0 failed with EADDRINUSE and rank 1 waited on."""
    from conftest import make_config
    from ddpexp.job import Job
    from ddpexp.launchers.slurm import SlurmTask

    seen: dict[str, str] = {}
    slurm = {"SLURM_JOB_ID": "10", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "SLURM_PROCID": "1",
             "SLURM_LOCALID": "1", "SLURM_NODEID": "0", "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_NODELIST": "node1",
             "SLURM_STEP_NODELIST": "node1", "SUBMITIT_EXECUTOR": "slurm"}  # fmt: skip
    saved = dict(os.environ)  # the task exports env:// into os.environ
    try:
        for key in ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
            os.environ.pop(key, None)
        os.environ.update(slurm)
        job = Job(dir="x", name="", group=None, launcher="slurm", config_yaml="")
        SlurmTask(lambda cfg, job: seen.update(os.environ), make_config("launcher=slurm", "gpus=2"), job)()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    assert (seen["MASTER_PORT"], seen["MASTER_ADDR"], seen["RANK"], seen["WORLD_SIZE"]) == ("15070", "node1", "1", "2")


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"WORLD_SIZE": "2", "RANK": "1"}, "launcher=env: env started rank 1 of 2 but MASTER_ADDR and MASTER_PORT"),
        ({"WORLD_SIZE": "two", "RANK": "1", "MASTER_ADDR": "a", "MASTER_PORT": "1"}, "are not numbers"),
    ],
)
def test_an_outside_world_without_its_master_is_one_line(env: dict[str, str], message: str) -> None:
    from ddpexp.exceptions import ConfigError
    from ddpexp.launchers.world import outside_world

    with pytest.raises(ConfigError, match=message):
        outside_world(env)


def test_gpus_must_agree_with_the_world(monkeypatch: pytest.MonkeyPatch) -> None:
    from conftest import make_config
    from ddpexp.exceptions import ConfigError
    from ddpexp.launchers import env

    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "WORLD_SIZE": "2", "RANK": "1"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError, match=r"^gpus=3: env started 1 rank\(s\) on this host; leave gpus out"):
        env.resolve(make_config("launcher=env", "gpus=3"))
    cfg = make_config("launcher=env", "device=cpu")
    env.resolve(cfg)
    assert cfg.gpus == 1


def test_a_job_dir_this_host_cannot_see_is_one_line(tmp_path: Path) -> None:
    from ddpexp.exceptions import ConfigError
    from ddpexp.launchers.env import check_visible

    (tmp_path / "job.lock").write_text("{}")  # rank 0 holds its job dir while the job runs
    check_visible(str(tmp_path), 0.1)
    (tmp_path / "elsewhere").mkdir()  # this rank's own Hydra makes the dir on its host: not rank 0's
    with pytest.raises(
        ConfigError, match=rf"rank 0's job dir {tmp_path / 'elsewhere'} is not visible on .* after 0.2 s"
    ):
        check_visible(str(tmp_path / "elsewhere"), 0.2)


def test_a_rank_learns_rank_0s_dir_even_when_rank_0_took_it_away_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """plan=true (or a refusal): rank 0's command names its dir, then takes the empty dir away and ends; a rank
    that asks later gets the name, not a wait for a dir that will not come and an error (CI saw that race)."""
    from datetime import timedelta

    from omegaconf import OmegaConf
    from torch.distributed import TCPStore

    from ddpexp.launchers import env

    port = free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=5), wait_for_workers=False)
    gone = str(tmp_path / "rank0-dir-already-removed")
    store.set("ddpexp/job_dir/0", gone)
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2", "RANK": "1"}.items():
        monkeypatch.setenv(key, value)
    agreed = env.job_dir(OmegaConf.create({"job_dir_timeout_s": 5.0}), str(tmp_path / "rank1-own"))
    assert (agreed.path, agreed.leader) == (gone, False)


def test_each_printed_line_is_one_write_even_unbuffered() -> None:
    """torchrun's ranks share one stdout: under PYTHONUNBUFFERED print wrote a line's text and its newline apart,
    and rank 1's "this rank finished" ran into rank 0's "completed" line."""
    import io

    from ddpexp.cli import main as cli_main

    class Writes(io.RawIOBase):
        def __init__(self) -> None:
            self.calls: list[bytes] = []

        def writable(self) -> bool:
            return True

        def write(self, b) -> int:  # type: ignore[no-untyped-def, override]
            self.calls.append(bytes(b))
            return len(b)

    raw = Writes()
    stream = io.TextIOWrapper(raw, write_through=True)  # as python -u makes sys.stdout
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys, "stdout", stream)
        cli_main.whole_lines()
        print("ddpexp: this rank finished in 4.8s")
        print("ddpexp: completed in 4.9s")
    assert raw.calls == [b"ddpexp: this rank finished in 4.8s\n", b"ddpexp: completed in 4.9s\n"]


def test_rank_0_stopped_by_torchrun_after_a_peer_raised_reports_the_peer(tmp_path: Path) -> None:
    """torchrun SIGTERMs the other ranks when one raises: rank 0's command records the peer's error, not an
    interruption; an error file from before this command started (an earlier attempt) is not this job's."""
    from ddpexp.exceptions import RankFailure
    from ddpexp.job import Job, read_json, write_json
    from ddpexp.parent.wait import first_failure, wait

    job = Job(dir=str(tmp_path), name="j", group=None, launcher="env", config_yaml="objective: val/acc\n")
    (tmp_path / "logs").mkdir()
    start = time.time()
    write_json(job.error_path(2), {"rank": 2, "time": start - 5, "traceback": "RuntimeError: an earlier attempt"})
    assert first_failure(job, start) is None
    write_json(job.summary_path, {"status": "interrupted", "signal": "SIGTERM", "steps": 2, "launcher": "env"})
    write_json(job.error_path(1), {"rank": 1, "time": time.time(), "traceback": "RuntimeError: rank 1 on purpose"})

    class Stopped:
        def wait(self) -> None:  # rank 0's worker returned "interrupted"
            return None

    with pytest.raises(RankFailure) as e:
        wait(job, Stopped(), start)  # type: ignore[arg-type]
    assert e.value.rank == 1 and "rank 1 on purpose" in str(e.value)
    summary = read_json(job.summary_path) or {}
    assert summary["status"] == "failed" and "rank 1 on purpose" in summary["error"]
