"""Job-dir bookkeeping for the guard around Hydra's `run_job` (ddpexp.cli.hydra_patches): a job's dir as Hydra names it,
its .hydra/ files, and whether it completed there already with the same config (a sweep run again into the same
sweep dir skips those jobs, their files untouched, and runs the rest, which resume from their own checkpoints)."""

from __future__ import annotations

import copy
import importlib
import os
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from ddpexp.parent.compat import same_hydra_configs


def job_dir_of(config: DictConfig, job_dir_key: str, job_subdir_key: str | None) -> str:
    """The absolute job dir `run_job` will use (as HydraConfig's runtime.output_dir)."""
    from hydra.core.hydra_config import HydraConfig

    HydraConfig.instance().set_config(config)  # for ${hydra:...} in the dir names
    job_dir = str(OmegaConf.select(config, job_dir_key))
    if job_subdir_key is not None:
        job_dir = os.path.join(job_dir, str(OmegaConf.select(config, job_subdir_key)))
    return os.path.abspath(job_dir)


def launcher_job_dir(config: DictConfig, proposed: str) -> Any:
    """The job dir a launcher's optional `job_dir` hook agrees on (ddpexp.launchers.base.JobDir), else `proposed`:
    launcher=env's ranks, each a command, all take rank 0's."""
    from ddpexp.launchers.base import JobDir

    target = str(OmegaConf.select(config, "launcher._target_", default=""))
    try:
        module = importlib.import_module(target.rpartition(".")[0])
    except (ImportError, ValueError):  # the parent says why, in one line
        return JobDir(proposed)
    hook = getattr(module, "job_dir", None)
    return hook(config.launcher, proposed) if callable(hook) else JobDir(proposed)


def read_files(folder: str) -> dict[str, bytes]:
    if not os.path.isdir(folder):
        return {}
    out = {}
    for name in sorted(os.listdir(folder)):
        if os.path.isfile(os.path.join(folder, name)):
            with open(os.path.join(folder, name), "rb") as f:
                out[name] = f.read()
    return out


def completed_job(config: DictConfig, job_dir: str) -> Any:
    """A JobReturn for a job that already completed in its dir with the same config, else None."""
    from hydra.core.utils import JobReturn, JobStatus

    from ddpexp.job import read_json

    summary = read_json(os.path.join(job_dir, "summary.json")) or {}
    if summary.get("status") != "completed":
        return None
    task_cfg = copy.deepcopy(config)
    with read_write(task_cfg), open_dict(task_cfg):
        del task_cfg["hydra"]
    overrides = OmegaConf.to_container(config.hydra.overrides.task)
    try:
        with open(os.path.join(job_dir, ".hydra", "config.yaml")) as f:
            same_config = f.read() in same_hydra_configs(task_cfg)  # an older release's form too
        with open(os.path.join(job_dir, ".hydra", "overrides.yaml")) as f:
            same_overrides = yaml.safe_load(f) == overrides
    except FileNotFoundError:
        return None
    if not (same_config and same_overrides):
        return None
    print(f"ddpexp: job {config.hydra.job.num} already completed in {job_dir}: skipped", flush=True)
    objective = summary.get("final", {}).get(config.get("objective", "val/acc"))
    return JobReturn(
        overrides=overrides, cfg=task_cfg, hydra_cfg=config, working_dir=os.getcwd(),
        task_name=config.hydra.job.name, status=JobStatus.COMPLETED, _return_value=objective,
    )  # fmt: skip


BASIC_LAUNCHER = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"


def refuse_hydra_launcher(config: DictConfig) -> None:
    """A `-m` sweep runs its jobs one after another in this command (Hydra's basic launcher), and each job's ranks
    are started by ddpexp's own `launcher=`. Another Hydra launcher plugin runs each job in a worker of its own,
    which cannot start ranks (joblib's loky workers: every rank dies with "cannot find context for 'loky'"), so
    it is refused before any job starts."""
    target = OmegaConf.select(config, "hydra.launcher._target_", default=None)
    if target in (None, BASIC_LAUNCHER):
        return
    from ddpexp.exceptions import CommandError

    choice = (OmegaConf.select(config, "hydra.runtime.choices", default=None) or {}).get("hydra/launcher")
    given = f"hydra/launcher={choice}" if choice not in (None, "basic") else f"hydra.launcher._target_={target}"
    raise CommandError(
        f"{given}: ddpexp starts each job's ranks itself (launcher=spawn, torchrun or slurm) and "
        "runs a sweep's jobs one after another; a Hydra launcher plugin cannot start them. Drop hydra/launcher "
        "(sweep.parallel=N runs N jobs at once)"
    )
