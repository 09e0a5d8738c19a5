"""How a command fails: config mistakes as one `ddpexp: error:` line (exit 2), rank failures with the tail of
the failing rank's traceback (exit 1). Hydra's own reporting prints multi-line messages and stack frames. The same
verdicts reach Python callers of `ddpexp.run` as exceptions: ConfigError, RunFailed, Interrupted."""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

from ddpexp.command import current

CONFIG_EXIT, FAILED_EXIT, INTERRUPTED_EXIT = 2, 1, 130
HERE = os.path.dirname(__file__)  # ddpexp's code: an error raised there is the job's, not the command line's
_SKIP = ("full_key:", "object_type=", "reference_type=", "Set the environment variable HYDRA_FULL_ERROR")


def one_line(error: BaseException) -> str:
    """Fold Hydra/OmegaConf's multi-line messages (and their cause) into one readable line."""
    parts: list[str] = []
    for e in (error, error.__cause__):
        if e is None or (parts and str(e) in parts[-1]):
            continue
        listing = False  # after "Available options in 'model':", the options follow one per line
        for line in str(e).splitlines():
            line = line.strip()
            if line.startswith("Config search path"):
                break
            if not line:
                listing = False
            elif line.startswith(_SKIP):
                continue
            elif listing and line.startswith("base_"):
                continue  # the schemas behind each option (config.register_configs), not choices
            elif listing:
                parts[-1] += (" " if parts[-1].endswith(":") else ", ") + line
            else:
                parts.append(line)
                listing = line.endswith(":")
    return " ".join(p.rstrip(".") + "." if not p.endswith((".", ":")) else p for p in parts).rstrip(":. ")


def is_config_error(error: BaseException) -> bool:
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from ddpexp.config import ConfigError

    return isinstance(error, (ConfigError, HydraException, OmegaConfBaseException))


class RunFailed(RuntimeError):
    """`ddpexp.run`: a job failed (a rank raised or died), or jobs of a sweep did; where the command exits 1.
    `summaries`: the run record of each job (summary.json; None for a job that stopped before its ranks started)."""

    def __init__(self, message: str, summaries: list[Any] | None = None):
        super().__init__(message)
        self.summaries = summaries or []


def verdict(error: BaseException) -> tuple[int, str] | None:
    """(exit code, message) for an error the command reports in one line (or with the failing rank's traceback);
    None for anything else: a bug, whose traceback is shown. Interrupted and KeyboardInterrupt exit 130."""
    from ddpexp.launchers import Interrupted, RankFailure

    if isinstance(error, RankFailure):
        return FAILED_EXIT, f"error: {error}"
    if isinstance(error, Interrupted):
        return INTERRUPTED_EXIT, str(error)
    if isinstance(error, KeyboardInterrupt):
        return INTERRUPTED_EXIT, (
            "interrupted again: ranks stopped at once; the same command with hydra.run.dir=<its job dir> "
            "continues from the last checkpoint"
        )
    if not isinstance(error, Exception):
        return None
    if current().failed and "No trials are completed yet" in str(error):  # Optuna's end when every trial failed
        return FAILED_EXIT, failed_jobs_message("every trial of the study failed: ")
    message = job_dir_error(error) or (one_line(error) if is_config_error(error) else None)
    return None if message is None else (CONFIG_EXIT, f"error: {message}")


def report(func: Callable[[], Any]) -> Any:
    try:
        return func()
    except BaseException as e:
        found = verdict(e)
        if found is None:
            raise
        print(f"ddpexp: {found[1]}", file=sys.stderr)
        sys.exit(found[0])


def job_dir_error(error: BaseException) -> str | None:
    """Hydra could not create the job dir (hydra.run.dir, or a sweep's dirs) or write its .hydra/ there: that
    path and why, in one line; None for any other error (an OSError of the job itself is a failure, not this).
    Bad input like any other (exit 2): nothing started."""
    cause = error if isinstance(error, OSError) else error.__cause__  # a log file: logging's ValueError from it
    if not isinstance(cause, OSError):
        return None
    import hydra

    frames = [frame for frame, _ in traceback.walk_tb(error.__traceback__)]
    hydra_dir = os.path.dirname(str(hydra.__file__))  # hydra_plugins/ too
    for i in range(len(frames) - 1, -1, -1):
        code, local = frames[i].f_code, frames[i].f_locals
        where = local.get("output_dir") if code.co_name == "run_job" else local.get("sweep_dir")
        if where is None or not code.co_filename.startswith(hydra_dir):
            continue
        if any(f.f_code.co_filename.startswith(HERE) for f in frames[i + 1 :]):
            return None  # the job ran and failed on its own
        path = os.path.abspath(str(where))
        kind = "sweep dir" if code.co_name != "run_job" else "run dir"
        return f"cannot create {kind} {path}: {why_not_dir(path, cause)}"
    return None


def why_not_dir(path: str, error: OSError) -> str:
    """Why a folder could not be made or written: the file in its way, else the OS's words (and the path that
    failed, when it is not `path` itself)."""
    if isinstance(error, (FileExistsError, NotADirectoryError)):
        parents = [path]
        while os.path.dirname(parents[-1]) != parents[-1]:
            parents.append(os.path.dirname(parents[-1]))
        in_the_way = next((p for p in parents if os.path.exists(p) and not os.path.isdir(p)), None)
        if in_the_way:
            return f"{in_the_way} is a file"
    why = error.strerror or str(error)
    if error.filename and os.path.abspath(str(error.filename)) != path:
        why += f" ({error.filename})"
    return why


def failed_jobs_message(headline: str = "") -> str:
    failed = current().failed
    return f"{headline}{len(failed)} job(s) of the sweep failed:\n  " + "\n  ".join(failed)


def install_error_reporting() -> None:
    """Route Hydra's top-level error handler through `report` (hydra-core 1.3's hydra._internal.utils)."""
    import hydra._internal.utils as hydra_utils

    original = hydra_utils.run_and_report
    if getattr(original, "__name__", "") == "_report_then_hydra":
        return

    def _report_then_hydra(func: Callable[[], Any]) -> Any:
        return original(lambda: report(func))

    hydra_utils.run_and_report = _report_then_hydra
    install_cli_errors()


def install_cli_errors() -> None:
    """Bad command lines as one line, exit 2: hydra.main's argparse errors (its usage and `__main__.py: error:`),
    and what its `_run_hydra` raises outside run_and_report (--help/--info composing a bad override, `=3`)."""
    import importlib

    hydra_main = importlib.import_module("hydra.main")  # the module; `hydra.main` is its function
    make_parser, run_hydra = hydra_main.get_args_parser, hydra_main._run_hydra
    if getattr(run_hydra, "__name__", "") == "_run_hydra_one_line":
        return

    def _get_args_parser() -> Any:
        parser = make_parser()
        if os.path.basename(parser.prog) == "__main__.py":
            parser.prog = "python -m ddpexp"  # --help's usage line
        parser.error = lambda message: _cli_exit(f"{message} (see {parser.prog} --help)")  # type: ignore[method-assign]
        return parser

    def _run_hydra_one_line(**kwargs: Any) -> Any:
        bad = bad_override(getattr(kwargs.get("args"), "overrides", None) or [])
        if bad:
            _cli_exit(bad)
        try:
            return run_hydra(**kwargs)
        except Exception as e:  # Hydra's own (the job's own errors reach here only with HYDRA_FULL_ERROR=1)
            ours = [f for f, _ in traceback.walk_tb(e.__traceback__) if f.f_code.co_filename.startswith(HERE)]
            if any(f.f_code.co_filename != __file__ for f in ours) or not (
                is_config_error(e) or isinstance(e, ValueError)
            ):
                raise
            _cli_exit(one_line(e))

    hydra_main.get_args_parser, hydra_main._run_hydra = _get_args_parser, _run_hydra_one_line


def bad_override(overrides: list[str]) -> str | None:
    """What Hydra's override parser would report as a grammar error with no word of the cause (`=3`)."""
    for override in overrides:
        if override.lstrip("+~").startswith("="):
            return f"override {override!r}: no KEY before '=' (overrides are KEY=VALUE)"
    return None


def _cli_exit(message: str) -> Any:
    print(f"ddpexp: error: {message}", file=sys.stderr)
    sys.exit(CONFIG_EXIT)
