"""Multirun bookkeeping: a sweep run again into the same sweep dir skips the jobs that completed there (their
files stay untouched) and runs the rest, which resume from their own checkpoints (resume=auto)."""

from __future__ import annotations

import copy
import os
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf, open_dict, read_write


def install_skip_completed() -> None:
    """Wrap hydra-core 1.3's `run_job`, which the BasicLauncher (behind every sweeper, Optuna's too) calls per job.
    It is patched where it is defined, before Hydra loads its launcher plugin (a fresh import that copies it)."""
    import hydra.core.utils as hydra_utils

    original = hydra_utils.run_job
    if getattr(original, "__name__", "") == "_skip_completed":
        return

    def _skip_completed(**kwargs: Any) -> Any:
        if kwargs.get("job_subdir_key") is None:  # a single run: run.check_resume decides
            return original(**kwargs)
        done = completed_job(kwargs["config"], kwargs["job_dir_key"], kwargs["job_subdir_key"])
        return done if done is not None else original(**kwargs)

    hydra_utils.run_job = _skip_completed


def completed_job(config: DictConfig, job_dir_key: str, job_subdir_key: str | None) -> Any:
    """A JobReturn for a job that already completed in its dir with the same config, else None."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.core.utils import JobReturn, JobStatus

    from ddpexp.job import read_json

    HydraConfig.instance().set_config(config)  # for ${hydra:...} in the dir names
    job_dir = str(OmegaConf.select(config, job_dir_key))
    if job_subdir_key is not None:
        job_dir = os.path.join(job_dir, str(OmegaConf.select(config, job_subdir_key)))
    summary = read_json(os.path.join(job_dir, "summary.json")) or {}
    if summary.get("status") != "completed":
        return None
    task_cfg = copy.deepcopy(config)
    with read_write(task_cfg), open_dict(task_cfg):
        del task_cfg["hydra"]
    overrides = OmegaConf.to_container(config.hydra.overrides.task)
    try:
        with open(os.path.join(job_dir, ".hydra", "config.yaml")) as f:
            same_config = f.read() == OmegaConf.to_yaml(task_cfg)
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
