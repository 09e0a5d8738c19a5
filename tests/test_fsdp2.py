"""strategy=fsdp2 on real ranks: the same loop, a sharded model, sharded checkpoints (DCP).

The runs here are the faults' runs (conftest's COMMON: 2 ranks, the mlp with dropout, a checkpoint every 5 steps),
compared with the ddp reference run of the same seed, and with one uninterrupted fsdp2 run (`sharded`)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
from pathlib import Path

import pytest
import torch

from conftest import COMMON, load_weights, read_metrics, read_summary, run_ddpexp, start, wait_for_step
from ddpexp import load_model
from ddpexp.exceptions import ConfigError
from ddpexp.parts.gpt import GPT, Block
from ddpexp.parts.models import resnet
from ddpexp.rank.fsdp2 import find_units
from ddpexp.strategies import Fsdp2StrategyConfig, typed

FSDP2 = ["strategy=fsdp2", *COMMON]


def weights_of(job: Path) -> dict[str, torch.Tensor]:
    """The whole model of a sharded run's last checkpoint, put together from its shards (as load_model does)."""
    return load_model(str(job), "last").state_dict()


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("fsdp2")
    run_ddpexp("launcher=spawn", *FSDP2, "hydra.run.dir=job", cwd=root, timeout=180)
    return root / "job"


def test_units_are_the_repeated_blocks_or_the_classes_named() -> None:
    with torch.device("meta"):
        gpt = GPT(vocab_size=50, block_size=8, n_layer=3, n_head=2, n_embd=16, dropout=0.0, bias=True)
    auto = find_units(gpt, "auto")
    assert [name for name, _ in auto] == ["blocks.0", "blocks.1", "blocks.2"]
    assert all(isinstance(m, Block) for _, m in auto)
    assert [name for name, _ in find_units(gpt, ["Block", "LayerNorm"])][:4] == [
        "blocks.0",
        "blocks.1",
        "blocks.2",
        "ln_f",
    ]
    with pytest.raises(ConfigError, match=r"strategy.units: the model has no Bottleneck module \(it has .*Block"):
        find_units(gpt, ["Bottleneck"])
    with torch.device("meta"):
        net = resnet(arch="resnet101", num_classes=10, in_channels=1, image_size=28)
    blocks = find_units(net, "auto")  # each residual block of the four stages
    assert len(blocks) == 33 and blocks[0][0] == "layer1.0" and {type(m).__name__ for _, m in blocks} == {"Bottleneck"}


def test_a_config_from_before_the_group_is_ddp_and_bad_keys_are_one_line() -> None:
    assert typed(None).name == "ddp"  # a run's config.yaml from before `strategy` existed
    assert typed({"name": "fsdp2", "units": ["Block"]}) == Fsdp2StrategyConfig(units=["Block"])
    with pytest.raises(ConfigError, match=r"strategy.unit: no such key of strategy=fsdp2"):
        typed({"name": "fsdp2", "unit": "auto"})
    with pytest.raises(ConfigError, match=r"strategy.units=\[\]: must be auto or a list"):
        Fsdp2StrategyConfig(units=[])


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["strategy=fsdp2", "compile=true"], "strategy=fsdp2 does not support compile=true (yet)"),
        (["strategy=fsdp2", "ddp.sync_batchnorm=true"], "strategy=fsdp2 does not support ddp.sync_batchnorm=true"),
        (["strategy=fsdp2", "precision=fp16"], "strategy=fsdp2 does not support precision=fp16"),
        (["strategy=fsdp2", "strategy.cpu_offload=true", "device=cpu"], "strategy.cpu_offload=true: the parameters"),
        (["strategy=fsdp2", "strategy.reshard=false"], "strategy.reshard"),
        (["strategy=fsdp3"], "Available options in 'strategy': ddp, fsdp2"),
    ],
)
def test_what_fsdp2_cannot_do_is_refused_in_one_line_before_any_rank(
    tmp_path: Path, args: list[str], line: str
) -> None:
    proc = run_ddpexp(*args, "wandb.mode=disabled", "hydra.run.dir=job", cwd=tmp_path, check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and line in proc.stderr, proc.stderr
    assert not (tmp_path / "job" / "logs").exists()  # no rank started


@pytest.mark.slow
def test_a_sharded_run_trains_the_ddp_model_and_its_checkpoint_is_every_ranks_shards(
    tmp_path: Path, sharded: Path, reference: Path
) -> None:
    summary = read_summary(sharded)
    assert summary["status"] == "completed" and summary["world_size"] == 2 and summary["steps"] == 24
    assert summary["strategy"]["name"] == "fsdp2" and summary["strategy"]["units"]  # the mlp's Linear layers
    assert len(summary["peak_rss_mb"]) == 2 and min(summary["peak_rss_mb"]) > 0
    # The same seed, data and steps as the ddp reference: the same model up to float order.
    assert max_diff(weights_of(sharded), load_weights(reference)) <= 2e-4
    assert [m["step"] for m in read_metrics(sharded)] == [m["step"] for m in read_metrics(reference)]

    # Its checkpoints: folders of each rank's shards (DCP) and rank 0's plain state, no file of the whole model.
    ckpts = sharded / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["best.pt", "last.pt", "latest", "step-00000020.pt",
                                                       "step-00000024.pt"]  # fmt: skip
    assert os.readlink(ckpts / "last.pt") == "step-00000024.pt" and (ckpts / "latest").read_text() == "step-00000024.pt"
    files = sorted(p.name for p in (ckpts / "step-00000024.pt").iterdir())
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp", "state.pt"]
    state = torch.load(ckpts / "step-00000024.pt" / "state.pt", weights_only=True)
    assert "model" not in state and "optimizer" not in state and state["sharded"] and state["world_size"] == 2

    # load_model: the plain, whole model on the CPU; `ddpexp eval` at 1 rank: the record's final metrics.
    model = load_model(str(sharded), "last")
    assert all(type(p) is torch.nn.Parameter and p.device.type == "cpu" for p in model.parameters())
    proc = run_ddpexp("eval", str(sharded), "--checkpoint", "last", "gpus=1", cwd=tmp_path)
    record = json.loads(Path(re.search(r"-> (\S+\.json)", proc.stdout).group(1)).read_text())  # type: ignore[union-attr]
    assert record["scored"] == 359 and record["world_size"] == 1
    for key in ("val/loss", "val/acc"):
        assert record["metrics"][key] == pytest.approx(summary["final"][key], rel=1e-6)  # 1 rank: other batches


@pytest.mark.slow
def test_a_rank_killed_midway_through_a_sharded_save_restarts_bit_equal(tmp_path: Path, sharded: Path) -> None:
    """torchrun restarts the job after rank 0 is SIGKILLed once step 15's shards are written, before the folder is
    renamed: the restart resumes from step 10, removes the partial folder, and ends bit-equal to `sharded`."""
    job = tmp_path / "job"
    proc = run_ddpexp(
        "launcher=torchrun", "launcher.max_restarts=1", *FSDP2, "debug.kill_in_save_at_step=15",
        f"hydra.run.dir={job}", cwd=tmp_path, timeout=240,
    )  # fmt: skip
    summary = read_summary(job)
    assert summary["status"] == "completed" and summary["restarts"] == 1
    assert summary["resumed_from"]["step"] == 10
    removed = re.findall(r"removed 1 partial file\(s\) of writes cut short: checkpoints/step-00000015\.pt\.tmp\.\d+",
                         proc.stdout)  # fmt: skip
    assert len(removed) == 1, proc.stdout
    assert max_diff(weights_of(job), weights_of(sharded)) == 0.0
    assert read_summary(job)["final"] == read_summary(sharded)["final"]


@pytest.mark.slow
def test_ctrl_c_then_resume_is_bit_equal_and_a_resume_at_one_rank_reshards(tmp_path: Path, sharded: Path) -> None:
    job = tmp_path / "job"
    proc = start(["launcher=spawn", *FSDP2, "debug.step_delay_s=0.25", f"hydra.run.dir={job}"], tmp_path)
    try:
        wait_for_step(job, 4, proc, timeout=120)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    stopped = read_summary(job)
    assert stopped["status"] == "interrupted" and 4 <= stopped["steps"] < 24
    shutil.copytree(job, tmp_path / "one")  # the same interrupted run, to resume at another world size

    run_ddpexp("launcher=spawn", *FSDP2, f"hydra.run.dir={job}", cwd=tmp_path, timeout=180)
    assert read_summary(job)["resumed_from"]["step"] == stopped["steps"]
    assert max_diff(weights_of(job), weights_of(sharded)) == 0.0

    one = [a for a in FSDP2 if a != "gpus=2"]
    proc = run_ddpexp("launcher=spawn", *one, "gpus=1", "resume_allow_config_change=true",
                      f"hydra.run.dir={tmp_path / 'one'}", cwd=tmp_path, timeout=180)  # fmt: skip
    summary = read_summary(tmp_path / "one")
    assert summary["status"] == "completed" and summary["world_size"] == 1
    assert summary["resumed_from"]["step"] == stopped["steps"] and summary["steps"] > stopped["steps"]
    assert "resuming from" in proc.stdout and all(
        torch.isfinite(v).all() for v in weights_of(tmp_path / "one").values()
    )
