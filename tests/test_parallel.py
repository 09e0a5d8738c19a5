"""sweep.parallel=N: a local sweep's jobs run N at once, each on its own CPU cores (or GPUs); a Ctrl-C stops every
running job at a checkpoint, and the line it prints resumes them all; what cannot fit is refused before any job."""

from __future__ import annotations

import shlex
import types
from pathlib import Path

import pytest

from conftest import ctrl_c, make_config, read_metrics, read_summary, run_ddpexp, start, until
from ddpexp.exceptions import ConfigError
from ddpexp.launchers import slurm, spawn, torchrun
from ddpexp.parent import parallel

# Two jobs of one rank each: on 2 cores, one core each.
TWO = ["-m", "sweep.parallel=2", "gpus=1", "max_steps=12", "log_every_n_steps=2", "checkpoint_every_n_steps=2",
       "wandb.mode=disabled", "optimizer.lr=1e-3,1e-2"]  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_jobs_at_once_on_their_own_cores_stop_on_ctrl_c_and_resume_together(tmp_path: Path) -> None:
    if len(parallel.devices("cpu")) < 2:
        pytest.skip("needs 2 CPU cores")
    sweep = tmp_path / "sweep"
    proc = start([*TWO, "debug.step_delay_s=0.3", f"hydra.sweep.dir={sweep}"], tmp_path)
    training = [sweep / str(i) / "metrics.jsonl" for i in (0, 1)]
    both = lambda: all(m.exists() and read_metrics(m.parent) for m in training)  # noqa: E731  (at once)
    _, err = ctrl_c(proc, lambda: until(both, proc), wait=90)
    assert proc.returncode == 130, err
    stopped = [read_summary(sweep / str(i)) for i in (0, 1)]
    assert [s["status"] for s in stopped] == ["interrupted", "interrupted"], err
    assert all(s["checkpoint"] and s["steps"] < 12 for s in stopped), stopped

    # The resume line, run as printed, finishes both jobs from their checkpoints, again at once.
    line = next(x for x in err.splitlines() if "resume with: " in x).split("resume with: ", 1)[1]
    words = shlex.split(line)
    assert words[:3] == ["python", "-m", "ddpexp"] and f"hydra.sweep.dir={sweep}" in words
    resumed = run_ddpexp(*words[3:], cwd=tmp_path, timeout=180)
    jobs = [read_summary(sweep / str(i)) for i in (0, 1)]
    assert [j["status"] for j in jobs] == ["completed", "completed"], resumed.stderr
    assert [j["resumed_from"]["step"] for j in jobs] == [s["steps"] for s in stopped]
    assert all(j["steps"] == 12 and len(read_metrics(sweep / str(i))) for i, j in enumerate(jobs))
    assert max(j["started_at"] for j in jobs) < min(j["ended_at"] for j in jobs)  # their training overlapped
    cores = [{c for rank in j["cpu_affinity_per_rank"] for c in rank} for j in jobs]
    assert all(cores) and not cores[0] & cores[1] and all(j["threads_per_rank"] == 1 for j in jobs), cores
    report = run_ddpexp("report", str(sweep), cwd=tmp_path)
    assert "2 job(s): 2 completed" in report.stdout


@pytest.mark.timeout(60)
def test_more_jobs_at_once_than_devices_is_refused_before_any_job(tmp_path: Path) -> None:
    cores = len(parallel.devices("cpu"))
    sweep = tmp_path / "sweep"
    proc = run_ddpexp("-m", f"sweep.parallel={cores}", "gpus=2", "optimizer.lr=1e-3,1e-2", f"hydra.sweep.dir={sweep}",
                      cwd=tmp_path, check=False)  # fmt: skip
    why = (
        f"sweep.parallel={cores} x gpus=2: {2 * cores} CPU ranks, on {cores} CPU core(s) here (each job needs its own)"
    )
    assert proc.returncode == 2 and proc.stderr.strip().startswith(f"ddpexp: error: job 0 of the sweep: {why}; use ")
    assert len(proc.stderr.strip().splitlines()) == 1 and not sweep.exists()


def checked(launcher: types.ModuleType | types.SimpleNamespace, *overrides: str) -> str | None:
    cfg = make_config("device=cpu", *overrides)
    name = cfg.launcher._target_.split(".")[-2]
    return parallel.check(cfg, launcher, name, {"gpus": cfg.gpus, "launcher": {"nnodes": "1"}})


def test_sweep_parallel_is_checked_for_the_launcher_and_the_devices() -> None:
    cores = len(parallel.devices("cpu"))
    assert checked(spawn, "gpus=1") is None and checked(spawn, f"sweep.parallel={cores}", "gpus=1") is None
    with pytest.raises(ConfigError, match=rf"sweep.parallel={cores + 1} x gpus=1: {cores + 1} CPU ranks, on {cores} "):
        checked(torchrun, f"sweep.parallel={cores + 1}", "gpus=1")
    with pytest.raises(ConfigError, match="spans several nodes"):
        cfg = make_config("device=cpu", "launcher=torchrun", "sweep.parallel=2", "gpus=1")
        parallel.check(cfg, torchrun, "torchrun", {"gpus": 1, "launcher": {"nnodes": "2"}})
    assert "ignored with launcher=slurm" in str(checked(slurm, "launcher=slurm", "sweep.parallel=2", "gpus=1"))
    elsewhere = types.SimpleNamespace(world_size=lambda config: config["gpus"])  # no SWEEP_PARALLEL: a user's ray
    with pytest.raises(ConfigError, match="launcher=spawn does not run its ranks on this machine"):
        checked(elsewhere, "sweep.parallel=2", "gpus=1")
    port = r"the jobs at once would all bind that port; leave the port free \(null, or port 0\)"
    with pytest.raises(ConfigError, match=rf"^sweep.parallel=2 with launcher.master_port=29500: {port}"):
        checked(spawn, "sweep.parallel=2", "gpus=1", "launcher.master_port=29500")
    for endpoint in ("localhost:29400", "localhost"):  # no port: c10d's default, 29400
        with pytest.raises(ConfigError, match=rf"^sweep.parallel=2 with launcher.rdzv_endpoint='{endpoint}': {port}"):
            checked(torchrun, "launcher=torchrun", "sweep.parallel=2", "gpus=1", f"launcher.rdzv_endpoint={endpoint}")
    assert checked(torchrun, "launcher=torchrun", "sweep.parallel=2", "gpus=1") is None  # localhost:0: a free port
    with pytest.raises(ConfigError, match=r"sweep.parallel=0: must be >= 1"):
        make_config("sweep.parallel=0")


@pytest.mark.timeout(60)
def test_sweep_parallel_is_refused_for_a_search_that_needs_each_result(tmp_path: Path) -> None:
    proc = run_ddpexp("hparams_search=digits_optuna", "sweep.parallel=2", cwd=tmp_path, check=False)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "ddpexp: error: sweep.parallel: a search that picks each trial from the results of the ones before "
        "(hparams_search) runs one trial at a time; leave sweep.parallel=1"
    )
    assert list(tmp_path.iterdir()) == []
