"""Every experiment preset (conf/experiment/) composes and trains end to end at a tiny size: the preset's model,
optimizer and schedule, shrunk by command-line overrides, on 2 spawn ranks. MNIST is written as its IDX files;
CIFAR-10's files are md5-checked by torchvision, so its preset runs on FakeData of CIFAR's shape (3x32x32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from conftest import ROOT, ckpt_config, load_weights, read_summary, run_ddpexp
from test_e2e import write_mnist_idx

pytestmark = pytest.mark.slow

TINY = ["gpus=2", "max_steps=2", "batch_size=8", "wandb.mode=disabled"]
# preset -> (overrides that make it tiny, conv1's weight shape, what the preset must have set)
PRESETS = {
    "mnist_resnet101": (
        ["data.root=data"],
        (64, 1, 7, 7),
        {"model.arch": "resnet101", "optimizer._target_": "torch.optim.Adam"},
    ),
    "cifar10_resnet18": (
        ["data=fake", "data.in_channels=3", "data.image_size=32", "data.train_size=64", "data.val_size=32"],
        (64, 3, 3, 3),
        {"model.arch": "resnet18", "optimizer.nesterov": True, "scheduler.warmup_steps": 200, "data.crop_padding": 4},
    ),
}


def test_every_preset_has_a_tiny_run() -> None:
    from test_tasks import TASK_PRESETS  # the regression and language-model presets run there, on both launchers

    presets = sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml"))
    assert sorted([*PRESETS, *TASK_PRESETS]) == presets


@pytest.mark.timeout(180)
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_preset_trains(tmp_path: Path, preset: str) -> None:
    overrides, conv1, expected = PRESETS[preset]
    if preset.startswith("mnist"):
        write_mnist_idx(tmp_path / "data", n_train=64, n_test=32)
    job = tmp_path / "job"
    run_ddpexp(f"experiment={preset}", *TINY, *overrides, f"hydra.run.dir={job}", cwd=tmp_path, timeout=150)
    summary = read_summary(job)
    assert (summary["status"], summary["steps"], summary["world_size"]) == ("completed", 2, 2)
    assert 0.0 <= summary["final"]["val/acc"] <= 1.0 and summary["val_samples"] == 32
    config = yaml.safe_load(ckpt_config(job))
    for key, value in expected.items():
        group, name = key.split(".")
        assert config[group][name] == value, key
    assert config["batch_size"] == 8  # the command line wins over the preset's
    assert tuple(load_weights(job)["conv1.weight"].shape) == conv1
