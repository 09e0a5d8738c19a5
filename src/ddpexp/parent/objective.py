"""What a job of a sweep hands back to Hydra's sweeper: its final `objective` metric, or, for a failed job, a value
that Optuna's sweeper records as a failed trial while the study goes on."""

from __future__ import annotations

from typing import Any

BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"


def failed_trial() -> None:
    """The return value of a failed job. Not NaN: hydra-optuna-sweeper 1.3.0 tells optuna 2.10 a NaN as COMPLETE,
    optuna refuses it, and the sweeper's retry as FAIL passes the NaN again, which raises and ends the whole study
    (hydra#2237, fixed after 1.3.0). None fails the sweeper's float() first, so the trial is told FAIL cleanly."""
    return None


def needs_each_value(hydra_cfg: Any) -> bool:
    """Whether the sweeper reads each job's objective before it picks the next parameters (Optuna's does, the
    basic sweeper does not): a scheduler's job must then be waited for where it was submitted."""
    return str(hydra_cfg.sweeper.get("_target_", BASIC_SWEEPER)) != BASIC_SWEEPER
