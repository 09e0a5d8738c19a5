"""What a job of a sweep hands back to Hydra's sweeper: its final `objective` metric, or, for a failed job, a value
that Optuna's sweeper records as a failed trial while the study goes on; and the sweeper's `direction` checked
against the way the run says its objective is better."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ddpexp.exceptions import CommandError, ConfigError

BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"
WORDS = {"min": "minimize", "max": "maximize"}


def failed_trial() -> None:
    """The return value of a failed job. Not NaN: hydra-optuna-sweeper 1.3.0 tells optuna 2.10 a NaN as COMPLETE,
    optuna refuses it, and the sweeper's retry as FAIL passes the NaN again, which raises and ends the whole study
    (hydra#2237, fixed after 1.3.0). None fails the sweeper's float() first, so the trial is told FAIL cleanly."""
    return None


def needs_each_value(hydra_cfg: Any) -> bool:
    """Whether the sweeper reads each job's objective before it picks the next parameters (Optuna's does, the
    basic sweeper does not): a scheduler's job must then be waited for where it was submitted."""
    return str(hydra_cfg.sweeper.get("_target_", BASIC_SWEEPER)) != BASIC_SWEEPER


def refuse_for_search(config: Any) -> None:
    """What a search whose trials follow from the results before them cannot do: a plan, jobs at once."""
    if not needs_each_value(config.hydra):
        return
    if config.get("plan"):
        raise CommandError(
            "plan=true with a search that picks each trial from the results of the ones before (hparams_search):"
            " a plan runs none, so it has no trials to show; plan one job with the parameters set instead"
        )
    if (config.get("sweep") or {}).get("parallel", 1) != 1:
        raise CommandError(
            "sweep.parallel: a search that picks each trial from the results of the ones before (hparams_search)"
            " runs one trial at a time; leave sweep.parallel=1"
        )


def check_sweeper_direction(config: Any) -> None:
    """ConfigError when the sweeper optimizes `objective` the other way than the run's `objective_mode` (as given,
    or auto: the task's declaration): an Optuna study maximizing val/mse would search for the worst parameters.
    `config` is the composed DictConfig, before any trial; a sweeper without a `direction` is not checked, and
    neither is a task that declares nothing for the objective: the sweeper's direction is then the declaration."""
    direction = _direction(config.hydra.sweeper.get("direction"))
    mode = config.get("objective_mode", "auto")
    if direction is None or mode not in ("auto", *WORDS):  # a bad mode: the job's own check names it
        return
    objective, why = str(config.get("objective", "val/acc")), f"objective_mode={mode}"
    if mode == "auto":
        from ddpexp.parent.check import build_task
        from ddpexp.parts.tasks import objective_mode

        task, name = build_task(config.task)
        mode = objective_mode(task, objective, mode)
        why = f"{name} declares it {mode} (objective_mode=auto)"
    if mode is not None and WORDS[mode] != direction:
        raise ConfigError(
            f"hydra.sweeper.direction={direction} contradicts objective={objective}: {why}; set "
            f"hydra.sweeper.direction={WORDS[mode]} (or objective_mode={'max' if mode == 'min' else 'min'})"
        )


def stated_mode(hydra_cfg: Any) -> str | None:
    """min or max as the sweeper's `direction` states it (None without one): the user's own statement of which
    way the objective is better, taken as the declaration where the task makes none."""
    direction = _direction(hydra_cfg.sweeper.get("direction")) if needs_each_value(hydra_cfg) else None
    return next((mode for mode, word in WORDS.items() if word == direction), None)


def _direction(value: Any) -> str | None:
    """minimize or maximize from the sweeper's config: a string, Optuna sweeper's Direction enum (its default when
    a preset sets none), or a list of one (a list of several is a multi-objective study: not ddpexp's)."""
    if isinstance(value, Sequence) and not isinstance(value, str):  # OmegaConf's ListConfig too
        value = value[0] if len(value) == 1 else None
    value = getattr(value, "name", value)
    return value if value in WORDS.values() else None
