"""The parent's side of one job: typed config, job dir, device checks, data preparation, then the launcher's
handle, waited on (or, for a scheduler's jobs in a sweep, kept to wait on once every job is submitted)."""

from __future__ import annotations

import glob
import importlib
import logging
import os
import shlex
import sys
import time
from types import ModuleType
from typing import TYPE_CHECKING, Any

import yaml
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ddpexp.config import Config
from ddpexp.exceptions import ConfigError, Interrupted, RankFailure
from ddpexp.job import Job, read_json, write_json
from ddpexp.launchers.base import Handle, tail
from ddpexp.parent import check, parallel
from ddpexp.parent.objective import needs_each_value
from ddpexp.parent.plan import render as render_plan
from ddpexp.parent.resume_decision import check_resume, config_sha256
from ddpexp.parent.schema import FREE, closest_key, unknown_keys
from ddpexp.parts import data

if TYPE_CHECKING:  # the command calls run(); the type only, no import circle
    from ddpexp.cli.command import Command

log = logging.getLogger("ddpexp")


def run(dcfg: DictConfig, cmd: Command) -> float | None:
    """One experiment, a full DDP run, for the command `cmd` (Command.task is Hydra's task function). Returns the
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
    data.prepare(cfg.data)
    check.components(cfg)

    from ddpexp.rank import worker  # torch and the training stack, only once the config is known to be good

    cmd.launched.add(job.dir)  # from here on, .hydra/ records this attempt
    if in_parallel(cfg, launcher):  # sweep.parallel=N: a child process of this command runs it (parent/parallel.py)
        parallel.start(cmd, launch_function(cfg.launcher._target_), worker.main, cfg, job, start)
        return None
    try:
        handle = launch_function(cfg.launcher._target_)(worker.main, cfg, job)
    except RankFailure as e:
        raise record_failure(job, first_failure(job) or e, time.time() - start) from None
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


def wait(job: Job, handle: Handle, start: float) -> float | None:
    """Until the job's ranks ended: a failure (or a second Ctrl-C) is recorded in the job's summary.json, by the
    command that reports the job (launcher=env: each rank is a command, rank 0's reports)."""
    if not getattr(handle, "reports", True):
        handle.wait()
        print(f"ddpexp: this rank finished in {time.time() - start:.1f}s; rank 0's command reports the job")
        return None
    try:
        handle.wait()
    except RankFailure as e:
        raise record_failure(job, first_failure(job) or e, time.time() - start) from None
    except BaseException as e:
        record_failure(job, e, time.time() - start)
        raise
    return finish(job, start)


def wait_deferred(cmd: Command) -> list[str]:
    """After a multirun's submissions: wait for each job; returns the failed ones as "job_dir: error". The jobs
    running at once here (sweep.parallel) are all waited for first, even after one stopped on a signal."""
    if cmd.pool is not None:
        cmd.pool.drain(cmd)
    failed, deferred = [], cmd.deferred
    while deferred:
        job, handle, start = deferred.pop(0)
        try:
            wait(job, handle, start)
        except RankFailure as e:
            failed.append(f"{job.dir}: {str(e).splitlines()[0]}")
            print(f"ddpexp: error: job {job.dir}: {e}", file=sys.stderr)
    return failed


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
        check.components(cfg)
    return warning


def finish(job: Job, start: float) -> float | None:
    summary = read_json(job.summary_path)
    if summary is None:  # multi-node: global rank 0, and with it the run record, is on another node
        print(f"ddpexp: this node's ranks finished in {time.time() - start:.1f}s; rank 0 holds the run record")
        return None
    if summary.get("status") in ("interrupted", "requeued") or _signalled(summary):
        raise Interrupted(interrupted_message(job, summary))
    if summary.get("status") != "completed":
        raise RankFailure(summary.get("error", "?").rsplit("(", 1)[-1].rstrip(")"), summary.get("error", "no summary"))
    final = summary.get("final", {})
    ordered = sorted(final.items(), key=lambda kv: kv[0] != "train/loss")  # train/loss, then the task's metrics
    metrics = " ".join(f"{k}={v:.4f}" if isinstance(v, (int, float)) else f"{k}={v}" for k, v in ordered)
    early = f", stopped early at step {summary.get('steps')}" if summary.get("stopped_early") else ""
    print(f"ddpexp: {summary.get('status', 'finished')} in {time.time() - start:.1f}s{early}: {metrics} -> {job.dir}")
    return final.get(yaml.safe_load(job.config_yaml).get("objective", "val/acc"))


def _signalled(summary: dict[str, Any]) -> bool:
    return summary.get("status") == "failed" and "SignalException" in str(summary.get("error", ""))


def interrupted_message(job: Job, summary: dict[str, Any]) -> str:
    """The line a stopped job ends with: where it stopped and the exact command that continues it."""
    where = f"at step {summary['steps']}" if "steps" in summary else "before its first step"
    ckpt = f"checkpoint {summary['checkpoint']}" if summary.get("checkpoint") else "no checkpoint written"
    again = [a for a in job.command if not a.startswith(("hydra.run.dir=", "hydra.sweep.dir="))]
    hc = HydraConfig.get()
    where_dir = f"hydra.sweep.dir={hc.sweep.dir}" if hc.mode == RunMode.MULTIRUN else f"hydra.run.dir={job.dir}"
    command = shlex.join(["python", "-m", "ddpexp", *again, where_dir])
    if summary.get("started_by"):  # each rank is a command that another launcher started: it starts them again
        command = f"the same launch ({summary['started_by']}), each rank's ddpexp given {shlex.quote(where_dir)}"
    return f"interrupted by {summary.get('signal', 'a signal')} {where}, {ckpt}; resume with: {command}"


def to_config(dcfg: DictConfig) -> Config:
    """Resolve ${...} and run every __post_init__ check, here in the parent before anything starts."""
    try:
        cfg = OmegaConf.to_object(dcfg)
    except OmegaConfBaseException as e:
        if isinstance(e.__cause__, ConfigError):
            raise e.__cause__ from None
        raise
    assert isinstance(cfg, Config)
    cfg.wandb = cfg.wandb.with_environment(os.environ)  # the command's WANDB_* variables, read once, here
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


def first_failure(job: Job) -> RankFailure | None:
    """The rank that failed first, from the error files ranks write (a launcher sees whichever it polls first)."""
    records = [read_json(p) for p in glob.glob(os.path.join(job.dir, "logs", "rank*.error.json"))]
    records = [r for r in records if r]
    if not records:
        return None
    first = min(records, key=lambda r: r["time"])
    return RankFailure(first["rank"], tail(first["traceback"]))


def record_failure(job: Job, error: BaseException, wall_time_s: float) -> BaseException:
    """The parent has the last word on a failed job: a rank killed before writing its summary leaves none."""
    summary: dict[str, Any] = read_json(job.summary_path) or {"launcher": job.launcher}
    first = str(error).splitlines()[0] if str(error) else type(error).__name__
    summary.update(status="failed", error=first, wall_time_s=round(wall_time_s, 3))
    summary.setdefault("config_sha256", job.config_sha256)
    if isinstance(error, RankFailure):
        summary["error_detail"] = error.detail
    write_json(job.summary_path, summary)
    return error
