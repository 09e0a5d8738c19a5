"""The best checkpoint and early stopping: the rules as functions, then one real 2-rank run whose val/loss bottoms
out mid-run and stops early, and the same run killed mid-patience and restarted by torchrun, resumed from a
checkpoint taken at an epoch's last step."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from conftest import assert_same_run, load_weights, make_config, read_metrics, read_summary, run_ddpexp
from ddpexp.config import EarlyStopConfig
from ddpexp.exceptions import ConfigError
from ddpexp.rank import checkpoint
from ddpexp.rank.best import Best


def evaluations(mode: str, values: list[float | None], min_delta: float = 0.0) -> list[tuple[bool, int]]:
    best = Best(mode)
    return [(best.update(v, step, step, min_delta), best.since) for step, v in enumerate(values)]


def test_best_is_any_improvement_and_the_patience_counts_from_improvements_larger_than_min_delta() -> None:
    # (best.pt written?, evaluations without an improvement > min_delta)
    assert evaluations("min", [3.0, 2.0, 2.5, 1.99, 1.94, 1.0], min_delta=0.05) == [
        (True, 0), (True, 0), (False, 1), (True, 2), (True, 0), (True, 0),  # 2.0 -> 1.94: small gains add up
    ]  # fmt: skip
    assert evaluations("max", [0.5, 0.5, 0.7, 0.6, 0.71]) == [(True, 0), (False, 1), (True, 0), (False, 1), (True, 0)]
    # Missing or not finite is never the best; it counts as an evaluation without an improvement.
    assert evaluations("min", [None, 1.0, math.nan, math.inf, 0.5]) == [
        (False, 1), (True, 0), (False, 1), (False, 2), (True, 0),
    ]  # fmt: skip
    best = Best("min")
    for step, value in enumerate([1.0, 2.0, 3.0]):
        best.update(value, step, 0, 0.0)
    assert (best.value, best.step, best.since) == (1.0, 0, 2)
    assert best.should_stop(EarlyStopConfig(patience=2)) and not best.should_stop(EarlyStopConfig(patience=3))
    assert not best.should_stop(EarlyStopConfig())  # patience null: off


def test_a_restored_best_counts_on_exactly_as_the_uninterrupted_one() -> None:
    values = [1.0, 0.8, 0.9, 0.85, 0.79, 0.95, 0.96]
    whole = evaluations("min", values, min_delta=0.02)
    for cut in range(len(values)):
        best = Best("min")
        for step, v in enumerate(values[:cut]):
            best.update(v, step, step, 0.02)
        state = torch.load(_saved(best.state()), weights_only=True)  # through a checkpoint's format
        again = Best.restore("min", state)
        assert [(again.update(v, s, s, 0.02), again.since) for s, v in enumerate(values) if s >= cut] == whole[cut:]
    assert Best.restore("max", None) == Best("max")  # a checkpoint written before ddpexp kept one


def _saved(state: dict) -> Path:
    import io

    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return buffer  # type: ignore[return-value]


def test_best_pt_is_atomic_loadable_and_never_rotated(tmp_path: Path) -> None:
    def state(step: int) -> dict:
        return {"model": {"w": torch.full((3,), float(step))}, "step": step, "config": "seed: 0\n"}

    path = checkpoint.save_best(state(2), str(tmp_path))
    for step in range(3, 7):
        checkpoint.save(state(step), str(tmp_path), step, keep_last=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.pt", "last.pt", "latest", "step-00000006.pt"]
    assert checkpoint.load(path)["step"] == 2  # weights_only
    assert checkpoint.find_latest(str(tmp_path)).endswith("step-00000006.pt")  # resume never picks best.pt
    checkpoint.drop_best(str(tmp_path))
    checkpoint.drop_best(str(tmp_path))  # a fresh start's, with or without one
    assert not (tmp_path / "best.pt").exists() and (tmp_path / "last.pt").exists()


def test_early_stop_config_defaults_off_and_bad_values_name_the_key() -> None:
    cfg = make_config()
    assert (cfg.early_stop.patience, cfg.early_stop.min_delta) == (None, 0.0)
    assert make_config("early_stop.patience=3", "early_stop.min_delta=0.01").early_stop == EarlyStopConfig(3, 0.01)
    with pytest.raises(ConfigError, match=r"^early_stop.patience=0: must be >= 1 \(evaluations\) or null \(off\)$"):
        make_config("early_stop.patience=0")
    with pytest.raises(ConfigError, match=r"^early_stop.min_delta=-0.1: must be a finite number >= 0$"):
        make_config("early_stop.min_delta=-0.1")
    with pytest.raises(ConfigError, match=r"^early_stop.min_delta=nan: must be a finite number >= 0$"):
        make_config("early_stop.min_delta=nan")


# 2 ranks x 12 steps an epoch on the real digits; the mlp at this lr reaches its lowest val/loss at step 48 (epoch 3)
# and does worse at 60 and 72, so patience 2 stops it at 72 of 96. A checkpoint every 12 steps is one at every
# epoch's last step.
PEAKS = ["gpus=2", "model=mlp", "optimizer.lr=0.03", "objective=val/loss", "epochs=8", "early_stop.patience=2",
         "log_every_n_steps=4", "checkpoint_every_n_steps=12", "keep_last_checkpoints=2", "wandb.mode=disabled"]  # fmt: skip


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("uninterrupted")
    run_ddpexp("launcher=spawn", *PEAKS, "hydra.run.dir=job", cwd=root, timeout=150)
    return root / "job"


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_best_pt_keeps_the_lowest_val_loss_and_every_rank_stops_early_at_the_same_step(uninterrupted: Path) -> None:
    job = uninterrupted
    summary, metrics = read_summary(job), read_metrics(job)
    val = [(m["step"], m["val/loss"]) for m in metrics if "val/loss" in m]
    lowest = min(val, key=lambda row: row[1])
    assert [s for s, _ in val] == [12, 24, 36, 48, 60, 72] and lowest[0] == 48  # the setup still peaks mid-run
    assert (summary["status"], summary["stopped_early"], summary["steps"], summary["epochs"]) == (
        "completed",
        True,
        72,
        6,
    )
    assert summary["early_stop"] == {"patience": 2, "min_delta": 0.0, "evaluations_without_improvement": 2,
                                     "stopped_at_step": 72}  # fmt: skip
    assert max(m["step"] for m in metrics) == 72  # nothing trained after the stop
    for rank in (0, 1):  # each rank decided for itself, from the same all-reduced metrics
        lines = [x for x in (job / "logs" / f"rank{rank}.log").read_text().splitlines() if "early stop" in x]
        assert len(lines) == 1 and "early stop at step 72: val/loss has not improved for 2 evaluations" in lines[0]

    # best.pt: that evaluation's checkpoint, kept while the step checkpoints rotate on.
    ckpts = job / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("*.pt")) == ["best.pt", "last.pt", "step-00000060.pt", "step-00000072.pt"]
    best = checkpoint.load(str(ckpts / "best.pt"))  # weights_only
    assert (best["step"], best["epoch"], best["best"]["value"]) == (48, 4, lowest[1])
    assert summary["best"] == {"step": 48, "epoch": 3, "value": lowest[1], "checkpoint": str(ckpts / "best.pt")}
    last = load_weights(job)
    assert any(not torch.equal(best["model"][k], last[k]) for k in last)
    assert rescore(best)["val/loss"] == pytest.approx(lowest[1], abs=1e-6)


def rescore(state: dict) -> dict[str, float]:
    """The val metrics of a checkpoint's weights: its model built from its config, scored in this process."""
    from contextlib import nullcontext

    import torch.distributed as dist
    import yaml
    from hydra.utils import instantiate

    from ddpexp.parts.optim import call_accepting
    from ddpexp.rank.evaluation import evaluate

    cfg = yaml.safe_load(state["config"])
    splits, task = instantiate(cfg["data"]), instantiate(cfg["task"], _convert_="all")
    model = call_accepting(instantiate(cfg["model"], _partial_=True), **splits.facts)
    model.load_state_dict(state["model"])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        metrics, _ = evaluate(task, model, splits.val, 64, torch.device("cpu"), nullcontext())
    finally:
        dist.destroy_process_group()
    return metrics


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_killed_mid_patience_and_resumed_from_an_epoch_s_last_step_it_stops_as_the_uninterrupted_run(
    tmp_path: Path, uninterrupted: Path
) -> None:
    job = tmp_path / "job"
    proc = run_ddpexp(
        "launcher=torchrun", "launcher.max_restarts=1", *PEAKS, "debug.kill_at_step=64", "debug.fail_rank=1",
        f"hydra.run.dir={job}", cwd=tmp_path, timeout=240,
    )  # fmt: skip
    summary = read_summary(job)
    assert summary["status"] == "completed" and summary["restarts"] == 1
    assert ", stopped early at step 72: " in proc.stdout
    # The checkpoint at epoch 4's last step, written after its evaluation: one evaluation into the patience.
    assert summary["resumed_from"]["step"] == 60
    val_steps = [m["step"] for m in read_metrics(job) if "val/loss" in m]
    assert val_steps == [12, 24, 36, 48, 60, 72]  # step 60's evaluation recorded once, and counted once
    assert (summary["stopped_early"], summary["steps"]) == (True, 72)
    reference = read_summary(uninterrupted)
    assert (summary["early_stop"], summary["epochs"]) == (reference["early_stop"], reference["epochs"])
    assert summary["best"] == {**reference["best"], "checkpoint": str(job / "checkpoints" / "best.pt")}
    assert_same_run(job, uninterrupted)  # bit-equal weights, the same rows
    ours, theirs = (torch.load(j / "checkpoints" / "best.pt", weights_only=True)["model"] for j in (job, uninterrupted))
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
