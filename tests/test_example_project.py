"""The example user project (examples/myproject: its own model, data and experiment YAML beside ddpexp's groups) as
a user runs it: the `ddpexp` script in the project's folder without flags, `--config-dir` from elsewhere, and
ddpexp.run from a script. Each in a copy of the project, on 2 spawn ranks where it trains."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, check_run_record, check_wandb_matches_record, ddpexp_env, read_metrics, read_summary

EXAMPLE = ROOT / "examples" / "myproject"
DDPEXP = Path(sys.executable).parent / "ddpexp"  # the console script of this environment's install
METRICS = {"train/loss", "val/loss", "val/acc", "val/balanced_acc"}  # the last: the project's own task's metric


@pytest.fixture
def project(tmp_path: Path) -> Path:
    shutil.copytree(EXAMPLE, tmp_path / "myproject", ignore=shutil.ignore_patterns("__pycache__", "outputs"))
    return tmp_path / "myproject"


def ddpexp(*args: str, cwd: Path, timeout: float = 120, wandb: bool = False) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(DDPEXP), *args], cwd=cwd, env=ddpexp_env(wandb), capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def test_project_groups_extend_ddpexps(project: Path, tmp_path: Path) -> None:
    proc = ddpexp("model=nope", cwd=project)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        "ddpexp: error: In 'config': Could not find 'model/nope'. "
        "Available options in 'model': cnn, gpt, mlp, resnet101, resnet18, resnet50, tinynet"
    )
    proc = ddpexp("experiment=wine", "--cfg", "job", cwd=project)
    cfg = yaml.safe_load(proc.stdout)
    assert proc.returncode == 0 and cfg["model"] == {"_target_": "myproject.nets.TinyNet", "hidden": 32}
    assert cfg["data"]["_target_"] == "myproject.data.wine" and cfg["launcher"]["_target_"].startswith("ddpexp.")
    assert cfg["task"]["_target_"] == "myproject.tasks.BalancedAccuracy" and cfg["objective"] == "val/balanced_acc"
    # From elsewhere with --config-dir: the project's package imports (the parent checks every _target_'s keys)
    proc = ddpexp("--config-dir", str(project / "conf"), "experiment=wine", "+model.width=3", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (
        "ddpexp: error: model.width=3: myproject.nets.TinyNet takes no such argument "
        "(it takes num_classes, in_features, hidden)"
    )


def test_checkout_conf_is_not_added_twice() -> None:
    """In ddpexp's own checkout, ./conf is the package's configs: no second search path entry for it."""
    proc = subprocess.run([str(DDPEXP), "--info", "searchpath"], cwd=ROOT, env=ddpexp_env(), capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0 and "pkg://ddpexp.conf" in proc.stdout and "command-line" not in proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_example_project_via_cli(project: Path) -> None:
    """One run, checked everywhere it is recorded: metrics.jsonl, summary.json, the W&B offline run, ddpexp report."""
    proc = ddpexp("experiment=wine", "debug.check_replicas=true", "hydra.run.dir=job", cwd=project, timeout=180,
                  wandb=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    job = project / "job"
    summary = check_run_record(job, "spawn", 2, METRICS)
    assert summary["final"]["val/acc"] > 0.8 and summary["final"]["val/balanced_acc"] > 0.8
    assert summary["steps"] == 6 * 5  # 134 wines / 2 ranks / batch 16 = 5 steps per epoch, 6 epochs
    config = yaml.safe_load((job / ".hydra" / "config.yaml").read_text())
    assert config["model"]["_target_"] == "myproject.nets.TinyNet"
    assert config["data"]["_target_"] == "myproject.data.wine"
    metrics = read_metrics(job)
    last_val = [m for m in metrics if "val/acc" in m][-1]
    assert last_val["step"] == 30 and last_val["val/acc"] == summary["final"]["val/acc"]
    assert METRICS <= {k for m in metrics for k in m}
    check_wandb_matches_record(job)

    report = ddpexp("report", "job", cwd=project, timeout=60)
    assert report.returncode == 0, report.stderr
    assert "objective val/balanced_acc (maximize)" in report.stdout
    assert f"best: job job, val/balanced_acc={summary['final']['val/balanced_acc']:.4f}" in report.stdout
    assert (job / "report.md").is_file() and "completed" in (job / "report.md").read_text()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_example_project_via_python(project: Path) -> None:
    """ddpexp.run, called several times from one script in the project's folder (tests/example_api.py)."""
    out = project / "results.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "example_api.py"), str(out)],
        cwd=project, env=ddpexp_env(), capture_output=True, text=True, timeout=270,
    )  # fmt: skip
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    r = json.loads(out.read_text())

    assert r["unknown_model"]["raised"] == "ConfigError" and r["unknown_model"]["message"].endswith(
        "Available options in 'model': cnn, gpt, mlp, resnet101, resnet18, resnet50, tinynet"
    )
    assert r["bad_value"] == {"raised": "ConfigError", "message": "batch_size=0: must be >= 1 (per process)",
                              "summaries": []}  # fmt: skip
    assert r["one_string"]["raised"] == "ConfigError"

    run = r["run"]["returned"]
    assert run["job_dir"] == str(project / "api") and run["record"] == read_summary(project / "api")
    assert run["record"]["status"] == "completed" and run["record"]["world_size"] == 2
    assert run["record"]["replicas"]["identical"] and set(run["record"]["final"]) == METRICS
    assert r["again"]["returned"] == run  # the same call again: already completed, nothing rerun

    fails = r["rank_fails"]
    assert fails["raised"] == "RunFailed"
    assert fails["message"].startswith("rank 0 failed: RuntimeError: debug.fail_at_step=2: rank 0 fails on purpose")
    assert [s["record"]["status"] for s in fails["summaries"]] == ["failed"]

    sweep = r["sweep"]
    failed = "rank 0 failed: RuntimeError: debug.fail_at_step=1: rank 0 fails on purpose"
    assert sweep["raised"] == "RunFailed" and sweep["message"] == (
        f"1 job(s) of the sweep failed:\n  {project / 'sweep' / '1'}: {failed}"
    )
    done, fails = sweep["summaries"]
    assert done["job_dir"] == str(project / "sweep" / "0") and done["record"]["status"] == "completed"
    assert done["record"]["world_size"] == 1 and fails["record"]["status"] == "failed"
    # Every job of a sweep is checked before the first starts: a bad value in the last one stops it whole.
    assert r["sweep_refused"] == {"raised": "ConfigError", "summaries": [],
                                  "message": "job 1 of the sweep: batch_size=0: must be >= 1 (per process)"}  # fmt: skip
    assert not (project / "refused").exists()

    assert r["plan"] == {"returned": None}
    assert r["after"] == {"hydra_initialized": False, "logging_handlers_back": True, "sys_path_back": True,
                          "pythonpath_back": True}  # fmt: skip
