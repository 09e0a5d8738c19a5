"""How the command fails: config mistakes as one `ddpexp: error:` line (exit 2), rank failures with the tail of
the failing rank's traceback (exit 1). Hydra's own reporting prints multi-line messages and stack frames."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

CONFIG_EXIT, FAILED_EXIT, INTERRUPTED_EXIT = 2, 1, 130
FAILED: list[str] = []  # jobs of this multirun that failed, as "job_dir: error"
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


def report(func: Callable[[], Any]) -> Any:
    from ddpexp.launchers import Interrupted, RankFailure

    try:
        return func()
    except RankFailure as e:
        print(f"ddpexp: error: {e}", file=sys.stderr)
        sys.exit(FAILED_EXIT)
    except Interrupted as e:
        print(f"ddpexp: {e}", file=sys.stderr)
        sys.exit(INTERRUPTED_EXIT)
    except KeyboardInterrupt:
        print("ddpexp: interrupted again: ranks stopped at once; the same command with hydra.run.dir=<its job dir> "
              "continues from the last checkpoint", file=sys.stderr)  # fmt: skip
        sys.exit(INTERRUPTED_EXIT)
    except Exception as e:
        if FAILED and "No trials are completed yet" in str(e):  # the Optuna sweeper's end when every trial failed
            print(failed_jobs_message("every trial of the study failed: "), file=sys.stderr)
            sys.exit(FAILED_EXIT)
        if not is_config_error(e):
            raise
        print(f"ddpexp: error: {one_line(e)}", file=sys.stderr)
        sys.exit(CONFIG_EXIT)


def failed_jobs_message(headline: str = "") -> str:
    return f"ddpexp: {headline}{len(FAILED)} job(s) of the sweep failed:\n  " + "\n  ".join(FAILED)


def install_error_reporting() -> None:
    """Route Hydra's top-level error handler through `report` (hydra-core 1.3's hydra._internal.utils)."""
    import hydra._internal.utils as hydra_utils

    original = hydra_utils.run_and_report
    if getattr(original, "__name__", "") == "_report_then_hydra":
        return

    def _report_then_hydra(func: Callable[[], Any]) -> Any:
        return original(lambda: report(func))

    hydra_utils.run_and_report = _report_then_hydra
