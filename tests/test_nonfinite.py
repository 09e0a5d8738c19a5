"""A loss that goes NaN stops every rank at that step, loudly, and keeps the last finite checkpoint; with
on_nonfinite=warn the run goes on; either way the run record stays strict JSON. In an Optuna study, such a trial
is a failed trial and the study goes on."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import yaml

from conftest import run_ddpexp

pytestmark = pytest.mark.slow


def strict_json(text: str):  # type: ignore[no-untyped-def]
    """json.loads that refuses NaN/Infinity, as JSON itself (and most parsers outside Python) does."""

    def refuse(constant: str) -> None:
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.timeout(240)
def test_a_nan_loss_stops_every_rank_at_that_step_and_keeps_the_last_finite_checkpoint(tmp_path: Path) -> None:
    job = tmp_path / "job"
    common = ["gpus=2", "optimizer.lr=1e30", "max_steps=8", "checkpoint_every_n_steps=1", "wandb.mode=disabled"]
    proc = run_ddpexp(*common, f"hydra.run.dir={job}", cwd=tmp_path, check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    kept = job / "checkpoints" / "step-00000001.pt"
    assert re.fullmatch(  # whichever rank wrote its error first: both stopped at step 2
        r"ddpexp: error: rank [01] failed: NonFinite: train/loss went non-finite \(nan\) at step 2; stopped at step 2, "
        f"the last checkpoint before it is {re.escape(str(kept))} \\(on_nonfinite=warn goes on instead\\)",
        lines[0],
    ), lines[0]
    summary = strict_json((job / "summary.json").read_text())
    assert summary["status"] == "failed" and "at step 2" in summary["error"]
    assert sorted(p.name for p in (job / "checkpoints").glob("step-*.pt")) == ["step-00000001.pt"]
    weights = torch.load(kept, weights_only=True)["model"]
    assert all(torch.isfinite(w).all() for w in weights.values())  # after one step at lr 1e30: huge, but finite
    for log in (job / "logs").glob("rank*.log"):  # both ranks stopped there, at the same step
        assert "train/loss went non-finite (nan) at step 2" in log.read_text(), log

    # No checkpoint before the evaluation at step 8: train/loss is named at its own step (read at the log line),
    # once, and before the val/loss it spoilt (only `val/loss went non-finite at step 8` was said).
    warned = tmp_path / "warned"
    without_checkpoints = [*common, "gpus=1", "on_nonfinite=warn", "checkpoint_every_n_steps=null"]
    proc = run_ddpexp(*without_checkpoints, f"hydra.run.dir={warned}", cwd=tmp_path)
    said = [line.split("] ", 1)[1] for line in proc.stdout.splitlines() if "went non-finite" in line]
    assert said == [
        "train/loss went non-finite (nan) at step 2; going on (on_nonfinite=warn)",
        "val/loss went non-finite (nan) at step 8; going on (on_nonfinite=warn)",
    ], proc.stdout
    summary = strict_json((warned / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 8
    assert summary["final"]["train/loss"] is None and summary["final"]["val/loss"] is None  # NaN, as JSON can say
    rows = [strict_json(line) for line in (warned / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/loss"] for r in rows if "train/loss" in r] == [None]  # the step-8 log line


@pytest.mark.timeout(300)
def test_a_nan_trial_is_a_failed_trial_and_the_study_goes_on(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    proc = run_ddpexp(
        "hparams_search=digits_optuna", "objective=val/loss", "hydra.sweeper.direction=minimize",
        "optimizer.lr=choice(1e30,1e-3)", "hydra.sweeper.n_trials=3", "gpus=1", "max_steps=4",
        "wandb.mode=disabled", f"hydra.sweep.dir={sweep}", cwd=tmp_path, check=False, timeout=280,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out, out
    statuses = {}
    for i in range(3):
        summary = json.loads((sweep / str(i) / "summary.json").read_text())
        overrides = dict(
            o.split("=", 1) for o in yaml.safe_load((sweep / str(i) / ".hydra" / "overrides.yaml").read_text())
        )
        statuses[i] = (float(overrides["optimizer.lr"]), summary["status"])
    failed = [i for i, (lr, status) in statuses.items() if status == "failed"]
    assert failed and all(statuses[i][0] == 1e30 for i in failed), statuses
    assert any(status == "completed" for _, status in statuses.values()), statuses
    assert min(failed) < 2, statuses  # a trial ran after a failed one: the study went on
    assert proc.returncode == 1 and f"ddpexp: {len(failed)} job(s) of the sweep failed:" in proc.stderr
    for i in failed:
        assert re.search(
            rf"{re.escape(str(sweep / str(i)))}: rank 0 failed: NonFinite: \S+ went non-finite", proc.stderr
        )
