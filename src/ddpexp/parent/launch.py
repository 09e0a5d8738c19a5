"""The parent's side of one job: typed config, job dir, device checks, data preparation, then the launcher's
handle, waited on (parent/wait.py), or, for a scheduler's jobs in a sweep, kept to wait on once every job is
submitted, or, with sweep.parallel, started in a child process (parent/parallel.py)."""

from __future__ import annotations

import copy
import importlib
import logging
import os
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

import yaml
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict, read_write
from omegaconf.errors import OmegaConfBaseException

from ddpexp import strategies, trackers
from ddpexp.config import Config
from ddpexp.exceptions import ConfigError, RankFailure
from ddpexp.job import Job
from ddpexp.launchers.base import Handle
from ddpexp.parent import check, parallel
from ddpexp.parent.command import Command
from ddpexp.parent.compat import drop_untaken
from ddpexp.parent.objective import needs_each_value, stated_mode
from ddpexp.parent.plan import render as render_plan
from ddpexp.parent.resume_decision import check_resume, config_sha256
from ddpexp.parent.schema import FREE, closest_key, unknown_keys
from ddpexp.parent.wait import first_failure, record_failure, wait
from ddpexp.parts import data

log = logging.getLogger("ddpexp")


def run(dcfg: DictConfig, cmd: Command) -> float | None:
    """One experiment, a full DDP run, for the command `cmd` (cli/command.py's task function calls it). Returns the
    final `objective`."""
    start = time.time()
    launcher = find_launcher(dcfg)
    cfg = to_config(dcfg)
    config = OmegaConf.to_container(dcfg, resolve=True)
    launcher.resolve(cfg)  # pins device and gpus, checks hosts, asks Slurm (launchers/base.py)
    config.update(gpus=cfg.gpus, device=cfg.device)  # type: ignore[union-attr]
    if "root" in cfg.data:
        cfg.data["root"] = config["data"]["root"] = os.path.abspath(cfg.data["root"])  # type: ignore[index]
    job = make_job(yaml.safe_dump(config, sort_keys=False), cmd.argv)
    if cfg.plan:
        print(render_plan(cfg, job, launcher))
        cmd.planned = True
        return None
    done = check_resume(cfg, job, cmd)
    if done is not None:
        return done
    strategies.check(cfg)
    data.prepare(cfg.data)
    cmd.warn(check.components(cfg, job.stated_mode))
    for warning in trackers.check(cfg.tracker, job):  # each can write (or, on_error=warn, is dropped)
        cmd.warn(warning)
    at_once = in_parallel(cfg, launcher)  # sweep.parallel=N: a child process of this command runs the job
    if at_once:
        parallel.check(cfg, launcher, job.launcher, config)  # type: ignore[arg-type]  # also before a basic sweep
        parallel.make_room(cmd, cfg, job)

    from ddpexp.rank import worker  # torch and the training stack, only once the config is known to be good

    cmd.launched.add(job.dir)  # from here on, .hydra/ records this attempt
    if at_once:
        parallel.start(cmd, launch_function(cfg.launcher._target_), worker.main, cfg, job, start)
        return None
    try:
        handle = launch_function(cfg.launcher._target_)(worker.main, cfg, job)
    except RankFailure as e:
        raise record_failure(job, first_failure(job, start) or e, time.time() - start) from None
    except BaseException as e:
        record_failure(job, e, time.time() - start)
        raise
    if not isinstance(handle, Handle):
        raise TypeError(f"launcher={job.launcher}: launch() returned {handle!r}, not a Handle (ddpexp.launchers.base)")
    if handle.queued and HydraConfig.get().mode == RunMode.MULTIRUN and not needs_each_value(HydraConfig.get()):
        cmd.deferred.append((job, handle, start))  # submit every job of the sweep before waiting for any
        return None
    return wait(job, handle, start)


def find_launcher(dcfg: DictConfig) -> ModuleType:
    """The module of `launcher=NAME`, checked against the contract (ddpexp.launchers.load). A launcher whose YAML
    extends no schema (a project's own: `_target_: mypkg.mylaunch.launch` and its keys) is typed here by the
    module's NameConfig, so its keys are checked as a built-in launcher's are."""
    from ddpexp.launchers import load

    name = HydraConfig.get().runtime.choices["launcher"]
    target = str(OmegaConf.select(dcfg, "launcher._target_", default=""))
    try:
        importlib.import_module(target.rpartition(".")[0])
    except (ImportError, ValueError):  # ValueError: no module named at all
        launch_function(target)  # that line, with the launchers to pick from
    module, schema = load(name, target.rpartition(".")[0])
    launch_function(target)
    if OmegaConf.get_type(dcfg, "launcher") is dict:
        try:
            dcfg.launcher = OmegaConf.merge(OmegaConf.structured(schema), dcfg.launcher)
        except OmegaConfBaseException as e:  # a key the dataclass lacks (added with +), or a value of the wrong type
            key = f"launcher.{getattr(e, 'key', None)}"
            if "not in" in str(e):
                raise ConfigError(f"+{key}: no such key{closest_key(key, schema)} ({schema.__name__})") from None
            raise ConfigError(f"launcher={name}: {str(e).splitlines()[0]} ({schema.__name__})") from None
    return module


def launch_function(target: str) -> Any:
    """`launcher._target_`'s function: one that does not import is bad input, not a traceback."""
    module, _, name = target.rpartition(".")
    try:  # not hydra.utils.get_method: it logs the failure at ERROR level, over several lines, before raising
        function = getattr(importlib.import_module(module), name)
        if callable(function):
            return function
        cause: Exception = TypeError(f"{name} is not a function")
    except (ImportError, AttributeError, ValueError) as e:
        cause = e
    from ddpexp.launchers import launcher_schemas

    raise ConfigError(
        f"launcher._target_={target!r}: cannot import it ({type(cause).__name__}: {cause}); "
        f"pick a launcher with launcher=NAME ({', '.join(sorted(launcher_schemas()))})"
    )


def in_parallel(cfg: Config, launcher: ModuleType) -> bool:
    """A job of a basic sweep with sweep.parallel > 1 on a launcher that runs its ranks here."""
    hc = HydraConfig.get()
    return (
        cfg.sweep.parallel > 1
        and hc.mode == RunMode.MULTIRUN
        and getattr(launcher, "SWEEP_PARALLEL", None) == parallel.LOCAL
        and not needs_each_value(hc)
    )


def check_job(dcfg: DictConfig) -> str | None:
    """What `run` checks of a job before its dir is made (the launcher, the typed config, this machine's devices
    for a launcher that runs ranks here, sweep.parallel, the parts' dry build): a basic sweep checks every job
    this way before the first starts. Returns a warning line, if any."""
    launcher = find_launcher(dcfg)
    cfg = to_config(dcfg)
    if getattr(launcher, "SWEEP_PARALLEL", None) == parallel.LOCAL:  # cheap here; a scheduler's asks the network
        launcher.resolve(cfg)
    config = OmegaConf.to_container(dcfg, resolve=True)
    config.update(gpus=cfg.gpus, device=cfg.device)  # type: ignore[union-attr]
    warning = parallel.check(cfg, launcher, HydraConfig.get().runtime.choices["launcher"], config)  # type: ignore[arg-type]
    if not cfg.plan:
        strategies.check(cfg)
        warning = check.components(cfg, stated_mode(HydraConfig.get())) or warning
    return warning


def every_job_checked_first(
    launcher: Any, launch: Callable[..., Any], refused: Callable[[int, Exception], BaseException], cmd: Command
) -> Callable[..., Any]:
    """Hydra's BasicLauncher composes and runs one job after the other (basic_launcher.py BasicLauncher.launch,
    L64-L82: load_sweep_config, then run_job), so a bad value in the last job would be found after the others
    trained. Every job of the batch is composed and checked first, as `run` checks it (parent.launch.check_job):
    `refused(job_num, error)` is raised for a bad one, before any job starts; each warning is said once (`cmd`)."""

    def _checked_launch(job_overrides: Any, initial_job_idx: int) -> Any:
        for idx, overrides in enumerate(job_overrides, initial_job_idx):
            config = launcher.hydra_context.config_loader.load_sweep_config(launcher.config, list(overrides))
            with open_dict(config):
                config.hydra.job.id = config.hydra.job.num = idx
            HydraConfig.instance().set_config(config)
            task_cfg = copy.deepcopy(config)  # what the task gets: run_job takes `hydra` out (core/utils.py L136)
            with read_write(task_cfg), open_dict(task_cfg):
                del task_cfg["hydra"]
            try:
                cmd.warn(check_job(task_cfg))
            except Exception as e:
                raise refused(idx, e) from None
        return launch(job_overrides, initial_job_idx)

    return _checked_launch


def to_config(dcfg: DictConfig) -> Config:
    """Resolve ${...} and run every __post_init__ check, here in the parent before anything starts."""
    drop_untaken(dcfg)  # a key declared since, that a user's _target_ does not take
    try:
        cfg = OmegaConf.to_object(dcfg)
    except OmegaConfBaseException as e:
        if isinstance(e.__cause__, ConfigError):
            raise e.__cause__ from None
        raise
    assert isinstance(cfg, Config)
    cfg.wandb = cfg.wandb.with_environment(os.environ)  # the command's WANDB_* variables, read once, here
    cfg.tracker = trackers.typed(cfg.tracker)
    cfg.strategy = strategies.typed(cfg.strategy)
    if "wandb" in cfg.tracker:  # W&B's keys are `wandb.*`, where they were before the tracker group
        cfg.tracker["wandb"].settings = cfg.wandb  # type: ignore[attr-defined]
    unknown = unknown_keys(OmegaConf.to_container(dcfg, resolve=False), type(cfg.launcher))  # type: ignore[arg-type]
    if unknown:  # added with `+`: Hydra takes any key there, and nothing would ever read it
        key = unknown[0]
        raise ConfigError(
            f"+{key}: no such key{closest_key(key, type(cfg.launcher))}; `+` adds arguments to {', '.join(FREE)} only"
        )
    return cfg


def make_job(config_yaml: str, argv: list[str]) -> Job:
    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    job_dir = os.path.abspath(hc.runtime.output_dir)
    return Job(
        dir=job_dir,
        name=run_name(list(hc.overrides.task), str(hc.sweep.dir) if multirun else None) or os.path.basename(job_dir),
        group=str(hc.sweep.dir) if multirun else None,
        launcher=hc.runtime.choices["launcher"],
        config_yaml=config_yaml,
        overrides=list(hc.overrides.task),
        config_sha256=config_sha256(config_yaml),
        command=list(argv),
        stated_mode=stated_mode(hc),
    )


def run_name(overrides: list[str], sweep_dir: str | None) -> str:
    """The overrides that tell this job apart: in a sweep, those of the swept keys; else all of them but plan=, so
    that a plan shows the name its run gets."""
    key = lambda o: o.split("=", 1)[0].lstrip("+~")  # noqa: E731
    overrides = [o for o in overrides if key(o) != "plan"]
    if sweep_dir is not None:
        swept = swept_keys(sweep_dir)
        if any(key(o) in swept for o in overrides):
            overrides = [o for o in overrides if key(o) in swept]
    return ",".join(sorted(overrides, key=key))


def swept_keys(sweep_dir: str) -> set[str]:
    """Keys given several values on the command line, read from the multirun.yaml Hydra writes first."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        task = OmegaConf.load(os.path.join(sweep_dir, "multirun.yaml")).hydra.overrides.task
    except (FileNotFoundError, OmegaConfBaseException):
        return set()
    return {o.get_key_element() for o in OverridesParser.create().parse_overrides(list(task)) if o.is_sweep_override()}
