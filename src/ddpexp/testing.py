"""The launcher contract as a pytest suite, for whoever writes a launcher (as Hydra ships its LauncherTestSuite):
subclass LauncherContract in your tests, name the launcher, and pytest runs the contract on it, each check through
the real command line, on real ranks. ddpexp's own launchers pass it too (tests/test_launcher_contract.py).

    from ddpexp.testing import LauncherContract

    class TestNice(LauncherContract):
        launcher = "nice"                  # launcher=nice
        module = "myproject.launcher"      # the module its _target_ names
        config_dir = "path/to/conf"        # where conf/launcher/nice.yaml is (None: an installed launcher)

A launcher that needs its scheduler's environment overrides the `launcher_env` fixture (and `overrides`); one whose
ranks are commands that another launcher starts names that launcher's command line as `starter`."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ddpexp.launchers import load
from ddpexp.launchers.base import CONTRACT

# A job of a few steps on the digits, 2 ranks, no W&B: what every launcher can run in seconds.
TINY = ("data=digits", "epochs=1", "max_steps=4", "log_every_n_steps=2", "wandb.mode=disabled", "gpus=2")


class LauncherContract:
    launcher: str = ""  # the `launcher=` name
    module: str = ""  # the module its `_target_` names (with launch, resolve, world_size, plan and NameConfig)
    config_dir: str | None = None  # the project's config dir holding conf/launcher/NAME.yaml; None: installed
    overrides: tuple[str, ...] = ()  # what this launcher needs besides TINY (e.g. device=cpu)
    starter: tuple[str, ...] = ()  # what starts the command, if not itself: an outside launcher (torchrun's args)
    tracebacks_shown: int | None = 1  # a failing rank's traceback, shown once (None: the starter prints its own)
    timeout_s: float = 240

    @pytest.fixture
    def launcher_env(self) -> dict[str, str]:
        """Environment variables the launcher needs (a scheduler's); merged over this process's environment."""
        return {}

    def ddpexp(self, cwd: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
        """`python -m ddpexp launcher=NAME TINY... args`, as a user types it, in a process of its own."""
        command = [f"launcher={self.launcher}", *TINY, *self.overrides, *args]
        if self.config_dir is not None:
            command[:0] = ["--config-dir", str(self.config_dir)]
        command[:0] = [*(self.starter or (sys.executable,)), "-m", "ddpexp"]
        return subprocess.run(
            command, cwd=cwd, env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
            capture_output=True, text=True, timeout=self.timeout_s,
        )  # fmt: skip

    def test_the_module_keeps_the_contract(self) -> None:
        module, schema = load(self.launcher, self.module)  # a ConfigError names whatever is missing
        assert all(callable(getattr(module, name)) for name in CONTRACT)
        defaults = schema()  # every field has a default, and the defaults pass its own checks
        assert defaults._target_ == f"{self.module}.launch", "NameConfig._target_ must default to the module's launch"
        assert {f.name for f in dataclasses.fields(schema)} >= {"_target_"}

    def test_plan_starts_nothing(self, tmp_path: Path, launcher_env: dict[str, str]) -> None:
        proc = self.ddpexp(tmp_path, launcher_env, "plan=true", "hydra.run.dir=job")
        assert proc.returncode == 0, proc.stderr
        head = f"ddpexp plan: launcher={self.launcher}, "
        assert head in proc.stdout and "rank(s); nothing was started" in proc.stdout, proc.stdout
        assert "  rank 0: " in proc.stdout and not (tmp_path / "job").exists()

    def test_a_job_runs_and_leaves_its_record(self, tmp_path: Path, launcher_env: dict[str, str]) -> None:
        proc = self.ddpexp(tmp_path, launcher_env, "hydra.run.dir=job", "debug.check_replicas=true")
        assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
        job = tmp_path / "job"
        assert "ddpexp: completed in " in proc.stdout and str(job) in proc.stdout
        summary = json.loads((job / "summary.json").read_text())
        config = yaml.safe_load((job / ".hydra" / "config.yaml").read_text())
        world = load(self.launcher, self.module)[0].world_size(config)  # gpus=2 given: the ranks it asks for
        assert summary["status"] == "completed" and summary["launcher"] == self.launcher
        assert world in (None, summary["world_size"]) and summary["steps"] == 4
        assert summary["replicas"]["identical"], "every rank must train the same model (one DDP process group)"
        assert {"train/loss", "val/acc"} <= set(summary["final"])
        assert sorted(p.name for p in (job / "logs").glob("rank*.log")) == [
            f"rank{r}.log" for r in range(summary["world_size"])
        ]
        assert (job / "checkpoints" / "last.pt").is_file() and (job / "metrics.jsonl").stat().st_size > 0

    def test_a_failing_rank_fails_the_job(self, tmp_path: Path, launcher_env: dict[str, str]) -> None:
        proc = self.ddpexp(tmp_path, launcher_env, "hydra.run.dir=job", "debug.fail_at_step=2", "debug.fail_rank=1")
        assert proc.returncode == 1, f"{proc.stdout}\n{proc.stderr}"
        assert (
            "ddpexp: error: rank 1 failed: RuntimeError: debug.fail_at_step=2: rank 1 fails on purpose" in proc.stderr
        )
        if self.tracebacks_shown is not None:
            assert proc.stderr.count("Traceback (most recent call last)") == self.tracebacks_shown, proc.stderr
        summary = json.loads((tmp_path / "job" / "summary.json").read_text())
        assert summary["status"] == "failed" and "rank 1 fails on purpose" in summary["error"]
        self.check_failed(proc, tmp_path / "job")

    def check_failed(self, proc: subprocess.CompletedProcess[str], job: Path) -> None:
        """More checks of the failed job above, for a launcher's own tests (its scheduler's state, say)."""
