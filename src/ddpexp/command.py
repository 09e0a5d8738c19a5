"""One ddpexp command, a command line or one `ddpexp.run(...)` call: the state its jobs leave for the command's end
(failed jobs, scheduler jobs still to wait for, the job dirs and their earlier .hydra/ records), and the Hydra task
function of ddpexp.run, whose sweep part the CLI shares. A new Command per call: nothing leaks into the next one."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Command:
    argv: list[str]  # as typed after `ddpexp`: the resume and plan lines repeat it
    failed: list[str] = field(default_factory=list)  # jobs of a multirun that failed, as "job_dir: error"
    deferred: list[tuple[Any, Any, float]] = field(default_factory=list)  # (job, waiter, start) to wait for at the end
    launched: set[str] = field(default_factory=set)  # job dirs whose ranks were started (parent.run adds them)
    earlier_hydra: dict[str, dict[str, bytes]] = field(default_factory=dict)  # job dir -> .hydra/ files before
    job_dirs: list[str] = field(default_factory=list)  # every job dir of the command, in the order Hydra ran them
    planned: bool = False  # plan=true: jobs were shown, none started
    error: Exception | None = None  # what a single run raised (task), for the caller to raise once Hydra is done
    # False only for the stand-in outside any command: another Hydra app in this process then runs as if ddpexp
    # had not wrapped Hydra's run_job (sweep.install_record_guard)
    active: bool = True

    def add_job_dir(self, job_dir: str) -> None:
        if job_dir not in self.job_dirs:
            self.job_dirs.append(job_dir)


_current = Command(argv=sys.argv[1:], active=False)


def current() -> Command:
    return _current


@contextmanager
def begin(argv: list[str]) -> Iterator[Command]:
    """The command that the jobs started inside this block belong to."""
    global _current
    previous, _current = _current, Command(argv=list(argv))
    try:
        yield _current
    finally:
        _current = previous


def task(dcfg: Any) -> Any:
    """Hydra's task function for ddpexp.run: a job of a multirun goes through run_in_sweep; a single run's error is
    kept in `current().error` for the caller to raise (hydra-core 1.3's JobReturn prints "Error executing job with
    overrides" first when it raises one itself)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from ddpexp.parent import run

    if HydraConfig.get().mode == RunMode.MULTIRUN:
        return run_in_sweep(dcfg)
    try:
        return run(dcfg)
    except Exception as e:
        current().error = e
        return None


def run_in_sweep(dcfg: Any) -> Any:
    """One job of a multirun: a failure is recorded and counted, and the sweep goes on (Hydra's basic sweeper
    would stop it); an Optuna sweeper records a failed trial. A signal stops the whole sweep."""
    from hydra.core.hydra_config import HydraConfig

    from ddpexp.errors import is_config_error, one_line
    from ddpexp.launchers import Interrupted, RankFailure
    from ddpexp.objective import failed_trial
    from ddpexp.parent import run

    try:
        return run(dcfg)
    except Interrupted:
        raise
    except Exception as e:
        if not isinstance(e, RankFailure) and not is_config_error(e):
            raise
        line = str(e).splitlines()[0] if isinstance(e, RankFailure) else one_line(e)
        current().failed.append(f"{HydraConfig.get().runtime.output_dir}: {line}")
        print(f"ddpexp: error: job {HydraConfig.get().job.num} failed: {line}", file=sys.stderr)
        return failed_trial()


def wait_deferred() -> None:
    """After a multirun's submissions: wait for the scheduler's jobs (a command that imported no parent had none)."""
    if "ddpexp.parent" in sys.modules:
        current().failed.extend(sys.modules["ddpexp.parent"].wait_deferred())
