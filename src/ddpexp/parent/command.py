"""One ddpexp command, a command line or one `ddpexp.run(...)` call, as one object for its lifetime: what its jobs
leave for the command's end (the jobs launched, submitted jobs still to wait for, the failed ones, the job dirs and
their earlier .hydra/ records, the warnings already said). Created where the command starts (cli/) and passed
down; nothing of it outlives the command. Hydra's task function around it is cli/command.py's."""

from __future__ import annotations

import sys
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
    locks: list[str] = field(default_factory=list)  # job dirs' locks held until the command ends (queued jobs)
    held: list[Any] = field(default_factory=list)  # kept alive for the command (launcher=env: rank 0's store)
    pool: Any = None  # sweep.parallel: the jobs running at once in child processes (parent/parallel.py: Pool)
    planned: bool = False  # plan=true: jobs were shown, none started
    error: Exception | None = None  # what a single run raised (ddpexp.run), raised to the caller once Hydra is done
    keep_error: bool = False  # ddpexp.run: keep a single run's error for the caller instead of reporting it here
    warned: list[str] = field(default_factory=list)  # warning lines said: a sweep says each once, not per job

    def add_job_dir(self, job_dir: str) -> None:
        if job_dir not in self.job_dirs:
            self.job_dirs.append(job_dir)

    def warn(self, line: str | None) -> None:
        """`ddpexp: warning: LINE` on stderr, once per command."""
        if line is not None and line not in self.warned:
            self.warned.append(line)
            print(f"ddpexp: warning: {line}", file=sys.stderr, flush=True)

    def failed_jobs_message(self, headline: str = "") -> str:
        return f"{headline}{len(self.failed)} job(s) of the sweep failed:\n  " + "\n  ".join(self.failed)
