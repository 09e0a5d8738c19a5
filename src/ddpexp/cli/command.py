"""Hydra's task function of one command (parent/command.py: Command, the command's state): a single run's error
reported in one line and an exit code, or kept for `ddpexp.run`'s caller; a sweep's failed job recorded and
counted while the sweep goes on."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from ddpexp.exceptions import CommandError, Interrupted, RankFailure
from ddpexp.parent.command import Command


def task_function(cmd: Command) -> Callable[[Any], Any]:
    """Hydra's task function for `cmd`: a job of a multirun goes through `run_in_sweep`; a single run's error is
    reported in one line and an exit code (the command line), or kept for the caller (ddpexp.run: hydra-core
    1.3's JobReturn prints "Error executing job with overrides" first when the task raises)."""

    def task(dcfg: Any) -> Any:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        from ddpexp.cli.errors import report
        from ddpexp.parent.launch import run

        if HydraConfig.get().mode == RunMode.MULTIRUN:
            return run_in_sweep(cmd, dcfg)
        if not cmd.keep_error:
            return report(lambda: run(dcfg, cmd), cmd)
        try:
            return run(dcfg, cmd)
        except Exception as e:
            cmd.error = e
            return None

    return task


def run_in_sweep(cmd: Command, dcfg: Any) -> Any:
    """One job of a multirun: a failure is recorded and counted, and the sweep goes on (Hydra's basic sweeper
    would stop it); an Optuna sweeper records a failed trial. A signal, or bad input that concerns the whole
    command (a CommandError), stops the whole sweep."""
    from hydra.core.hydra_config import HydraConfig

    from ddpexp.cli.errors import is_config_error, one_line, record_refusal
    from ddpexp.parent.launch import run
    from ddpexp.parent.objective import failed_trial

    try:
        return run(dcfg, cmd)
    except (Interrupted, CommandError):
        raise
    except Exception as e:
        if not isinstance(e, RankFailure) and not is_config_error(e):
            raise
        job_dir = str(HydraConfig.get().runtime.output_dir)
        line = str(e).splitlines()[0] if isinstance(e, RankFailure) else one_line(e)
        if not isinstance(e, RankFailure):  # refused before its ranks: its record says so, for `report`
            record_refusal(job_dir, line, cmd)
        cmd.failed.append(f"{job_dir}: {line}")
        print(f"ddpexp: error: job {HydraConfig.get().job.num} failed: {line}", file=sys.stderr)
        return failed_trial()
