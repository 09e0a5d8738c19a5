"""The rank-0 lines a person reads while a run trains: where it is, its pace and its ETA, from the first step on
(an epoch shorter than log_every_n_steps showed nothing until then); and on_nonfinite=warn naming train/loss at the
step it went non-finite, once, before the val/loss it spoils."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from ddpexp.rank.meter import NEVER, Meter, line_due, progress


def test_a_first_line_comes_at_the_first_step_of_each_attempt_then_every_interval() -> None:
    # 3 epochs of 4 steps, log_every_n_steps=10: a line at step 1, then 10 and the last step.
    assert {s: line_due(s, 0, 10, 12) for s in range(1, 13) if line_due(s, 0, 10, 12)} == {
        1: "started",
        10: "log",
        12: "log",
    }
    # Resumed at step 5: its first step says it started again.
    assert [s for s in range(6, 13) if line_due(s, 5, 10, 12) == "started"] == [6]
    assert line_due(1, 0, 1, 12) == "log"  # logged at the first step anyway: one line, with the pace


def test_the_progress_says_where_the_run_is_its_pace_and_when_it_ends() -> None:
    assert progress(10, 46, 10, 4.0) == "22% of 46 steps, 2.5 steps/s, ETA 0:00:14"  # 36 steps at 2.5/s
    assert progress(1, 10_000, 1, 0.5) == "0% of 10000 steps, 2 steps/s, ETA 1:23:20"
    assert progress(46, 46, 6, 2.0) == "100% of 46 steps, 3 steps/s, ETA 0:00:00"
    assert progress(7, NEVER, 7, 2.0) == "3.5 steps/s"  # an IterableDataset: no end known, no ETA


@pytest.fixture
def one_rank() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_lines_name_the_pace_and_warn_names_train_loss_at_its_step_once(
    one_rank: None, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """train/loss NaN from step 2 under on_nonfinite=warn: named at the first log interval, at step 2 (before,
    only `val/loss went non-finite at step 4` was said), never again; then val/loss, once."""
    cfg = SimpleNamespace(on_nonfinite="warn", grad_accum=1, batch_size=8)
    job = SimpleNamespace(checkpoint_dir=str(tmp_path))
    tracker = SimpleNamespace(rows=[], log=lambda metrics, step, epoch: tracker.rows.append((step, metrics)))
    optimizer = SimpleNamespace(param_groups=[{"lr": 0.1}])
    meter = Meter(torch.device("cpu"), 0, None, 8, 0)
    caplog.set_level(logging.INFO, logger="ddpexp")
    for step in range(1, 9):
        meter.add(torch.tensor(float("nan") if step >= 2 else 1.0), None, step)
        line = line_due(step, 0, 3, 8)
        if line == "log":
            meter.log(cfg, job, tracker, optimizer, step, 0)
        elif line == "started":
            meter.started(step, 0)
    nan = float("nan")
    assert meter.check_metrics(cfg, job, {"val/loss": nan, "val/acc": 0.1}, 8) is False
    assert meter.check_metrics(cfg, job, {"val/loss": nan, "val/acc": 0.1}, 9) is False
    lines = [r.getMessage() for r in caplog.records]
    expected = [
        r"epoch 0 step 1: started \| 12% of 8 steps, \S+ steps/s, ETA \d+:\d\d:\d\d",
        r"epoch 0 step 3: train/loss nan lr 0\.1 samples_per_s \S+ \| 38% of 8 steps, \S+ steps/s, ETA \d+:\d\d:\d\d",
        r"train/loss went non-finite \(nan\) at step 2; going on \(on_nonfinite=warn\)",
        r"epoch 0 step 6: train/loss nan lr 0\.1 samples_per_s \S+ \| 75% of 8 steps, \S+ steps/s, ETA \d+:\d\d:\d\d",
        r"epoch 0 step 8: train/loss nan lr 0\.1 samples_per_s \S+ \| 100% of 8 steps, \S+ steps/s, ETA 0:00:00",
        r"val/loss went non-finite \(nan\) at step 8; going on \(on_nonfinite=warn\)",
    ]
    assert len(lines) == len(expected) and all(re.fullmatch(e, line) for e, line in zip(expected, lines)), lines
    assert [step for step, _ in tracker.rows] == [3, 6, 8]  # the started line is no row of the record
