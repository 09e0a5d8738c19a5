"""The objective's best evaluation so far (its checkpoint is best.pt) and early stopping's patience: both decided
after each evaluation from the all-reduced metrics, so every rank decides the same, and both saved in every
checkpoint, so that a resumed run goes on counting where it stopped."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from ddpexp.config import Config, EarlyStopConfig
from ddpexp.exceptions import ConfigError
from ddpexp.rank import distributed


@dataclass
class Best:
    """`value` at `step`/`epoch` is the best evaluation yet (any improvement, however small: best.pt follows it).
    `reference` is the value the patience counts from: only an improvement larger than `min_delta` moves it, so
    that many small gains add up to one (as Keras and Lightning count), and `since` is the number of evaluations
    since it last moved."""

    mode: str | None  # min or max: the objective's resolved mode; None: unknown, so no evaluation is the best
    value: float | None = None
    step: int | None = None
    epoch: int | None = None
    checkpoint: str | None = None  # where best.pt was written
    reference: float | None = None
    since: int = 0

    def update(self, value: float | None, step: int, epoch: int, min_delta: float) -> bool:
        """Count one evaluation of the objective; True when it is the best yet (write best.pt). A value that is
        missing or not finite is no improvement."""
        if self.mode is None:  # no direction: nothing is better (early stopping was refused in the parent)
            return False
        if value is None or not math.isfinite(value):
            self.since += 1
            return False
        sign = 1.0 if self.mode == "min" else -1.0  # compare as a loss: lower is better
        if self.reference is None or sign * (self.reference - value) > min_delta:
            self.reference, self.since = value, 0
        else:
            self.since += 1
        improved = self.value is None or sign * (self.value - value) > 0
        if improved:
            self.value, self.step, self.epoch = value, step, epoch
        return improved

    def should_stop(self, cfg: EarlyStopConfig) -> bool:
        return cfg.patience is not None and self.since >= cfg.patience

    def state(self) -> dict[str, Any]:
        """For the checkpoint: plain types only."""
        return asdict(self)

    @classmethod
    def restore(cls, mode: str | None, state: dict[str, Any] | None) -> Best:
        """From a checkpoint's state (None: a checkpoint written before ddpexp kept one, or a fresh start)."""
        if not state:
            return cls(mode)
        return cls(**{**state, "mode": mode})

    def record(self) -> dict[str, Any] | None:
        """summary.json's `best`."""
        if self.value is None:
            return None
        return {"step": self.step, "epoch": self.epoch, "value": self.value, "checkpoint": self.checkpoint}

    def early_stop_record(self, cfg: EarlyStopConfig, stopped_at: int | None) -> dict[str, Any]:
        """summary.json's `early_stop`: the settings, the count where the run ended, the step it stopped at."""
        return {**asdict(cfg), "evaluations_without_improvement": self.since, "stopped_at_step": stopped_at}

    def check_agreement(self) -> None:
        """Every rank must have decided the same (the metrics were all-reduced, so they do): a rank that stopped
        alone would leave the others waiting in a collective until dist_timeout_s. Checked once per evaluation."""
        mine = (self.value, self.step, self.since)
        seen = distributed.all_gather(mine)
        if any(other != mine for other in seen):
            raise RuntimeError(f"ranks disagree on the best evaluation and the patience: {seen}")


def check_objective(cfg: Config, final: dict[str, float]) -> None:
    """`objective` must name a metric the run records; the parent checks it where the data's shape is known."""
    if cfg.objective not in final and cfg.objective != "train/loss":
        raise ConfigError(f"objective={cfg.objective}: the run logs no such metric; it logs {', '.join(sorted(final))}")
