"""How a command fails: config mistakes as one `ddpexp: error:` line (exit 2), rank failures with the tail of
the failing rank's traceback (exit 1). Hydra's own reporting prints multi-line messages and stack frames. The same
verdicts reach Python callers of `ddpexp.run` as exceptions: ConfigError, RunFailed, Interrupted."""

from __future__ import annotations

import difflib
import os
import re
import sys
import traceback
from collections.abc import Callable
from typing import Any

from ddpexp.exceptions import CommandError
from ddpexp.job import why_not_dir

CONFIG_EXIT, FAILED_EXIT, INTERRUPTED_EXIT = 2, 1, 130
# ddpexp's package (this file is in cli/): an error raised in its code is the job's, not the command line's
HERE = os.path.dirname(os.path.dirname(__file__))
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
                continue  # the schemas behind each option (schema.register_configs), not choices
            elif listing:
                parts[-1] += (" " if parts[-1].endswith(":") else ", ") + line
            else:
                parts.append(line)
                listing = line.endswith(":")
    return " ".join(p.rstrip(".") + "." if not p.endswith((".", ":")) else p for p in parts).rstrip(":. ")


def is_config_error(error: BaseException) -> bool:
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from ddpexp.exceptions import ConfigError

    return isinstance(error, (ConfigError, HydraException, OmegaConfBaseException))


def verdict(error: BaseException, cmd: Any) -> tuple[int, str] | None:
    """(exit code, message) for an error the command reports in one line (or with the failing rank's traceback);
    None for anything else: a bug, whose traceback is shown. Interrupted and KeyboardInterrupt exit 130."""
    from ddpexp.exceptions import Interrupted, RankFailure

    if isinstance(error, RankFailure):
        return FAILED_EXIT, f"error: {error}"
    if isinstance(error, Interrupted):
        return INTERRUPTED_EXIT, str(error)
    if isinstance(error, CommandError):
        return CONFIG_EXIT, f"error: {error}"
    if isinstance(error, KeyboardInterrupt):
        return INTERRUPTED_EXIT, (
            "interrupted again: ranks stopped at once; the same command with hydra.run.dir=<its job dir> "
            "continues from the last checkpoint"
        )
    if not isinstance(error, Exception):
        return None
    if cmd.failed and "No trials are completed yet" in str(error):  # Optuna's end when every trial failed
        return FAILED_EXIT, cmd.failed_jobs_message("every trial of the study failed: ")
    if str(error).startswith("Expecting one subcommand from ['install', 'uninstall', 'query']"):  # -sc alone
        return CONFIG_EXIT, "error: --shell-completion needs what to do: ddpexp -sc install=bash (or zsh, fish)"
    message = job_dir_error(error) or (config_message(error) if is_config_error(error) else None)
    return None if message is None else (CONFIG_EXIT, f"error: {message}")


def config_message(error: BaseException) -> str:
    """The one line for bad input: Hydra's and OmegaConf's messages folded, an unknown key with the closest one."""
    return unknown_key(error) or missing_option(error) or one_line(error)


def missing_option(error: BaseException) -> str | None:
    """Hydra's "Could not load 'tracker/tensorbord'" for an option in a list (`tracker=[wandb,tensorbord]`) says
    less than its "Could not find" for one option: the same line, with the group's options, is said for both."""
    found = re.search(r"In '([^']+)': Could not load '(.+)/([^'/]+)'", str(error))
    if found is None:
        return None
    parent, group, name = found.groups()
    try:
        from hydra.core.global_hydra import GlobalHydra

        options = GlobalHydra.instance().config_loader().get_group_options(group)
    except Exception:  # Hydra no longer set up: its own line
        return None
    options = sorted(o for o in options if not o.startswith("base_"))
    return f"In '{parent}': Could not find '{group}/{name}'. Available options in '{group}': {', '.join(options)}"


def report(func: Callable[[], Any], cmd: Any) -> Any:
    """`func()`, its error reported as the command line does: one line and an exit code. HYDRA_FULL_ERROR=1 also
    shows the traceback behind the line (a user's model that raises in its constructor, say)."""
    try:
        return func()
    except BaseException as e:
        found = verdict(e, cmd)
        if found is None:
            raise
        if os.environ.get("HYDRA_FULL_ERROR") == "1" and found[0] == CONFIG_EXIT:
            traceback.print_exception(e.__cause__ or e, file=sys.stderr)
        print(f"ddpexp: {found[1]}", file=sys.stderr)
        sys.exit(found[0])


def unknown_key(error: BaseException) -> str | None:
    """Hydra's "Could not override 'optimzer.lr'. To append to your config use +optimzer.lr=..." (hydra#620;
    config_loader_impl.py _apply_overrides_to_config, L391) suggests the `+` that would add the typo as a new key
    (hydra#1912): name the key that exists instead."""
    from ddpexp.parent.schema import FREE, closest_key

    text = f"{error} {error.__cause__ or ''}"
    found = re.search(r"Could not override '([^']+)'\.", text)
    if found is None or "Key '" not in text:  # the key is not in the schema (not a bad value for it)
        return None
    key = found.group(1)
    head = key.split(".")[0]
    if head in FREE:  # `+` would add a new argument for its _target_: the advice holds unless a key is close
        return _closest_argument(key, getattr(error.__cause__, "parent_node", None))
    if head == "hydra":  # Hydra's own: its `+` advice holds
        return None
    return f"{key}: no such key{closest_key(key)}"


def _closest_argument(key: str, node: Any) -> str | None:
    """A typo of a key the group's option has (`model.hiden` for `model.hidden`), from the node Hydra looked in."""
    known = [str(k) for k in node.keys()] if hasattr(node, "keys") else []
    match = difflib.get_close_matches(key.rpartition(".")[2], known, n=1)
    if not match:
        return None
    return (
        f"{key}: no such key (did you mean {key.rpartition('.')[0]}.{match[0]}?); "
        f"`+{key}=...` would add it as a new argument of {key.split('.')[0]}'s _target_"
    )


def job_dir_error(error: BaseException) -> str | None:
    """Hydra could not create the job dir (hydra.run.dir, or a sweep's dirs) or write its .hydra/ there: that
    path and why, in one line; None for any other error (an OSError of the job itself is a failure, not this).
    Bad input like any other (exit 2): nothing started."""
    cause = error if isinstance(error, OSError) else error.__cause__  # a log file: logging's ValueError from it
    # Hydra's MissingConfigException (a missing option, `-m model=resnet2,mlp`) is an IOError too
    if not isinstance(cause, OSError) or is_config_error(cause):
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


def bad_override(overrides: list[str]) -> str | None:
    """What Hydra's override parser would report as a grammar error with no word of the cause (`=3`)."""
    for override in overrides:
        if override.lstrip("+~").startswith("="):
            return f"override {override!r}: no KEY before '=' (overrides are KEY=VALUE)"
    return None


def record_refusal(job_dir: str, line: str, cmd: Any) -> None:
    """A sweep's job refused before its ranks started gets a record saying so (status failed, the one line), so
    that `ddpexp report` shows why; a job dir holding an earlier record keeps it untouched."""
    from ddpexp.job import write_json

    path = os.path.join(job_dir, "summary.json")
    if os.path.isdir(job_dir) and not os.path.exists(path) and job_dir not in cmd.launched:
        write_json(path, {"status": "failed", "error": line, "refused": True})
