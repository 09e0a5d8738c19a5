"""Bad input of every kind stops before any rank starts: exactly one `ddpexp: error:` line on stderr, exit 2.

Launcher keys, the command line itself, a run dir that cannot be made, sbatch refusing, `ddpexp report`'s
arguments; the launchers' dataclass checks also in-process, where that is cheaper than a command."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import run_ddpexp
from ddpexp.exceptions import ConfigError
from ddpexp.launchers.slurm import SlurmConfig, slurm_reason
from ddpexp.launchers.spawn import SpawnConfig
from ddpexp.launchers.torchrun import TorchrunConfig

NO_HOST = "no-such-host.invalid"  # RFC 6761: never resolves

# (command-line arguments, a word of the message); each runs with hydra.run.dir=run in a temp dir holding `afile`
BAD_COMMANDS = [
    (["launcher.master_port=-1"], "launcher.master_port=-1: must be a port 0..65535"),
    (["launcher.master_port=70000"], "launcher.master_port=70000: must be a port 0..65535"),
    ([f"launcher.master_addr={NO_HOST}"], f"cannot resolve host '{NO_HOST}'"),
    (["launcher=torchrun", "launcher.rdzv_backend=bogus"], "launcher.rdzv_backend='bogus': must be one of c10d"),
    (["launcher=torchrun", "launcher.rdzv_endpoint=localhost:99999"], "the port must be a number 0..65535"),
    (["launcher=torchrun", f"launcher.rdzv_endpoint={NO_HOST}"], f"cannot resolve host '{NO_HOST}'"),
    (["launcher=torchrun", "launcher.monitor_interval_s=-1"], "launcher.monitor_interval_s=-1.0: must be > 0"),
    (["launcher=torchrun", "launcher.rdzv_timeout_s=-1"], "launcher.rdzv_timeout_s=-1: must be >= 1"),
    (["launcher=slurm", "gpus=2", "launcher.signal_delay_s=-5"], "launcher.signal_delay_s=-5: must be 0..3599"),
    (["launcher=slurm", "gpus=2", "launcher.mem_gb=-1"], "launcher.mem_gb=-1.0: must be > 0"),
    (["launcher=slurm", "gpus=2", "launcher.gpus_per_node=-1"], "launcher.gpus_per_node=-1: must be >= 0 or null"),
    (["=3"], "override '=3': no KEY before '='"),
    (["--help", "epochs=abc"], "Error merging override epochs=abc"),
    (["--info", "config", "epochs=abc"], "Error merging override epochs=abc"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--cfg", "jbo"], "argument --cfg/-c: invalid choice: 'jbo'"),
]


@pytest.mark.parametrize(("args", "message"), BAD_COMMANDS, ids=[" ".join(a) for a, _ in BAD_COMMANDS])
def test_bad_command_is_one_line_exit_2(tmp_path: Path, args: list[str], message: str) -> None:
    proc = run_ddpexp(*args, "hydra.run.dir=run", cwd=tmp_path, check=False)
    assert_one_line(proc, message)
    assert not (tmp_path / "run" / "logs").exists()  # no rank started


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["hydra.run.dir=/proc/ddpexp-run"], "cannot create run dir /proc/ddpexp-run: No such file or directory"),
        (["hydra.run.dir=afile/sub"], "cannot create run dir {tmp}/afile/sub: {tmp}/afile is a file"),
        (["hydra.run.dir=afile"], "cannot create run dir {tmp}/afile: {tmp}/afile is a file"),
        (["-m", "hydra.sweep.dir=afile/sweep"], "cannot create sweep dir {tmp}/afile/sweep: {tmp}/afile is a file"),
    ],
    ids=["under /proc", "under a file", "a file", "sweep dir under a file"],
)
def test_a_run_dir_that_cannot_be_made_is_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    (tmp_path / "afile").write_text("")
    proc = run_ddpexp(*args, cwd=tmp_path, check=False)
    assert_one_line(proc, message.format(tmp=tmp_path))


def test_sbatch_refusal_is_its_fatal_line(tmp_path: Path) -> None:
    """sbatch without a reachable Slurm configuration: 4 lines of stderr, the last one fatal; exactly as here."""
    fake = tmp_path / "bin" / "sbatch"
    fake.parent.mkdir()
    fake.write_text(
        "#!/bin/sh\n"
        "echo 'sbatch: error: resolve_ctls_from_dns_srv: res_nsearch error: Unknown host' >&2\n"
        "echo 'sbatch: error: fetch_config: DNS SRV lookup failed' >&2\n"
        "echo 'sbatch: error: _establish_config_source: failed to fetch config' >&2\n"
        "echo 'sbatch: fatal: Could not establish a configuration source' >&2\n"
        "exit 1\n"
    )
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    path = f"{fake.parent}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}/usr/bin{os.pathsep}/bin"
    proc = run_ddpexp("launcher=slurm", "gpus=2", "device=cpu", "hydra.run.dir=run", cwd=tmp_path, check=False,
                      env={"PATH": path})  # fmt: skip
    assert_one_line(proc, "sbatch refused the job: sbatch: fatal: Could not establish a configuration source")


def test_sbatch_refusal_picks_the_cause_and_the_verdict() -> None:
    partition = "sbatch: error: invalid partition specified: nope\n" + (
        "sbatch: error: Batch job submission failed: Invalid partition name specified\n"
    )
    assert slurm_reason(partition) == (
        "sbatch: error: invalid partition specified: nope; error: Batch job submission failed: "
        "Invalid partition name specified"
    )
    assert slurm_reason("sbatch: error: one\n") == "sbatch: error: one"
    assert slurm_reason("sinfo: error: fetch_config: DNS SRV lookup failed\nsinfo: fatal: Could not establish a "
                        "configuration source\n") == "sinfo: fatal: Could not establish a configuration source"  # fmt: skip
    assert slurm_reason("\nsomething else\n") == "something else"
    assert slurm_reason("") == "no message"


# digits_optuna's direction is maximize; were the check gone, the study would be one tiny trial
SEARCH = ["hparams_search=digits_optuna", "hydra.sweeper.n_trials=1", "gpus=1", "max_steps=1", "wandb.mode=disabled"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["experiment=diabetes_mlp", "objective=val/mse"], "hydra.sweeper.direction=maximize contradicts objective=val/mse: task=ddpexp.tasks.Regression declares it min (objective_mode=auto); set hydra.sweeper.direction=minimize (or objective_mode=max)"),
        (["objective_mode=min"], "hydra.sweeper.direction=maximize contradicts objective=val/acc: objective_mode=min; set hydra.sweeper.direction=minimize (or objective_mode=max)"),
        (["objective=val/loss", "hydra.sweeper.direction=maximize"], "contradicts objective=val/loss: task=ddpexp.tasks.Classification declares it min"),
    ],
    ids=["val/mse maximized", "objective_mode=min maximized", "val/loss maximized"],
)  # fmt: skip
def test_an_optuna_direction_against_the_objective_s_mode_is_refused_before_any_trial(
    tmp_path: Path, args: list[str], message: str
) -> None:
    proc = run_ddpexp(*SEARCH, *args, "hydra.sweep.dir=sweep", cwd=tmp_path, check=False)
    assert_one_line(proc, message)
    assert not (tmp_path / "sweep").exists() and "Study name" not in proc.stdout  # no study, no trial


def test_the_sweeper_direction_check_reads_every_way_it_is_written() -> None:
    """Optuna sweeper's own default (its Direction enum, when a preset sets none), a list of one direction, a
    consistent one, a sweeper with none (the basic sweeper), and a task that declares nothing for the objective."""
    from hydra_plugins.hydra_optuna_sweeper.config import Direction
    from omegaconf import OmegaConf

    from ddpexp.parent.objective import check_sweeper_direction

    def config(direction: object, **keys: object) -> object:
        task = {"_target_": "ddpexp.tasks.Regression"}
        return OmegaConf.create({"objective": "val/mse", "task": task, "hydra": {"sweeper": {"direction": direction}},
                                 **keys})  # fmt: skip

    for good in (Direction.minimize, ["minimize"], "minimize", None, "maximize"):
        check_sweeper_direction(config(good, objective="val/r2") if good == "maximize" else config(good))
    for bad in (Direction.maximize, ["maximize"]):
        with pytest.raises(ConfigError, match="^hydra.sweeper.direction=maximize contradicts objective=val/mse: "):
            check_sweeper_direction(config(bad))
    for stated in ("minimize", "maximize"):  # nothing declared for it: the sweeper's direction is the declaration
        check_sweeper_direction(config(stated, objective="val/rmse"))


def write_record(job: Path) -> None:
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text("- epochs=2\n")
    final = {"train/loss": 0.2, "val/loss": 0.25, "val/acc": 0.9}
    (job / "summary.json").write_text(json.dumps({"status": "completed", "final": final, "steps": 24}))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--objective", "foo"], "--objective foo: no job has this metric; available: train/loss, val/acc, val/loss"),
        (["--out", "afile/x"], "{tmp}/afile/x: cannot write the report there: {tmp}/afile is a file"),
    ],
    ids=["unknown objective", "out under a file"],
)
def test_bad_report_arguments_are_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    write_record(tmp_path / "job")
    (tmp_path / "afile").write_text("")
    proc = run_ddpexp("report", *args, "job", cwd=tmp_path, check=False)
    assert_one_line(proc, message.format(tmp=tmp_path))
    assert proc.stdout == "" and not (tmp_path / "job" / "report.md").exists()


def assert_one_line(proc: subprocess.CompletedProcess[str], message: str) -> None:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("ddpexp: error: "), proc.stderr
    assert message in lines[0], lines[0]


# The launchers' checks, in-process: (dataclass, keys, message)
BAD_LAUNCHER_KEYS = [
    (SpawnConfig, {"master_port": 65536}, "must be a port 0..65535"),
    (SpawnConfig, {"start_method": "fork"}, "launcher.start_method=fork: must be forkserver or spawn"),
    (TorchrunConfig, {"rdzv_backend": "static"}, "needs a fixed node rank"),
    (TorchrunConfig, {"rdzv_endpoint": "localhost:"}, "the port must be a number 0..65535"),
    (TorchrunConfig, {"rdzv_endpoint": "host/x:29400"}, "the host must be a name, an IPv4 address"),
    (TorchrunConfig, {"rdzv_endpoint": ""}, "must be HOST:PORT"),
    (TorchrunConfig, {"monitor_interval_s": 0}, "launcher.monitor_interval_s=0: must be > 0"),
    (TorchrunConfig, {"nnodes": "2"}, "set launcher.rdzv_endpoint=HOST:PORT"),
    (SlurmConfig, {"mem_gb": 0}, "launcher.mem_gb=0: must be > 0"),
    (SlurmConfig, {"mem_gb": 0.0001}, "must be > 0 (at least 1 MiB)"),
    (SlurmConfig, {"time_min": 1}, "launcher.signal_delay_s=90: must be 0..59, under the job's time limit"),
    (SlurmConfig, {"time_min": 100000, "signal_delay_s": 70000}, "must be 0..65535"),
    (SlurmConfig, {"gpus_per_node": -2}, "launcher.gpus_per_node=-2: must be >= 0 or null"),
    (SlurmConfig, {"poll_interval_s": 0}, "launcher.poll_interval_s=0: must be > 0"),
    (SlurmConfig, {"job_name": " "}, "launcher.job_name=' ': must not be empty"),
]


@pytest.mark.parametrize(
    ("schema", "keys", "message"), BAD_LAUNCHER_KEYS, ids=[f"{s.__name__} {k}" for s, k, _ in BAD_LAUNCHER_KEYS]
)
def test_launcher_checks(schema: type, keys: dict, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        schema(**keys)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("schema", "keys"),
    [
        (SpawnConfig, {}),
        (SpawnConfig, {"master_port": 0, "master_addr": "localhost"}),
        (TorchrunConfig, {}),
        (TorchrunConfig, {"rdzv_endpoint": "localhost"}),  # torch's default port (c10d: 29400)
        (TorchrunConfig, {"rdzv_endpoint": "[::1]:29400", "nnodes": "1:2"}),
        (TorchrunConfig, {"rdzv_endpoint": "127.0.0.1:29400", "nnodes": "2"}),
        (SlurmConfig, {}),
        (SlurmConfig, {"mem_gb": 0.5, "signal_delay_s": 0, "gpus_per_node": 0}),
    ],
)
def test_launcher_checks_accept_good_keys(schema: type, keys: dict) -> None:
    schema(**keys)


@pytest.mark.parametrize(
    ("schema", "keys", "message"),
    [
        (SpawnConfig, {"master_addr": ""}, "launcher.master_addr='': cannot resolve host ''"),
        (TorchrunConfig, {"rdzv_endpoint": f"{NO_HOST}:29400"}, f"launcher.rdzv_endpoint='{NO_HOST}:29400': cannot"),
        (TorchrunConfig, {"local_addr": NO_HOST}, f"launcher.local_addr='{NO_HOST}': cannot resolve host"),
    ],
    ids=["spawn master_addr", "torchrun rdzv_endpoint", "torchrun local_addr"],
)
def test_hosts_are_looked_up_by_the_parent_not_when_a_config_is_built(schema: type, keys: dict, message: str) -> None:
    """Building the dataclass (composing, `--cfg job`, a test) does no DNS look-up; the parent's `resolve` does."""
    launcher = schema(**keys)
    with pytest.raises(ConfigError) as e:
        launcher.check_hosts()
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_version_is_ddpexp_s_own(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`ddpexp --version` is the installed ddpexp's version, not Hydra's (hydra.main's own --version flag)."""
    from importlib.metadata import version

    from ddpexp.cli.main import main

    monkeypatch.setattr(sys, "argv", ["ddpexp", "--version"])
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code in (0, None) and capsys.readouterr().out == f"ddpexp {version('ddpexp')}\n"


JOBLIB = "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher"
NOT_A_PLUGIN = (
    "ddpexp starts each job's ranks itself (launcher=spawn, torchrun or slurm) and runs a sweep's jobs one after "
    "another; a Hydra launcher plugin cannot start them. Drop hydra/launcher (sweep.parallel=N runs N jobs at once)"
)


def test_a_hydra_launcher_plugin_is_refused_by_its_choice_and_the_basic_one_is_not() -> None:
    from omegaconf import OmegaConf

    from ddpexp.exceptions import CommandError
    from ddpexp.parent.sweep import BASIC_LAUNCHER, refuse_hydra_launcher

    def config(target: str, choice: str) -> Any:
        hydra = {"launcher": {"_target_": target, "n_jobs": 2}, "runtime": {"choices": {"hydra/launcher": choice}}}
        return OmegaConf.create({"hydra": hydra})

    with pytest.raises(CommandError) as e:
        refuse_hydra_launcher(config(JOBLIB, "joblib"))
    assert str(e.value) == f"hydra/launcher=joblib: {NOT_A_PLUGIN}"
    refuse_hydra_launcher(config(BASIC_LAUNCHER, "basic"))


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["model=resnet2,mlp"], "ddpexp: error: In 'config': Could not find 'model/resnet2'. Available options in "
         "'model': cnn, gpt, mlp, resnet101, resnet18, resnet50"),
        (["optimzer.lr=1,2"], "ddpexp: error: optimzer.lr: no such key (did you mean optimizer.lr?)"),
        # A Hydra launcher plugin runs jobs in workers that cannot start ranks (joblib's: "no context for 'loky'").
        ([f"hydra.launcher._target_={JOBLIB}", "seed=0,1"], f"ddpexp: error: hydra.launcher._target_={JOBLIB}: "
         f"{NOT_A_PLUGIN}"),
    ],
)  # fmt: skip
def test_a_sweep_refused_before_its_jobs_is_one_line_and_leaves_no_sweep_dir(
    tmp_path: Path, args: list[str], message: str
) -> None:
    """The basic sweeper writes multirun/DATE/TIME/multirun.yaml before it composes a job; a missing option is
    Hydra's MissingConfigException, an OSError too, not a sweep dir that could not be made."""
    proc = run_ddpexp("-m", *args, cwd=tmp_path, check=False, timeout=60)
    assert (proc.returncode, proc.stderr.strip()) == (2, message), proc.stderr
    assert list(tmp_path.iterdir()) == []
