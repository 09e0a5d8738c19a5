"""`ddpexp eval`, ddpexp.evaluate and ddpexp.load_model: one real 2-rank digits run with a test split, whose val/loss
bottoms out mid-run, scored again by the CLI (best.pt to the recorded best value) and from Python at 1, 2 and 3
ranks (each test sample scored once, counted by the evaluation); tiny one-rank runs of the regression preset, the
LM preset and the example project; load_model in a fresh process; bad input as one line and exit 2."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, ddpexp_env, read_metrics, read_summary, run_ddpexp

TEST_FRACTION, TEST_SAMPLES, VAL_SAMPLES = 0.056, 101, 359  # round(1797 * 0.056) = 101: odd, no multiple of 2 or 3
# 2 ranks x 21 steps an epoch. The peak is made certain, not likely (a CPU's float kernels decide a trajectory's
# details): the mlp learns for one epoch at lr 0.01, then the schedule sets lr 1 (AdamW moves each weight by about
# the lr a step), which ruins it, so val/loss is lowest at the first evaluation (step 21) whatever the kernels.
PEAKS = ["launcher=spawn", "gpus=2", "model=mlp", "optimizer.lr=0.01", "scheduler=step", "~scheduler.step_size",
         "scheduler._target_=torch.optim.lr_scheduler.MultiStepLR", "+scheduler.milestones=[21]", "scheduler.gamma=100",
         "epochs=4", "batch_size=32", f"data.test_fraction={TEST_FRACTION}", "objective=val/loss",
         "log_every_n_steps=100", "wandb.mode=disabled"]  # fmt: skip
TINY = ["gpus=1", "max_steps=2", "wandb.mode=disabled"]


@pytest.fixture(scope="module")
def peaked(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("peaked")
    run_ddpexp(*PEAKS, "hydra.run.dir=job", cwd=root, timeout=150)
    return root / "job"


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny one-rank runs: the regression and LM presets with a test split, the example project without one."""
    root = tmp_path_factory.mktemp("small")
    # `+data.test_fraction`, as the README had it before the key was declared, still carves the split
    run_ddpexp("experiment=diabetes_mlp", *TINY, "+data.test_fraction=0.1", "hydra.run.dir=diabetes", cwd=root)
    lm = ["data.max_chars=20000", "data.block_size=16", "model.n_layer=1", "model.n_embd=32", "batch_size=16"]
    run_ddpexp("experiment=stdlib_gpt", *TINY, *lm, "data.test_fraction=0.1", "hydra.run.dir=lm", cwd=root)
    project = root / "myproject"
    shutil.copytree(ROOT / "examples" / "myproject", project, ignore=shutil.ignore_patterns("__pycache__", "outputs"))
    run_ddpexp("experiment=wine", *TINY, f"hydra.run.dir={root / 'wine'}", cwd=project)
    return {"diabetes": root / "diabetes", "lm": root / "lm", "wine": root / "wine"}


def records(job: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((job / "eval").glob("*.json"), key=lambda p: p.stat().st_mtime)]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ddpexp_eval_rescores_best_pt_to_the_recorded_best_value(peaked: Path) -> None:
    summary, rows = read_summary(peaked), read_metrics(peaked)
    val = [(m["step"], m["val/loss"]) for m in rows if "val/loss" in m]
    lowest = min(val, key=lambda row: row[1])
    assert lowest[0] == 21 and summary["best"]["step"] == 21 and len(val) == 4  # the schedule's peak
    assert all(loss > 2 * lowest[1] for _, loss in val[1:])  # ruined after it
    record_before = {p.name: p.read_bytes() for p in peaked.iterdir() if p.is_file()}

    proc = run_ddpexp("eval", str(peaked), "--checkpoint", "best", cwd=peaked.parent, timeout=120)
    [line] = proc.stdout.strip().splitlines()
    (record,) = records(peaked)
    assert line.startswith(f"ddpexp: eval of best (step {lowest[0]}) on val, 2 rank(s): val/loss=")
    assert line.endswith(f"scored={VAL_SAMPLES} -> {peaked / 'eval' / 'best-val-1.json'}")
    assert record["metrics"]["val/loss"] == pytest.approx(summary["best"]["value"], abs=1e-6)
    assert (record["scored"], record["split_samples"], record["world_size"]) == (VAL_SAMPLES, VAL_SAMPLES, 2)
    assert record["checkpoint"] == str(peaked / "checkpoints" / "best.pt") and record["checkpoint_step"] == lowest[0]
    # The run's own record is untouched: the eval's is a file of its own.
    assert {p.name: p.read_bytes() for p in peaked.iterdir() if p.is_file()} == record_before


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_test_split_is_scored_once_per_sample_at_1_2_and_3_ranks(peaked: Path) -> None:
    import ddpexp

    before = len(records(peaked))
    results = {n: ddpexp.evaluate(str(peaked), checkpoint="last", split="test", gpus=n) for n in (1, 2, 3)}
    new = records(peaked)[before:]
    assert [r["world_size"] for r in new] == [1, 2, 3]
    for r in new:  # counted by the evaluation, not the dataset's length
        assert (r["scored"], r["split_samples"], r["split"]) == (TEST_SAMPLES, TEST_SAMPLES, "test")
        assert r["checkpoint"] == str(peaked / "checkpoints" / "last.pt")
    for n, metrics in results.items():
        assert set(metrics) == {"test/loss", "test/acc"} and metrics == new[n - 1]["metrics"]
        assert metrics["test/acc"] * TEST_SAMPLES == pytest.approx(round(results[1]["test/acc"] * TEST_SAMPLES))
        assert metrics["test/acc"] == results[1]["test/acc"]  # counts: exactly equal
        assert metrics["test/loss"] == pytest.approx(results[1]["test/loss"], rel=1e-6)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_regression_lm_and_a_user_project_run_are_scored(small: dict[str, Path]) -> None:
    import ddpexp

    mse = ddpexp.evaluate(str(small["diabetes"]), split="test", gpus=1)
    assert set(mse) == {"test/mse", "test/mae", "test/r2"} and records(small["diabetes"])[-1]["scored"] == 44
    lm = ddpexp.evaluate(str(small["lm"]), checkpoint="last", split="test", gpus=1)
    assert set(lm) == {"test/loss", "test/acc", "test/ppl"}
    windows = (20000 - 1) // 16
    assert records(small["lm"])[-1]["scored"] == round(windows * 0.1)
    # The project's own model, data and task (myproject.*), imported from the run's recorded config dir.
    wine = ddpexp.evaluate(str(small["wine"]), checkpoint="last", gpus=1)
    final = read_summary(small["wine"])["final"]
    assert set(wine) == {k for k in final if k.startswith("val/")}
    assert all(wine[k] == pytest.approx(final[k], abs=1e-6) for k in wine)


LOAD = """
import json, sys, torch, ddpexp
out = {}
for run in sys.argv[1:]:
    model = ddpexp.load_model(run, checkpoint="best")
    state = torch.load(run + "/checkpoints/best.pt", weights_only=True)["model"]
    mine = model.state_dict()
    out[run] = {"type": type(model).__module__ + "." + type(model).__name__, "training": model.training,
                "devices": sorted({str(t.device) for t in mine.values()}), "keys": sorted(mine) == sorted(state),
                "equal": all(torch.equal(mine[k], state[k]) for k in state)}
print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_load_model_in_a_fresh_process_has_exactly_the_checkpoint_s_weights(
    peaked: Path, small: dict[str, Path], tmp_path: Path
) -> None:
    runs = [str(peaked), str(small["wine"])]
    proc = subprocess.run([sys.executable, "-c", LOAD, *runs], cwd=tmp_path, env=ddpexp_env(), capture_output=True,
                          text=True, timeout=100)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out[runs[0]]["type"] == "torch.nn.modules.container.Sequential"  # ddpexp's mlp, not DDP
    assert out[runs[1]]["type"] == "myproject.nets.TinyNet"  # the project's own, found from the run's config dir
    for run in runs:
        assert out[run]["training"] is False and out[run]["devices"] == ["cpu"], out[run]
        assert out[run]["keys"] and out[run]["equal"], out[run]


def eval_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    from ddpexp.cli.evaluate import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1, err
    return err[0]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_bad_input_is_one_line_and_exit_2(small: dict[str, Path], tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    wine = str(small["wine"])
    assert eval_error([str(tmp_path / "nope")], capsys) == f"ddpexp: error: {tmp_path / 'nope'}: no such run dir"
    assert eval_error([str(tmp_path)], capsys) == (
        f"ddpexp: error: {tmp_path}: not a ddpexp run dir (no summary.json, checkpoints/ or .hydra/config.yaml)"
    )
    assert eval_error([wine, "--checkpoint", str(tmp_path / "x.pt")], capsys) == (
        f"ddpexp: error: --checkpoint {tmp_path / 'x.pt'}: no such file (best, last or a checkpoint's PATH)"
    )
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    assert "refused, not a plain tensor checkpoint" in eval_error(
        [wine, "--checkpoint", str(tmp_path / "junk.pt")], capsys
    )
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    assert eval_error([str(tmp_path / "run")], capsys) == (
        f"ddpexp: error: --checkpoint best: {tmp_path / 'run' / 'checkpoints' / 'best.pt'}: no such checkpoint "
        "(the run recorded no best evaluation)"
    )
    assert eval_error([wine, "--checkpoint", "last", "--split", "test"], capsys) == (
        "ddpexp: error: --split test: the run's data (myproject.data.wine) has no test split "
        "(the built-in sets carve one with data.test_fraction=0.1)"
    )
    assert eval_error([wine, "--split", "train"], capsys) == "ddpexp: error: --split train: must be one of val, test"
    assert eval_error([wine, "--checkpoint", "last", "gpu=2"], capsys) == (
        "ddpexp: error: gpu=2: Key 'gpu' not in 'Config' (did you mean gpus?)"
    )
    assert eval_error([wine, "--checkpoint", "last", "gpus=0"], capsys) == (
        "ddpexp: error: gpus=0: must be >= 1 (processes per node)"
    )
    assert eval_error([wine, "--bogus"], capsys).startswith("ddpexp: error: eval: unrecognized arguments: --bogus")
    assert eval_error([], capsys).startswith("ddpexp: error: eval: the following arguments are required: RUN_DIR")
    assert not (small["wine"] / "eval").exists() or all(p.stat().st_size for p in (small["wine"] / "eval").iterdir())


def test_digits_diabetes_and_text_carve_a_disjoint_test_split_only_when_asked() -> None:
    import torch

    from ddpexp.parts import data

    for n, val_fraction in ((1797, 0.2), (442, 0.2)):
        train, val, test = data._carve(n, val_fraction, 0.1, seed=3)
        assert len(test) == round(n * 0.1) and len(val) == round(n * val_fraction)
        assert sorted(torch.cat([train, val, test]).tolist()) == list(range(n))  # disjoint, and all of them
        old = torch.randperm(n, generator=torch.Generator().manual_seed(3))
        train0, val0, test0 = data._carve(n, val_fraction, 0.0, seed=3)
        assert torch.equal(val0, old[: len(val)]) and torch.equal(train0, old[len(val) :]) and len(test0) == 0
        assert all(torch.equal(a, b) for a, b in zip(data._carve(n, val_fraction, None, seed=3), (train0, val0, test0)))
    splits = data.digits(test_fraction=TEST_FRACTION)
    assert (len(splits.train), len(splits.val), len(splits.test)) == (1797 - VAL_SAMPLES - TEST_SAMPLES, 359, 101)
    assert (
        data.digits().test is None and data.diabetes().test is None and len(data.diabetes(test_fraction=0.1).test) == 44
    )
    assert (
        data.digits(test_fraction=None).test is None
        and data.stdlib_text(max_chars=20000, test_fraction=None).test is None
    )
    text = data.stdlib_text(block_size=16, max_chars=20000, test_fraction=0.1)
    plain = data.stdlib_text(block_size=16, max_chars=20000)
    assert plain.test is None and len(text.test) == len(text.val) == len(plain.val) == round(1249 * 0.1)
    assert torch.equal(text.test.tensors[0], plain.val.tensors[0])  # the end of the text
    assert len(text.train) == 1249 - 2 * 125
    assert data.Splits([1], [2]).test is None and data.Splits([1], [2], [3]).test == [3]
