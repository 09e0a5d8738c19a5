"""The parts a run is built from, behind `_target_`s: datasets and how batches are drawn, models, tasks (loss and
metrics), LR schedules. Public as ddpexp.data, ddpexp.models, ddpexp.tasks, ddpexp.optim; they import no tracker."""
