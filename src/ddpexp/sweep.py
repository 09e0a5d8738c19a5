"""Job-dir bookkeeping around Hydra's `run_job`. A sweep run again into the same sweep dir skips the jobs that
completed there (their files stay untouched) and runs the rest, which resume from their own checkpoints
(resume=auto). Hydra writes a job's .hydra/ record before the job's checks run; when the job then does not start
(refused, already completed, plan=true), the record it found there is put back as it was."""

from __future__ import annotations

import copy
import os
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from ddpexp.command import current


def install_record_guard() -> None:
    """Wrap hydra-core 1.3's `run_job`: where it is defined, before Hydra loads its launcher plugin (a fresh import
    that copies it; the BasicLauncher calls it per job, behind every sweeper, Optuna's too), and where a single
    run calls it (hydra._internal.hydra, which imported it already)."""
    import hydra._internal.hydra as hydra_run
    import hydra.core.utils as hydra_utils

    original = hydra_utils.run_job
    if getattr(original, "__name__", "") == "_guarded_run_job":
        return

    def _guarded_run_job(**kwargs: Any) -> Any:
        if not current().active:  # another Hydra app in a process that ran ddpexp.run
            return original(**kwargs)
        config, subdir_key = kwargs["config"], kwargs.get("job_subdir_key")
        job_dir = job_dir_of(config, kwargs["job_dir_key"], subdir_key)
        current().add_job_dir(job_dir)
        if subdir_key is not None:  # a single run: parent.check_resume decides
            done = completed_job(config, job_dir)
            if done is not None:
                return done
        if config.hydra.output_subdir is None:
            return original(**kwargs)
        hydra_dir = os.path.join(job_dir, str(config.hydra.output_subdir))
        # its .hydra/ files as they were before Hydra rewrites them for this attempt
        earlier = current().earlier_hydra[job_dir] = read_files(hydra_dir)
        try:
            return original(**kwargs)
        finally:
            if earlier and job_dir not in current().launched:
                for name, data in earlier.items():
                    with open(os.path.join(hydra_dir, name), "wb") as f:
                        f.write(data)

    hydra_utils.run_job = hydra_run.run_job = _guarded_run_job
    _guard_multirun_yaml()


def _guard_multirun_yaml() -> None:
    """The basic sweeper rewrites the sweep dir's multirun.yaml first thing: put it back if no job then ran. Its
    class is re-created when Hydra scans its plugins, so the sweeper is wrapped as Hydra makes it."""
    from hydra.core.plugins import Plugins

    original = Plugins.instantiate_sweeper

    def _instantiate_sweeper(self: Any, **kwargs: Any) -> Any:
        sweeper = original(self, **kwargs)
        if not current().active:
            return sweeper
        sweep, path = sweeper.sweep, os.path.join(str(kwargs["config"].hydra.sweep.dir), "multirun.yaml")

        def guarded_sweep(arguments: list[str]) -> Any:
            earlier = None
            if os.path.isfile(path):
                with open(path, "rb") as f:
                    earlier = f.read()
            launched = len(current().launched)
            try:
                return sweep(arguments)
            finally:
                if earlier is not None and len(current().launched) == launched:
                    with open(path, "wb") as f:
                        f.write(earlier)

        sweeper.sweep = guarded_sweep
        return sweeper

    Plugins.instantiate_sweeper = _instantiate_sweeper  # type: ignore[method-assign]


def job_dir_of(config: DictConfig, job_dir_key: str, job_subdir_key: str | None) -> str:
    """The absolute job dir `run_job` will use (as HydraConfig's runtime.output_dir)."""
    from hydra.core.hydra_config import HydraConfig

    HydraConfig.instance().set_config(config)  # for ${hydra:...} in the dir names
    job_dir = str(OmegaConf.select(config, job_dir_key))
    if job_subdir_key is not None:
        job_dir = os.path.join(job_dir, str(OmegaConf.select(config, job_subdir_key)))
    return os.path.abspath(job_dir)


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
