"""Shared test helpers: run `python -m ddpexp` as a user would, in a temp dir, and read its run record."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def ddpexp_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "TORCHELASTIC_", "HYDRA_"))}
    env.update(PYTHONUNBUFFERED="1", WANDB_SILENT="true")
    env.pop("WANDB_API_KEY", None)  # wandb.mode=auto must pick offline
    return env


def run_ddpexp(*args: str, cwd: Path, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    """The command line, in a fresh process: a multi-process test must never hang the suite."""
    proc = subprocess.run(
        [sys.executable, "-m", "ddpexp", *args],
        cwd=cwd, env=ddpexp_env(), capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    if check and proc.returncode != 0:
        raise AssertionError(f"ddpexp {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


def read_summary(job_dir: Path) -> dict[str, Any]:
    return json.loads((job_dir / "summary.json").read_text())


def read_metrics(job_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (job_dir / "metrics.jsonl").read_text().splitlines()]


def load_weights(job_dir: Path) -> dict[str, Any]:
    import torch

    return torch.load(job_dir / "checkpoints" / "last.pt", weights_only=True)["model"]


# Small, quick runs on the real digits: 2 epochs of 12 steps at batch 64 per rank.
QUICK = ["epochs=2", "log_every_n_steps=5"]


@pytest.fixture
def quick() -> list[str]:
    return list(QUICK)
