"""`task=`: the loop runs the user's own loss and metrics. A user task from outside ddpexp drives an Optuna study
by its own metric; the regression and language-model tasks train on real offline data on spawn and torchrun
with identical replicas, 2 ranks x batch B equal to 1 rank x 2B, and a killed LM run resumes bit-equal; a task
that cannot work is refused in one line before any rank starts."""

from __future__ import annotations

import csv
import math
import os
from pathlib import Path

import pytest
import torch
import yaml

from conftest import (
    ROOT,
    assert_same_run,
    check_wandb_matches_record,
    load_weights,
    make_config,
    read_metrics,
    read_summary,
    run_ddpexp,
)
from ddpexp.exceptions import ConfigError
from ddpexp.parent.check import components

USER_TASK = ["~task.top_k", "~task.label_smoothing"]  # task=classification's keys, which a user's task does not take
TESTS_ON_PATH = {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "tests"), os.environ.get("PYTHONPATH")]))}


BAD = [
    (["task._target_=user_task.NoMetrics", *USER_TASK], "task=user_task.NoMetrics: has no metrics(model, batch) method"),
    (["task._target_=user_task.WrongSignature", *USER_TASK], "task=user_task.WrongSignature.loss(batch): must take (model, batch)"),
    (["task._target_=user_task.VectorLoss", *USER_TASK], "task=user_task.VectorLoss.loss: must return a scalar float tensor (the mean over the batch), got a tensor of shape (2,)"),
    (["task._target_=user_task.CollidingMetric", *USER_TASK], "task=user_task.CollidingMetric.metrics: metric name 'train/loss' collides"),
    (["task._target_=user_task.BrierTask", "task.top_k=[1]", "~task.label_smoothing"], "task.top_k=[1]: user_task.BrierTask takes no such argument"),
    (["task=classification", "task.top_k=[0]"], "task.top_k=[0]: must be a list of ints >= 1"),
    # A 1-output model on real-valued targets "completed" with loss 0.0000 under classification.
    (["data=diabetes", "model=mlp"], "task=classification: the targets are torch.float32 values, not integer class labels"),
    (["data=diabetes", "model=mlp", "task=regression", "objective=val/acc"], "objective=val/acc: task=ddpexp.tasks.Regression logs no such metric; it logs train/loss, val/mse, val/mae, val/r2"),
    (["data=stdlib_text", "model=gpt", "task=classification"], "task=classification: the model outputs shape (2, 64, 98); it needs (batch, classes)"),
    (["data=stdlib_text", "model=mlp", "task=language_model"], "model=mlp: the data gives neither in_features"),
    (["task._target_=user_task.BadDirections", *USER_TASK], "task=user_task.BadDirections.directions={'brier': 'minimize', 'acc': 'max'}: must map metric names as metrics() returns them (no val/) to 'min' or 'max'"),
    # No direction: only what cannot work without one is refused (a task written before `directions` still runs).
    (["task._target_=user_task.Undeclared", *USER_TASK, "objective=val/brier", "early_stop.patience=2"], "early_stop.patience=2 needs to know which way is better: objective_mode=auto: task=user_task.Undeclared declares no direction for objective=val/brier (it has no directions); set objective_mode=min or objective_mode=max, or add 'brier' to the task's directions"),
    # A task's real defect comes first, not its missing direction.
    (["task._target_=user_task.UndeclaredVectorLoss", *USER_TASK, "objective=val/brier"], "task=user_task.UndeclaredVectorLoss.loss: must return a scalar float tensor"),
]  # fmt: skip


@pytest.mark.parametrize(("args", "message"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_a_task_that_cannot_work_is_one_config_error(args: list[str], message: str, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.syspath_prepend(str(ROOT / "tests"))
    with pytest.raises(ConfigError) as e:
        components(make_config(*args))
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


def test_good_tasks_pass_the_dry_build(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.syspath_prepend(str(ROOT / "tests"))
    for args in (["experiment=diabetes_mlp"], ["experiment=stdlib_gpt"], ["task._target_=user_task.BrierTask",
                 *USER_TASK, "objective=val/brier"], ["task.top_k=[1,5]", "objective=val/top5"],
                 ["experiment=diabetes_mlp", "objective=val/r2"], ["experiment=stdlib_gpt", "objective=val/ppl"],
                 ["task._target_=user_task.BitsPerChar", *USER_TASK, "objective=val/bits_per_char"],
                 ["task._target_=user_task.Undeclared", *USER_TASK, "objective=val/brier", "objective_mode=min"]):  # fmt: skip
        assert components(make_config(*args)) is None


def test_an_unknown_direction_is_a_warning_and_a_sweeper_s_direction_declares_it(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.syspath_prepend(str(ROOT / "tests"))
    for args in ([], ["data._target_=uneven_data.splits"]):  # ddpexp's data; a user's data factory
        cfg = make_config("task._target_=user_task.Undeclared", *USER_TASK, "objective=val/brier", *args)
        assert components(cfg) == (
            "objective_mode=auto: task=user_task.Undeclared declares no direction for objective=val/brier (it has no "
            "directions); set objective_mode=min or objective_mode=max, or add 'brier' to the task's directions; "
            "without it no best.pt is kept and `ddpexp report` lists the runs unsorted"
        )
        assert components(cfg, stated_mode="min") is None  # hydra.sweeper.direction=minimize said it
    cfg = make_config("task._target_=user_task.BitsPerChar", *USER_TASK, "objective=val/brier",
                      "data._target_=uneven_data.splits")  # fmt: skip
    assert "declares no direction for objective=val/brier (its directions: bits_per_char min, acc max)" in (
        components(cfg) or ""
    )


def test_built_in_tasks_declare_which_way_each_metric_they_log_is_better() -> None:
    """Every val/NAME a built-in task logs (its metrics on a real batch, then finalize) has a direction, and
    objective_mode=auto resolves to it; train/loss is minimized whatever the task; min or max as given win."""
    from ddpexp.parts.tasks import Classification, LanguageModel, Regression, directions, finalize, objective_mode

    torch.manual_seed(0)
    x, tokens = torch.randn(8, 4), torch.randint(0, 5, (2, 3))
    cases = [
        (Classification(top_k=[1, 5]), torch.nn.Linear(4, 6), (x, torch.arange(8) % 6),
         {"loss": "min", "acc": "max", "top5": "max"}),
        (Regression(), torch.nn.Linear(4, 1), (x, torch.randn(8, 1)), {"mse": "min", "mae": "min", "r2": "max"}),
        (LanguageModel(), torch.nn.Embedding(5, 5), (tokens, tokens.roll(1, 1)), {"loss": "min", "acc": "max", "ppl": "min"}),
    ]  # fmt: skip
    for task, model, batch, expected in cases:
        with torch.no_grad():
            scores = task.metrics(model, batch)
        logged = finalize(task, {k: float(s) / float(n) for k, (s, n) in scores.items()})
        assert set(logged) == set(expected) and dict(task.directions) == expected, type(task).__name__
        assert directions(task) == {"train/loss": "min", **{f"val/{k}": v for k, v in expected.items()}}
        assert objective_mode(task, "train/loss", "auto") == "min"
        for name, mode in expected.items():
            assert objective_mode(task, f"val/{name}", "auto") == mode
            assert objective_mode(task, f"val/{name}", "max") == "max"  # given: it wins over the declaration
    assert Classification().directions == {"loss": "min", "acc": "max"}  # top5 only where it is logged
    assert "val/top5" not in directions(Classification())


@pytest.mark.slow
def test_a_bad_task_stops_the_command_before_any_rank(tmp_path: Path) -> None:
    proc = run_ddpexp("task._target_=user_task.VectorLoss", *USER_TASK, "hydra.run.dir=run", cwd=tmp_path,
                      check=False, env=TESTS_ON_PATH)  # fmt: skip
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("ddpexp: error: task=user_task.VectorLoss.loss: must return a scalar float tensor")
    assert not (tmp_path / "run" / "logs").exists()  # no rank started


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_colliding_metric_name_on_a_user_s_data_fails_the_rank_before_step_1(tmp_path: Path) -> None:
    """The parent's dry build cannot score a user's data factory: the ranks check the task's metrics on one val
    batch before training (found at the first evaluation, after a whole epoch, before)."""
    job = tmp_path / "job"
    proc = run_ddpexp(
        "data._target_=uneven_data.splits", "task._target_=user_task.CollidingMetric", *USER_TASK,
        "objective=val/brier", "gpus=1", "log_every_n_steps=1", "wandb.mode=disabled", f"hydra.run.dir={job}",
        cwd=tmp_path, check=False, env=TESTS_ON_PATH, timeout=100,
    )  # fmt: skip
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    assert lines[0].startswith(
        "ddpexp: error: rank 0 failed: ConfigError: task=user_task.CollidingMetric.metrics: metric name 'train/loss' "
        "collides with the record's keys"
    ), lines[0]
    assert read_summary(job)["status"] == "failed" and (job / "metrics.jsonl").read_text() == ""  # no step ran
    assert " step 1" not in (job / "logs" / "rank0.log").read_text()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_user_task_and_its_own_metric_drive_an_optuna_study(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    run_ddpexp(
        "hparams_search=digits_optuna", "hydra.sweeper.n_trials=2", "hydra.sweeper.direction=minimize",
        "objective=val/brier", "task._target_=user_task.BrierTask", *USER_TASK, "+task.temperature=1.0",
        "gpus=2", "epochs=2", f"hydra.sweep.dir={sweep}", cwd=tmp_path, timeout=240, env=TESTS_ON_PATH, wandb=True,
    )  # fmt: skip
    jobs = [sweep / str(i) for i in range(2)]
    briers = []
    for job in jobs:
        summary, rows = read_summary(job), read_metrics(job)
        assert summary["status"] == "completed" and summary["world_size"] == 2
        assert set(summary["final"]) == {"train/loss", "val/brier", "val/acc"}
        evals = [r for r in rows if "val/brier" in r]
        assert len(evals) == 2 and evals[-1]["val/brier"] == summary["final"]["val/brier"]
        assert 0 <= summary["final"]["val/brier"] <= 2  # a sum of squared probability errors over 10 classes
        briers.append(summary["final"]["val/brier"])
    run = check_wandb_matches_record(jobs[0])  # W&B's own reader: the user's metric, every step
    assert run["summary"]["val/brier"] == pytest.approx(briers[0])
    assert [h["val/brier"] for h in run["history"] if "val/brier" in h] == [r["val/brier"] for r in read_metrics(jobs[0]) if "val/brier" in r]  # fmt: skip
    # The study minimized the user's metric: its best value is the best job's.
    results = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert results["best_value"] == pytest.approx(min(briers))

    report = run_ddpexp("report", str(sweep), cwd=tmp_path)
    assert "objective val/brier (minimize)" in report.stdout
    assert f"best: job {briers.index(min(briers))}, val/brier=" in report.stdout
    with open(sweep / "report.csv") as f:
        table = list(csv.DictReader(f))
    assert [float(row["val/brier"]) for row in table] == sorted(briers)


def lm(*extra: str) -> list[str]:
    """stdlib_gpt, shrunk to seconds: a 1-layer GPT on 40k characters, SGD (2 x B vs 1 x 2B compares updates)."""
    return ["experiment=stdlib_gpt", "data.max_chars=40000", "data.block_size=32", "model.n_layer=1",
            "model.n_embd=32", "optimizer=sgd", "optimizer.lr=0.5", "max_steps=12", "log_every_n_steps=2",
            "checkpoint_every_n_steps=5", "debug.check_replicas=true", *extra]  # fmt: skip


def regression(*extra: str) -> list[str]:
    return ["experiment=diabetes_mlp", "optimizer=sgd", "optimizer.lr=0.05", "max_steps=12", "log_every_n_steps=2",
            "debug.check_replicas=true", *extra]  # fmt: skip


TASK_PRESETS = ("diabetes_mlp", "stdlib_gpt")


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize("preset", TASK_PRESETS)
def test_regression_and_language_model_train_exactly(tmp_path: Path, preset: str) -> None:
    """2 ranks x B against 1 rank x 2B (the launchers' equality is the contract suite's, test_launchers.py)."""
    args, batch = (regression, 8) if preset == "diabetes_mlp" else (lm, 4)
    runs = {
        "spawn": ["launcher=spawn", "gpus=2", f"batch_size={batch}"],
        "one": ["gpus=1", f"batch_size={2 * batch}", "wandb.mode=disabled"],
    }
    for name, extra in runs.items():
        run_ddpexp(*args(*extra), f"hydra.run.dir={tmp_path / name}", cwd=tmp_path, timeout=150, wandb=name == "spawn")
    summary = read_summary(tmp_path / "spawn")
    assert (summary["status"], summary["world_size"], summary["steps"]) == ("completed", 2, 12)
    assert summary["replicas"]["identical"] and summary["replicas"]["max_abs_diff"] == 0.0
    spawn, one = (load_weights(tmp_path / n) for n in runs)
    diff = max((spawn[k] - one[k]).abs().max().item() for k in one)
    assert diff < 1e-5, diff
    first = read_metrics(tmp_path / "spawn")[0]
    final = read_summary(tmp_path / "spawn")["final"]
    if preset == "diabetes_mlp":
        assert set(final) == {"train/loss", "val/mse", "val/mae", "val/r2"} and final["val/mse"] < first["train/loss"]
        return
    assert set(final) == {"train/loss", "val/loss", "val/acc", "val/ppl"}
    assert final["val/loss"] < math.log(98) - 1 and final["val/ppl"] == pytest.approx(math.exp(final["val/loss"]))
    assert first["tokens_per_s"] == pytest.approx(first["samples_per_s"] * 32, rel=0.05)  # 32 tokens a sample
    check_wandb_matches_record(tmp_path / "spawn")

    # Killed after step 7 (a checkpoint at 5), then the same command: the run ends bit-equal to the spawn run.
    job = tmp_path / "killed"
    killed = run_ddpexp(*args(*runs["spawn"], "debug.kill_at_step=7"), f"hydra.run.dir={job}", cwd=tmp_path,
                        check=False, timeout=150)  # fmt: skip
    assert killed.returncode == 1 and (job / "checkpoints" / "step-00000005.pt").exists()
    resumed = run_ddpexp(*args(*runs["spawn"], "debug.kill_at_step=7"), f"hydra.run.dir={job}", cwd=tmp_path)
    assert "step-00000005.pt" in resumed.stdout and read_summary(job)["resumed_from"]["step"] == 5
    assert_same_run(job, tmp_path / "spawn")
