"""Sizes that train, but not as meant, say so: a train set that DistributedSampler must pad with repeats for a
large share of every epoch, and a batch larger than each rank's shard (one short step per epoch)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from conftest import run_ddpexp
from ddpexp.parts.loaders import warn_about_sizes


def test_size_warnings_name_the_numbers(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="ddpexp"):
        warn_about_sizes(1438, 2, 64)  # the digits: nothing to say
        assert caplog.messages == []
        warn_about_sizes(1, 2, 64)
    assert caplog.messages == [
        "warning: 1 train samples on 2 ranks: DistributedSampler pads the shards with 1 repeated samples, 50% of every epoch",
        "warning: batch_size=64 is more than each rank's 1 train samples: one step per epoch, of 1 samples a rank",
    ]  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_one_sample_train_set_on_two_ranks_warns_once_each(tmp_path: Path) -> None:
    proc = run_ddpexp("gpus=2", "data=fake", "data.train_size=1", "data.val_size=3", "max_steps=2",
                      "wandb.mode=disabled", "hydra.run.dir=job", cwd=tmp_path)  # fmt: skip
    warnings = [line.split("] ", 1)[1] for line in proc.stdout.splitlines() if "] warning: " in line]
    assert warnings == [
        "warning: 1 train samples on 2 ranks: DistributedSampler pads the shards with 1 repeated samples, 50% of every epoch",
        "warning: batch_size=64 is more than each rank's 1 train samples: one step per epoch, of 1 samples a rank",
    ]  # fmt: skip
