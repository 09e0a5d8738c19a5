"""The parent's dry build (ddpexp.parent.check.components): a model, data, optimizer or scheduler value the ranks could not
build or run fails before any rank starts, as one line naming the key; good configs pass in well under a second."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import make_config, run_ddpexp
from ddpexp.exceptions import ConfigError
from ddpexp.parent.check import components
from ddpexp.parts.data import Splits

# (overrides, what the one line starts with). Before the dry build, each was a rank traceback (exit 1) or a run
# that "completed" without training.
BAD = [
    (["optimizer.lr=-1"], "optimizer.lr=-1: must be a number >= 0"),
    (["optimizer.lr=abc"], "optimizer.lr='abc': must be a number >= 0"),
    (["optimizer=sgd", "optimizer.momentum=-1"], "optimizer=torch.optim.SGD(lr=0.1, momentum=-1,"),
    (["optimizer=adam", "+optimizer.bogus=1"], "optimizer.bogus=1: torch.optim.Adam takes no such argument"),
    (["scheduler=step", "scheduler.step_size=0"], "scheduler.step_size=0: must be >= 1"),
    (["scheduler=step", "scheduler.gamma=-5"], "scheduler.gamma=-5: must be > 0"),
    (["scheduler=cosine", "scheduler.warmup_steps=-1"], "scheduler.warmup_steps=-1: must be an int >= 0"),
    (["model=resnet18", "model.stem=bogus"], "model.stem='bogus': must be one of auto, small, imagenet"),
    (["model=resnet18", "model.arch=bogus"], "model=ddpexp.models.resnet(arch='bogus', stem='auto'): AttributeError"),
    (["model=mlp", "model.dropout=2"], "model.dropout=2: must be >= 0 and < 1"),
    (["model=cnn", "model.channels=[1]"], "model.channels=[1]: must be two ints >= 1"),
    (["+model.width=3"], "model.width=3: ddpexp.models.cnn takes no such argument"),
    (["model._target_=no.such.fn"], "model._target_='no.such.fn': no such callable"),
    (["data._target_=no.such.fn"], "data._target_='no.such.fn': no such callable"),
    (["data=fake", "data.crop_padding=-1"], "data.crop_padding=-1: must be an int >= 0"),
    (["data=fake", "data.image_size=1"], "model=ddpexp.models.cnn(channels=[32, 64], hidden=128) on 1x1x1 images"),
    (["data=fake", "data.train_size=0"], "data.train_size=0: must be an int >= 1"),
    (["data.val_fraction=0"], "data.val_fraction=0: must leave >= 1 of the 1797 digits"),
    (["data.val_fraction=1.5"], "data.val_fraction=1.5: must leave >= 1 of the 1797 digits"),
]


@pytest.mark.parametrize(("args", "message"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_component_is_a_config_error(args: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as e:
        components(make_config(*args))
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


# One per part through the command line (a few seconds each): each used to fail inside a rank, or to train
# nothing and exit 0.
CLI_ARGS = {"optimizer.lr=abc", "scheduler=step scheduler.step_size=0", "model=resnet18 model.stem=bogus",
            "model._target_=no.such.fn", "data=fake data.image_size=1", "data=fake data.train_size=0"}  # fmt: skip
CLI = [(args, message) for args, message in BAD if " ".join(args) in CLI_ARGS]


@pytest.mark.parametrize(("args", "message"), CLI, ids=[" ".join(a) for a, _ in CLI])
def test_bad_component_stops_the_command_in_the_parent(tmp_path: Path, args: list[str], message: str) -> None:
    proc = run_ddpexp("gpus=1", "max_steps=2", *args, "hydra.run.dir=run", cwd=tmp_path, check=False)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"ddpexp: error: {message}"), proc.stderr
    assert not (tmp_path / "run" / "logs").exists()  # no rank started


def user_splits(size: int = 4) -> Splits:
    """A user's data factory: its shape is known only once built, so the dry build checks the rest."""
    return Splits(None, None, num_classes=3, in_channels=1, image_size=size)


GOOD = [
    ["model=resnet18", "data=fake", "data.image_size=16", "data.in_channels=3", "scheduler=cosine"],
    ["scheduler=cosine", "scheduler.warmup_steps=5", "optimizer=sgd"],
    ["model=mlp", "model.dropout=0.5", "data=fake", "data.image_size=1", "scheduler=step", "scheduler.step_size=1"],
    ["model=resnet101", "data=mnist", "model.stem=imagenet"],  # the tutorial's net on MNIST's shape: nothing read
    ["data._target_=test_components.user_splits", "~data.val_fraction", "~data.seed", "+data.size=4"],
]


@pytest.mark.parametrize("args", GOOD, ids=[" ".join(a) for a in GOOD])
def test_good_components_pass(args: list[str]) -> None:
    components(make_config(*args))  # raises ConfigError on any part it refuses
