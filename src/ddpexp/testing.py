"""The launcher and tracker contracts as pytest suites (TrackerContract is below). The launcher contract, for
whoever writes a launcher (as Hydra ships its LauncherTestSuite): subclass LauncherContract in your tests, name the
launcher, and pytest runs the contract on it, each check through the real command line, on real ranks. ddpexp's own launchers pass it too (tests/test_launcher_contract.py).

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
import math
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


class TrackerContract:
    """The tracker contract as a pytest suite, for whoever writes a tracker: subclass it, name the tracker and
    read its rows back with the tracker's own reader, and pytest runs the contract on it, through the real command
    line, on 2 real ranks. ddpexp's TensorBoard and MLflow trackers pass it (tests/test_trackers.py).

        from ddpexp.testing import TrackerContract

        class TestCsv(TrackerContract):
            tracker = "csv"                     # tracker=csv
            module = "myproject.csvlog"         # the module its _target_ names (with check, start, CsvTrackerConfig)
            config_dir = "path/to/conf"         # where conf/tracker/csv.yaml is (None: an installed tracker)

            def read_rows(self, job, summary):  # [{"step": s, "key": k, "value": v}, ...], as the tracker holds them
                ...
    """

    tracker: str = ""
    module: str = ""
    config_dir: str | None = None
    overrides: tuple[str, ...] = ()
    timeout_s: float = 240
    # 6 steps, a row at each and a checkpoint at step 3: the killed run below resumes from there.
    RUN = ("data=digits", "epochs=1", "max_steps=6", "log_every_n_steps=1", "checkpoint_every_n_steps=3", "gpus=2")

    @pytest.fixture
    def tracker_env(self) -> dict[str, str]:
        """Environment variables the tracker needs (a server's address); merged over this process's environment."""
        return {}

    def read_rows(self, job: Path, summary: dict) -> list[dict]:
        """Every value the tracker holds for the job, as {"step", "key", "value"}, one per value it keeps."""
        raise NotImplementedError(f"{type(self).__name__}.read_rows: read the tracker's rows with its own reader")

    def check_one_run(self, job: Path, summary: dict) -> None:
        """More checks, once the killed job was run again: one run in the tracker, its status (override)."""

    def ddpexp(self, cwd: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "ddpexp", f"tracker={self.tracker}", *self.RUN, *self.overrides, *args]
        if self.config_dir is not None:
            command[3:3] = ["--config-dir", str(self.config_dir)]
        return subprocess.run(
            command, cwd=cwd, env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
            capture_output=True, text=True, timeout=self.timeout_s,
        )  # fmt: skip

    def test_the_module_keeps_the_contract(self) -> None:
        from ddpexp.trackers import load as load_tracker
        from ddpexp.trackers.base import CONTRACT as TRACKER_CONTRACT

        module, schema = load_tracker(self.tracker, self.module)  # a ConfigError names whatever is missing
        assert all(callable(getattr(module, name)) for name in TRACKER_CONTRACT)
        defaults = schema()  # every field has a default, and the defaults pass its own checks
        assert defaults._target_ == f"{self.module}.start", "NameTrackerConfig._target_ must default to its start"
        assert defaults.on_error in ("fail", "warn")

    def test_every_row_once_after_a_killed_rank_and_a_rerun(self, tmp_path: Path, tracker_env: dict[str, str]) -> None:
        """Rank 0 SIGKILLed after step 5 (its tracker never finished; the checkpoint is step 3's), then the same
        command again: it resumes, and the tracker holds each row of metrics.jsonl once, rank 0's alone."""
        killed = self.ddpexp(tmp_path, tracker_env, "hydra.run.dir=job", "debug.kill_at_step=5")
        assert killed.returncode == 1 and "SIGKILL" in killed.stderr, f"{killed.stdout}\n{killed.stderr}"
        proc = self.ddpexp(tmp_path, tracker_env, "hydra.run.dir=job")
        assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
        job = tmp_path / "job"
        summary = json.loads((job / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["resumed_from"]["step"] == 3
        assert (
            summary["trackers"] == [self.tracker] and self.tracker in summary and "failed" not in summary[self.tracker]
        )
        rows = [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]
        expected = sorted(
            (row["step"], key, value)
            for row in rows
            for key, value in row.items()
            if key != "step" and isinstance(value, (int, float))
        )  # a step's train and val rows both hold `epoch`: twice at that step
        held = sorted((r["step"], r["key"], r["value"]) for r in self.read_rows(job, summary))
        assert [v[:2] for v in held] == [v[:2] for v in expected], "each row of metrics.jsonl once, nothing else"
        for (step, key, value), (_, _, ours) in zip(expected, held):
            if not key.endswith("_per_s") or step <= 3:  # throughput after the checkpoint: either attempt's
                assert math.isclose(ours, value, rel_tol=1e-6, abs_tol=1e-9), (step, key, ours, value)
        self.check_one_run(job, summary)
