"""One ddpexp command, a command line or one `ddpexp.run(...)` call, as one object for its lifetime: what its jobs
leave for the command's end (the jobs launched, submitted jobs still to wait for, the failed ones, the job dirs and
their earlier .hydra/ records) and the Hydra task function that runs each job. Created where the command starts
and passed down; nothing of it outlives the command."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

from ddpexp.exceptions import CommandError, Interrupted, RankFailure


@dataclass
class Command:
    argv: list[str]  # as typed after `ddpexp`: the resume and plan lines repeat it
    failed: list[str] = field(default_factory=list)  # jobs of a multirun that failed, as "job_dir: error"
    deferred: list[tuple[Any, Any, float]] = field(default_factory=list)  # (job, waiter, start) to wait for at the end
    launched: set[str] = field(default_factory=set)  # job dirs whose ranks were started (parent.run adds them)
    earlier_hydra: dict[str, dict[str, bytes]] = field(default_factory=dict)  # job dir -> .hydra/ files before
    job_dirs: list[str] = field(default_factory=list)  # every job dir of the command, in the order Hydra ran them
    locks: list[str] = field(default_factory=list)  # job dirs' locks held until the command ends (queued jobs)
    held: list[Any] = field(default_factory=list)  # kept alive for the command (launcher=env: rank 0's store)
    pool: Any = None  # sweep.parallel: the jobs running at once in child processes (parent/parallel.py: Pool)
    planned: bool = False  # plan=true: jobs were shown, none started
    error: Exception | None = None  # what a single run raised (ddpexp.run), raised to the caller once Hydra is done
    keep_error: bool = False  # ddpexp.run: keep a single run's error for the caller instead of reporting it here

    def add_job_dir(self, job_dir: str) -> None:
        if job_dir not in self.job_dirs:
            self.job_dirs.append(job_dir)

    def task(self, dcfg: Any) -> Any:
        """Hydra's task function: a job of a multirun goes through `run_in_sweep`; a single run's error is
        reported in one line and an exit code (the command line), or kept for the caller (ddpexp.run: hydra-core
        1.3's JobReturn prints "Error executing job with overrides" first when the task raises)."""
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        from ddpexp.cli.errors import report
        from ddpexp.parent.launch import run

        if HydraConfig.get().mode == RunMode.MULTIRUN:
            return self.run_in_sweep(dcfg)
        if not self.keep_error:
            return report(lambda: run(dcfg, self), self)
        try:
            return run(dcfg, self)
        except Exception as e:
            self.error = e
            return None

    def run_in_sweep(self, dcfg: Any) -> Any:
        """One job of a multirun: a failure is recorded and counted, and the sweep goes on (Hydra's basic sweeper
        would stop it); an Optuna sweeper records a failed trial. A signal, or bad input that concerns the whole
        command (a CommandError), stops the whole sweep."""
        from hydra.core.hydra_config import HydraConfig

        from ddpexp.cli.errors import is_config_error, one_line, record_refusal
        from ddpexp.parent.launch import run
        from ddpexp.parent.objective import failed_trial

        try:
            return run(dcfg, self)
        except (Interrupted, CommandError):
            raise
        except Exception as e:
            if not isinstance(e, RankFailure) and not is_config_error(e):
                raise
            job_dir = str(HydraConfig.get().runtime.output_dir)
            line = str(e).splitlines()[0] if isinstance(e, RankFailure) else one_line(e)
            if not isinstance(e, RankFailure):  # refused before its ranks: its record says so, for `report`
                record_refusal(job_dir, line, self)
            self.failed.append(f"{job_dir}: {line}")
            print(f"ddpexp: error: job {HydraConfig.get().job.num} failed: {line}", file=sys.stderr)
            return failed_trial()

    def wait_deferred(self) -> None:
        """After a multirun's submissions: wait for the scheduler's jobs."""
        if self.deferred or self.pool is not None:
            from ddpexp.parent.wait import wait_deferred

            self.failed.extend(wait_deferred(self))

    def failed_jobs_message(self, headline: str = "") -> str:
        return f"{headline}{len(self.failed)} job(s) of the sweep failed:\n  " + "\n  ".join(self.failed)
