"""`ddpexp.run([...])`: the command line as a Python function, for notebooks and scripts. The same overrides,
project lookup, job dirs and run records as `ddpexp ...`; it returns the run record, and raises where the command
would exit: ConfigError (bad input, exit 2), RunFailed (a failed job, exit 1), Interrupted (a signal, exit 130)."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from ddpexp.cli import hydra_patches, project
from ddpexp.cli.command import task_function
from ddpexp.cli.errors import CONFIG_EXIT, FAILED_EXIT, bad_override, verdict
from ddpexp.exceptions import RunFailed
from ddpexp.parent.command import Command

# The job name hydra.main gives `ddpexp` and `python -m ddpexp` (after the module): the job's log is __main__.log.
TASK_NAME = "__main__"


class Summary(dict[str, Any]):
    """A job's summary.json as a dict, and `job_dir`: the folder holding its run record."""

    def __init__(self, job_dir: str, record: dict[str, Any]):
        super().__init__(record)
        self.job_dir = job_dir


def run(
    overrides: Sequence[str] = (), *, multirun: bool = False, config_dir: str | os.PathLike[str] | None = None
) -> Summary | list[Summary | None] | None:
    """Run what `ddpexp [-m] [--config-dir DIR] OVERRIDE...` runs, from this process (the ranks are started by the
    launcher, as for the command line). Call it from the main thread: the launchers hand signals on to the ranks.

    Returns the job's Summary (None with plan=true, or on a node that does not hold global rank 0). A multirun
    (`multirun=True`, or a config that sets hydra.mode=MULTIRUN such as hparams_search=...) returns a list with one
    entry per job, in the order the sweeper ran them. Raises ConfigError for bad input, RunFailed when the job, or
    any job of a sweep, failed (its `summaries` hold the jobs' records: a job refused before its ranks started
    has one saying so; None for a job that left none), Interrupted when a signal stopped the job after its checkpoint.
    """
    from ddpexp.exceptions import ConfigError
    from ddpexp.parent.compat import with_declared_keys
    from ddpexp.parent.outside import with_outside_launcher
    from ddpexp.parent.wait import wait_deferred  # Hydra: imported on first call, not with ddpexp

    if isinstance(overrides, (str, bytes)):
        raise ConfigError(f"overrides={overrides!r}: must be a list of KEY=VALUE strings, not one string")
    overrides = with_outside_launcher([str(o) for o in overrides])  # started by torchrun, srun...: launcher=env
    overrides = with_declared_keys(overrides)  # +data.test_fraction=F from before it was declared
    conf = project.config_dir(None if config_dir is None else os.fspath(config_dir))
    argv = ["-m"] * multirun + ["--config-dir", conf] * (conf is not None) + overrides
    cmd = Command(argv=argv, keep_error=True)  # the call's state, for its whole lifetime
    with hydra_patches.installed(cmd, cli=False), project.on_path(conf), _own_hydra(), _logging_put_back():
        try:
            swept = _hydra_run(overrides, multirun, conf, cmd)
            if cmd.error is not None:
                raise cmd.error
            wait_deferred(cmd)
        except BaseException as e:
            error = python_error(e, cmd)
            if error is e:
                raise
            raise error from None
        return _result(cmd, swept)


def _hydra_run(overrides: list[str], multirun: bool, conf: str | None, cmd: Command) -> bool:
    """What hydra-core 1.3's `hydra.main` does for a run or a multirun (hydra._internal.utils._run_hydra and
    _run_app), without its argument parsing and its exits. True for a multirun. Hydra has no public call for this:
    `compose` sets no HydraConfig, by design (hydra#828), and `hydra.main` reads sys.argv (hydra/main.py
    decorated_main parses it, L86; hydra#2459 asks for an `overrides` argument)."""
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_automatic_config_search_path
    from hydra.core.config_search_path import SearchPathQuery
    from hydra.types import RunMode

    from ddpexp.exceptions import ConfigError
    from ddpexp.parent.schema import register_configs

    bad = bad_override(overrides)
    if bad:
        raise ConfigError(bad)
    register_configs()
    search_path = create_automatic_config_search_path(None, None, project.PACKAGE_CONF)
    if conf is not None:  # as --config-dir does: after ddpexp's own configs, before the schemas
        if not os.path.isdir(conf):
            raise ConfigError(f"config_dir={conf}: no such directory")
        search_path.prepend("command-line", f"file://{conf}", anchor=SearchPathQuery(provider="schema"))
    hydra = Hydra.create_main_hydra2(task_name=TASK_NAME, config_search_path=search_path)
    mode = hydra.get_mode(config_name="config", overrides=overrides)
    if mode is None or (multirun and mode == RunMode.RUN):
        mode = RunMode.MULTIRUN if multirun else RunMode.RUN
        overrides = [*overrides, f"hydra.mode={mode.name}"]
    if mode == RunMode.RUN:
        hydra.run(config_name="config", task_function=task_function(cmd), overrides=overrides)
        return False
    hydra.multirun(config_name="config", task_function=task_function(cmd), overrides=overrides)
    return True


def _result(cmd: Command, swept: bool) -> Summary | list[Summary | None] | None:
    if cmd.planned:
        return None
    summaries = _records(cmd.job_dirs)
    if cmd.failed:
        raise RunFailed(cmd.failed_jobs_message(), summaries)
    return summaries if swept else summaries[0] if summaries else None


def _records(job_dirs: list[str]) -> list[Summary | None]:
    from ddpexp.job import read_json

    records = [(d, read_json(os.path.join(d, "summary.json"))) for d in job_dirs]
    return [None if r is None else Summary(d, r) for d, r in records]


def python_error(error: BaseException, cmd: Command) -> BaseException:
    """The exception ddpexp.run raises for `error`: the command line's verdict as a typed error (ConfigError for
    exit 2, RunFailed for exit 1); a signal (Interrupted, KeyboardInterrupt) and a bug's own error as they are."""
    from ddpexp.exceptions import ConfigError

    found = verdict(error, cmd)
    if found is None or found[0] not in (CONFIG_EXIT, FAILED_EXIT):
        return error
    code, message = found[0], found[1].removeprefix("error: ")
    if code == FAILED_EXIT:
        return RunFailed(message, _records(cmd.job_dirs))
    return error if isinstance(error, ConfigError) and str(error) == message else ConfigError(message)


@contextmanager
def _own_hydra() -> Iterator[None]:
    """A fresh GlobalHydra for this call; the caller's own (an initialize() in a notebook) and HydraConfig back after."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    global_hydra = GlobalHydra.instance()
    saved, saved_cfg = global_hydra.hydra, HydraConfig.instance().cfg
    global_hydra.clear()
    try:
        yield
    finally:
        global_hydra.clear()
        if saved is not None:
            global_hydra.initialize(saved)
        HydraConfig.instance().cfg = saved_cfg


@contextmanager
def _logging_put_back() -> Iterator[None]:
    """Hydra sets up logging for each job (the console and the job's log file); the caller's set-up comes back after,
    so a notebook's later logging does not go on into the last job's file."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        for handler in root.handlers:
            if handler not in handlers:
                handler.close()
        root.handlers[:] = handlers
        root.setLevel(level)
