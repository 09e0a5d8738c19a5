"""An Optuna search-space extender for the tests (`hydra.sweeper.custom_search_space=sweep_faults.fail_trial_1`):
trial 1 of the study also gets `debug.fail_at_step=1`, so exactly one trial's ranks fail, chosen by Optuna's own
hook rather than by chance. It also writes the study's view of the earlier trials to `trial_states.json` in the
sweep dir, so a test can read what Optuna recorded (the in-memory study ends with the command)."""

from __future__ import annotations

import json
import os
from typing import Any


def fail_trial_1(cfg: Any, trial: Any) -> None:
    if trial.number == 1:
        trial.suggest_categorical("debug.fail_at_step", [1])
    states = {t.number: t.state.name for t in trial.study.get_trials(deepcopy=False) if t.number < trial.number}
    os.makedirs(str(cfg.hydra.sweep.dir), exist_ok=True)  # trial 0 is asked before the launcher makes it
    with open(os.path.join(str(cfg.hydra.sweep.dir), "trial_states.json"), "w") as f:
        json.dump(states, f)
