"""Every error type ddpexp raises, in one module that imports nothing: the parent, the ranks, the launchers and a
user's own code (`ddpexp.run(...)` in a notebook) catch them by these names."""

from __future__ import annotations

import signal


class ConfigError(ValueError):
    """Bad input (a configuration value, a command line, a user's component): one line, exit code 2."""


class CommandError(BaseException):
    """Bad input that concerns the whole command, not one job of it: exit 2, and a sweep stops at once. A
    BaseException, as Interrupted: Hydra's sweepers take an Exception from a job as that job's failure and go on
    (Optuna's too, to its "No trials are completed yet"). `ddpexp.run` raises it as a ConfigError."""


class CheckpointError(ConfigError):
    """A checkpoint that cannot be trusted: unreadable, truncated, or holding pickled code."""


class ReportError(ConfigError):
    """`ddpexp report` PATH that holds no run record; one line, exit 2."""


class RankFailure(RuntimeError):
    """A rank failed (exit code 1); the message carries its traceback's tail. `died`: its process ended without
    raising (a signal: the OOM killer's SIGKILL, a segfault), so it is the root cause over its peers' errors, which
    are echoes of its going (gloo's "Connection reset by peer")."""

    def __init__(self, rank: int | str, detail: str, died: bool = False):
        self.rank, self.detail, self.died = rank, detail.strip(), died
        last = self.detail.splitlines()[-1] if self.detail else "no traceback"
        more = f"\n{self.detail}" if "\n" in self.detail else ""  # a traceback; a one-line reason is said once
        super().__init__(f"rank {rank} failed: {last}{more}")

    @classmethod
    def by_signal(cls, rank: int | str, signum: int) -> RankFailure:
        """The rank's process was killed by signal `signum` (it raised nothing): `died`."""
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = f"signal {signum}"
        return cls(rank, f"its process died ({name})", died=True)


class RunFailed(RuntimeError):
    """`ddpexp.run`: a job failed (a rank raised or died), or jobs of a sweep did; where the command exits 1.
    `summaries`: the run record of each job (summary.json; None for a job that left none)."""

    def __init__(self, message: str, summaries: list | None = None):
        super().__init__(message)
        self.summaries = summaries or []


class Interrupted(BaseException):
    """The job stopped on a signal after its ranks wrote a checkpoint; exit code 130, and how to resume.

    A BaseException, like KeyboardInterrupt: Hydra records an Exception as a failed job and starts the next one,
    while a signal must stop the whole sweep."""


class Stopped(Exception):
    """Inside a rank: a stop signal, agreed on by every rank at a step boundary, after the checkpoint was written."""

    def __init__(self, signal: str, requeue: bool, step: int, path: str):
        super().__init__(f"{signal} at step {step}")
        self.signal, self.requeue, self.step, self.path = signal, requeue, step, path


class NonFinite(Exception):
    """Inside a rank: the training loss or a metric went NaN or infinite; every rank stops at the same step
    (exit code 1, status failed), and no checkpoint is written of that state."""
