"""Every change ddpexp makes to hydra-core 1.3 (pinned <1.4), in one place, installed for one command's lifetime
and taken out after it (`installed(cmd)`), so a process that runs other Hydra apps, or ddpexp.run twice, meets
Hydra as it is. Hydra has no hook for any of these; each cites the upstream issue, or, where none was ever filed,
the place in hydra-core 1.3's source that behaves so (the line numbers are those of the v1.3.2 tag; 1.3.8 is the
same there)."""

from __future__ import annotations

import contextlib
import importlib
import os
import shutil
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from ddpexp.cli.errors import HERE
from ddpexp.exceptions import CommandError
from ddpexp.parent.command import Command


@contextmanager
def installed(cmd: Command, cli: bool) -> Iterator[None]:
    """The patches for `cmd`: the job-dir record guard and a clean --help always; for a command line (`cli`) also
    one-line errors from Hydra's own reporting and argument parsing."""
    import hydra._internal.hydra as hydra_run
    import hydra._internal.utils as hydra_utils
    import hydra.core.utils as core_utils
    from hydra._internal.hydra import Hydra
    from hydra.core.plugins import Plugins

    with ExitStack() as stack:
        original = core_utils.run_job
        guard = _record_guard(cmd, original)
        # run_job as each caller holds it: where it is defined (hydra/core/utils.py), the copy a single run calls
        # (hydra/_internal/hydra.py imports it by name, L21, and Hydra.run calls that, L119), and the launcher
        # plugins' copies (basic_launcher.py L14, behind every sweeper, Optuna's too), which Plugins._scan_all_plugins
        # re-binds each time it re-executes the plugin modules: so after the command, those are put back too.
        stack.enter_context(_patched(core_utils, "run_job", guard))
        stack.enter_context(_patched(hydra_run, "run_job", guard))
        stack.enter_context(_launcher_plugins_run(guard, original))
        stack.enter_context(_patched(Plugins, "instantiate_sweeper", _sweeper_guard(cmd, Plugins.instantiate_sweeper)))
        stack.enter_context(_patched(Hydra, "format_config_groups", _without_schemas(Hydra.format_config_groups)))
        if cli:
            from ddpexp.cli.errors import report

            run_and_report = hydra_utils.run_and_report
            # hydra/_internal/utils.py run_and_report prints a multi-line message, stack frames (print_exc when no
            # run_job frame is near, as for any composition error) and the HYDRA_FULL_ERROR advice (hydra#349,
            # hydra#3329; its fix is not in 1.3); ddpexp's bad input is one line.
            reported = lambda func: run_and_report(lambda: report(func, cmd))  # noqa: E731
            stack.enter_context(_patched(hydra_utils, "run_and_report", reported))
            hydra_main = importlib.import_module("hydra.main")  # the module; `hydra.main` is its function
            parser, run_hydra = _one_line_parser(hydra_main.get_args_parser), _one_line_run(hydra_main._run_hydra)
            stack.enter_context(_patched(hydra_main, "get_args_parser", parser))
            stack.enter_context(_patched(hydra_main, "_run_hydra", run_hydra))
        stack.callback(_command_ended, cmd)
        yield


def _command_ended(cmd: Command) -> None:
    from ddpexp.job import release_lock

    if cmd.pool is not None:  # sweep.parallel: jobs still running (a second Ctrl-C, an error) end with the command
        cmd.pool.close()

    for lock in cmd.locks:
        release_lock(lock)
    cmd.locks.clear()
    cmd.held.clear()


@contextmanager
def _patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


def _record_guard(cmd: Command, original: Callable[..., Any]) -> Callable[..., Any]:
    """Hydra writes a job's .hydra/ record before the task function runs (hydra#678, PR hydra#686: run_job writes
    config.yaml, hydra.yaml, overrides.yaml, then calls the task), so before ddpexp's checks:
    when the job then does not start (refused, already completed, plan=true), the record it found there is put
    back as it was, and a job dir that this command created for nothing is removed. A sweep's job that already
    completed in its dir with the same config is not run again (Hydra cannot resume a sweep: hydra#1407, hydra#3328)."""
    from omegaconf import open_dict, read_write

    from ddpexp.job import take_lock
    from ddpexp.parent.sweep import completed_job, job_dir_of, launcher_job_dir, read_files

    def _guarded_run_job(**kwargs: Any) -> Any:
        config, subdir_key = kwargs["config"], kwargs.get("job_subdir_key")
        job_dir = job_dir_of(config, kwargs["job_dir_key"], subdir_key)
        leader = True
        if subdir_key is None:  # a single run: the launcher may say whose dir it is (launcher=env: rank 0's)
            agreed = launcher_job_dir(config, job_dir)
            if agreed.keep is not None:
                cmd.held.append(agreed.keep)
            if (agreed.path, agreed.leader) != (job_dir, True):
                job_dir, leader = agreed.path, agreed.leader
                with read_write(config.hydra), open_dict(config.hydra):
                    config.hydra.run.dir = job_dir
                    if not leader:  # rank 0's command writes the .hydra/ record and the log file
                        config.hydra.output_subdir = None
                        kwargs["configure_logging"] = False
        cmd.add_job_dir(job_dir)
        if subdir_key is not None:  # a single run: parent.check_resume decides
            done = completed_job(config, job_dir)
            if done is not None:
                return done
        if not leader:  # Hydra makes the dir here too: left empty (plan=true, a refusal), it is taken away, even
            try:  # one rank 0 made (its plan may end first and remove its own record before Hydra made it again)
                return original(**kwargs)
            finally:
                with contextlib.suppress(OSError):  # only an empty dir goes
                    os.rmdir(job_dir)
        # An empty dir is no one's work: under launcher=env another rank's Hydra may have just made it (rank 1
        # first, then a plan here would leave rank 0's .hydra/ record behind in it).
        existed = os.path.isfile(job_dir) or (os.path.isdir(job_dir) and bool(os.listdir(job_dir)))
        lock = take_lock(job_dir)  # before Hydra writes: a running job's dir is refused untouched
        if config.hydra.output_subdir is None:
            try:
                return original(**kwargs)
            finally:
                _release(cmd, lock, job_dir)
        hydra_dir = os.path.join(job_dir, str(config.hydra.output_subdir))
        earlier = cmd.earlier_hydra[job_dir] = read_files(hydra_dir)  # as they were before this attempt
        try:
            return original(**kwargs)
        finally:
            _release(cmd, lock, job_dir)
            if job_dir not in cmd.launched:
                for name, data in earlier.items():
                    with open(os.path.join(hydra_dir, name), "wb") as f:
                        f.write(data)
                if not existed and subdir_key is None:  # a single run that never started: no empty job dir
                    _remove_if_only_hydras(job_dir, str(config.hydra.output_subdir), str(config.hydra.job.name))

    return _guarded_run_job


def _release(cmd: Command, lock: str | None, job_dir: str) -> None:
    """A job's lock goes with its run, or with the command for a job still queued at a scheduler."""
    from ddpexp.job import release_lock

    if lock is not None and any(job.dir == job_dir for job, _, _ in cmd.deferred):
        cmd.locks.append(lock)
    else:
        release_lock(lock)


@contextmanager
def _launcher_plugins_run(guard: Callable[..., Any], original: Callable[..., Any]) -> Iterator[None]:
    def plugins() -> list[Any]:
        return [m for name, m in list(sys.modules.items()) if name.startswith(("hydra._internal.core_plugins",
                "hydra_plugins")) and callable(getattr(m, "run_job", None))]  # fmt: skip

    for module in plugins():  # scanned by an earlier command of this process
        module.run_job = guard
    try:
        yield
    finally:
        for module in plugins():
            if module.run_job is guard:
                module.run_job = original


def _remove_if_only_hydras(job_dir: str, output_subdir: str, job_name: str) -> None:
    """Remove a job dir holding nothing but what Hydra wrote there (.hydra/ and the job's log file)."""
    hydras = {output_subdir, f"{job_name}.log"}
    try:
        if set(os.listdir(job_dir)) <= hydras:
            shutil.rmtree(job_dir)
    except OSError:  # gone already, or not ours to remove
        pass


def _sweeper_guard(cmd: Command, original: Callable[..., Any]) -> Callable[..., Any]:
    """The basic sweeper rewrites the sweep dir's multirun.yaml first thing (basic_sweeper.py BasicSweeper.sweep,
    L164, before it checks the batch or launches; the file is PR hydra#576's): put it back if no job then ran, or
    remove it and the dirs made for it when it is all this command left there (a sweep refused as a whole). Its
    class is re-created when Hydra scans its plugins, so the sweeper is wrapped as Hydra makes it. A plan of a
    search whose trials depend on earlier results, and a sweeper `direction` against the objective's mode, are
    refused here, before the search begins (hydra/_internal/hydra.py Hydra.multirun instantiates the sweeper, with
    the composed config, before it calls its sweep), and so is a Hydra launcher plugin (hydra/launcher=joblib)."""
    from ddpexp.parent.launch import every_job_checked_first
    from ddpexp.parent.objective import check_sweeper_direction, refuse_for_search
    from ddpexp.parent.outside import refuse_sweep
    from ddpexp.parent.sweep import refuse_hydra_launcher

    def _instantiate_sweeper(self: Any, **kwargs: Any) -> Any:
        config = kwargs["config"]
        refuse_sweep()  # -m inside a world another launcher started
        refuse_hydra_launcher(config)  # the sweeper instantiates the launcher in its setup, after this
        refuse_for_search(config)  # plan=true, sweep.parallel: before the study starts and prints
        check_sweeper_direction(config)
        sweeper = original(self, **kwargs)
        launcher = getattr(sweeper, "launcher", None)
        if type(sweeper).__name__ == "BasicSweeper" and hasattr(launcher, "hydra_context"):
            launcher.launch = every_job_checked_first(launcher, launcher.launch, _refused, cmd)
        sweep_dir = os.path.abspath(str(kwargs["config"].hydra.sweep.dir))
        sweep, path = sweeper.sweep, os.path.join(sweep_dir, "multirun.yaml")

        def guarded_sweep(arguments: list[str]) -> Any:
            earlier = None
            if os.path.isfile(path):
                with open(path, "rb") as f:
                    earlier = f.read()
            existing = _first_existing(sweep_dir)
            launched = len(cmd.launched)
            try:
                return sweep(arguments)
            finally:
                if earlier is not None and len(cmd.launched) == launched:
                    with open(path, "wb") as f:
                        f.write(earlier)
                elif earlier is None and len(cmd.launched) == launched:
                    _remove_made_for_nothing(sweep_dir, existing)

        sweeper.sweep = guarded_sweep
        return sweeper

    return _instantiate_sweeper


def _refused(idx: int, error: Exception) -> BaseException:
    from ddpexp.cli.errors import config_message, is_config_error

    return CommandError(f"job {idx} of the sweep: {config_message(error)}") if is_config_error(error) else error


def _first_existing(path: str) -> str:
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def _remove_made_for_nothing(sweep_dir: str, existing: str) -> None:
    """A sweep dir holding only the multirun.yaml this command wrote, and the empty dirs made above it up to
    `existing` (multirun/DATE/), are removed."""
    try:
        if os.listdir(sweep_dir) != ["multirun.yaml"]:
            return
        os.remove(os.path.join(sweep_dir, "multirun.yaml"))
        while sweep_dir != existing and not os.listdir(sweep_dir):
            os.rmdir(sweep_dir)
            sweep_dir = os.path.dirname(sweep_dir)
    except OSError:  # gone already, or not ours to remove
        pass


def _without_schemas(original: Callable[..., str]) -> Callable[..., str]:
    """--help lists every option of a group, the `base_<name>` schemas that each option's YAML extends too (the
    schema-in-the-same-group pattern Hydra's own docs teach, tutorials/structured_config/5_schema); they are not
    choices. Hydra.format_config_groups lists whatever get_group_options returns, ConfigStore entries too (L305)."""

    def format_config_groups(self: Any, predicate: Callable[[str], bool], compact: bool = True) -> str:
        lines = original(self, predicate, compact).splitlines()
        if compact:
            out = []
            for line in lines:
                group, sep, options = line.partition(": ")
                kept = [o for o in options.split(", ") if not o.startswith("base_")] if sep else []
                out.append(f"{group}: {', '.join(kept)}" if sep else line)
            return "\n".join(out) + "\n"
        return "\n".join(line for line in lines if not line.strip().startswith("base_")) + "\n"

    return format_config_groups


def _one_line_parser(make_parser: Callable[[], Any]) -> Callable[[], Any]:
    """hydra.main's argparse errors print its usage and `__main__.py: error:` (hydra/_internal/utils.py
    get_args_parser builds the parser with no prog, L504, so argparse names it after sys.argv[0]; argparse's own
    error() prints the usage): one ddpexp line instead."""

    def _get_args_parser() -> Any:
        parser = make_parser()
        if os.path.basename(parser.prog) == "__main__.py":
            parser.prog = "python -m ddpexp"  # --help's usage line
        parser.error = lambda message: cli_exit(f"{message} (see {parser.prog} --help)")  # type: ignore[method-assign]
        return parser

    return _get_args_parser


def _one_line_run(run_hydra: Callable[..., Any]) -> Callable[..., Any]:
    """What hydra.main's `_run_hydra` raises outside run_and_report as one line, exit 2: --help, --hydra-help and
    --info call app_help, hydra_help and show_info directly (hydra/_internal/utils.py L363, L371, L420), so a bad
    override there is a traceback; and `=3` (an empty key, which the grammar takes as the root group) ends in
    defaults_list.py's "Config group override must be a string or a list. Got int" (L96)."""
    from ddpexp.cli.errors import bad_override, config_message, is_config_error

    def _run_hydra_one_line(**kwargs: Any) -> Any:
        bad = bad_override(getattr(kwargs.get("args"), "overrides", None) or [])
        if bad:
            cli_exit(bad)
        try:
            return run_hydra(**kwargs)
        except Exception as e:  # Hydra's own (the job's own errors reach here only with HYDRA_FULL_ERROR=1)
            ours = [f for f, _ in traceback.walk_tb(e.__traceback__) if f.f_code.co_filename.startswith(HERE)]
            if any(f.f_code.co_filename != __file__ for f in ours) or not (
                is_config_error(e) or isinstance(e, ValueError)
            ):
                raise
            cli_exit(config_message(e))

    return _run_hydra_one_line


def cli_exit(message: str) -> Any:
    from ddpexp.cli.errors import CONFIG_EXIT

    print(f"ddpexp: error: {message}", file=sys.stderr)
    sys.exit(CONFIG_EXIT)
