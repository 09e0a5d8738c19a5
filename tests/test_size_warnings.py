"""Sizes that train, but not as meant, say so: a global batch larger than the train set (one short step per
epoch); and such a run on more ranks than samples trains, each sample once, the empty rank in every collective."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from conftest import read_summary, run_ddpexp
from ddpexp.parts.loaders import warn_about_sizes


def test_size_warnings_name_the_numbers(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="ddpexp"):
        warn_about_sizes(1438, 2, 64)  # the digits: nothing to say
        assert caplog.messages == []
        warn_about_sizes(1, 2, 64)
    assert caplog.messages == [
        "warning: batch_size=64 on 2 ranks is more than the 1 train samples: one step per epoch, of 1 samples",
    ]  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_one_sample_train_set_on_two_ranks_warns_once_each(tmp_path: Path) -> None:
    proc = run_ddpexp("gpus=2", "data=fake", "data.train_size=1", "data.val_size=3", "max_steps=2",
                      "wandb.mode=disabled", "hydra.run.dir=job", cwd=tmp_path)  # fmt: skip
    warnings = [line.split("] ", 1)[1] for line in proc.stdout.splitlines() if "] warning: " in line]
    assert warnings == [
        "warning: batch_size=64 on 2 ranks is more than the 1 train samples: one step per epoch, of 1 samples",
    ]  # fmt: skip
    summary = read_summary(tmp_path / "job")  # rank 1 had no sample: it took part with a weight of 0
    assert summary["status"] == "completed" and summary["steps"] == 2 and summary["train_samples_per_epoch"] == [1, 1]
