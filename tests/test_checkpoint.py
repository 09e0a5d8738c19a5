"""Checkpoint files: a kill at any moment of a save leaves a loadable checkpoint; code or truncation is refused."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ddpexp.exceptions import CheckpointError
from ddpexp.rank import checkpoint

SAVER = """
import sys, torch
from ddpexp.rank import checkpoint
ckpt_dir = sys.argv[1]
step = 0
while True:
    step += 1
    state = {"model": {"w": torch.full((1_000_000,), float(step))}, "step": step, "config": "x: 1"}
    checkpoint.save(state, ckpt_dir, step, keep_last=2)
    print(step, flush=True)
"""


def state(step: int) -> dict:
    return {"model": {"w": torch.full((10,), float(step))}, "step": step, "config": "seed: 0\n"}


def test_save_keeps_last_k_and_points_the_marker_at_the_newest(tmp_path: Path) -> None:
    for step in (5, 10, 15):
        checkpoint.save(state(step), str(tmp_path), step, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.pt", "latest", "step-00000010.pt", "step-00000015.pt"]
    assert (tmp_path / "latest").read_text() == "step-00000015.pt"
    assert checkpoint.load(str(tmp_path / "last.pt"))["step"] == 15
    assert checkpoint.find_latest(str(tmp_path)) == str(tmp_path / "step-00000015.pt")


@pytest.mark.timeout(120)
def test_sigkill_during_saves_always_leaves_a_loadable_checkpoint(tmp_path: Path) -> None:
    rng = random.Random(0)
    newest_seen = 0
    for attempt in range(5):
        proc = subprocess.Popen([sys.executable, "-c", SAVER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        proc.stdout.readline()  # at least one save of this process finished
        time.sleep(rng.uniform(0.0, 0.3))  # then kill it somewhere inside a later save
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        path = checkpoint.find_latest(str(tmp_path))
        assert path is not None, f"attempt {attempt}: nothing loadable"
        loaded = checkpoint.load(path)
        assert torch.equal(loaded["model"]["w"], torch.full((1_000_000,), float(loaded["step"])))
        newest_seen = max(newest_seen, loaded["step"])
    assert newest_seen >= 1


class Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, (f"touch {self.marker}",))


def test_a_checkpoint_holding_code_is_refused_and_nothing_runs(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    bad = tmp_path / "evil.pt"
    torch.save({"model": {}, "step": 1, "config": "", "x": Payload(marker)}, bad)
    with pytest.raises(CheckpointError, match=rf"^checkpoint {bad}: refused, not a plain tensor checkpoint") as e:
        checkpoint.load(str(bad))
    assert not marker.exists()
    # What it holds, and never torch's advice to load it with weights_only=False (that would run the code).
    assert "GLOBAL" in str(e.value) and "weights_only" not in str(e.value) and "\n" not in str(e.value)


def test_truncated_or_foreign_files_are_refused_with_their_name(tmp_path: Path) -> None:
    good = tmp_path / "good.pt"
    torch.save(state(3), good)
    cut = tmp_path / "cut.pt"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=rf"^checkpoint {cut}: refused"):
        checkpoint.load(str(cut))
    foreign = tmp_path / "foreign.pt"
    torch.save({"weights": torch.zeros(2)}, foreign)
    with pytest.raises(CheckpointError, match=r"not a ddpexp checkpoint"):
        checkpoint.load(str(foreign))
    with pytest.raises(CheckpointError, match=r"no such file"):
        checkpoint.load(str(tmp_path / "missing.pt"))
    # Bytes that are no checkpoint at all fail inside the unpickler in many ways (KeyError, IndexError, ...).
    for i, junk in enumerate([b"hello\n", bytes(random.Random(0).randrange(256) for _ in range(4096)), b""]):
        path = tmp_path / f"junk{i}.pt"
        path.write_bytes(junk)
        with pytest.raises(CheckpointError, match=rf"^checkpoint {path}: refused"):
            checkpoint.load(str(path))


def test_the_newest_valid_checkpoint_is_found_past_a_garbled_one(tmp_path: Path) -> None:
    for step in (5, 10):
        checkpoint.save(state(step), str(tmp_path), step, keep_last=3)
    (tmp_path / "step-00000010.pt").write_bytes(b"hello\n")  # also last.pt's bytes: the same inode
    assert checkpoint.find_latest(str(tmp_path)) == str(tmp_path / "step-00000005.pt")


def test_resume_from_a_malicious_checkpoint_is_refused_before_anything_starts(tmp_path: Path) -> None:
    """`resume=PATH` end to end: one line naming the file, exit 2, the payload never ran, no rank started."""
    import subprocess
    import sys

    from conftest import ddpexp_env

    evil, marker = tmp_path / "evil.pt", tmp_path / "pwned"
    torch.save({"model": {}, "step": 1, "config": "", "x": Payload(marker)}, evil)
    proc = subprocess.run(
        [sys.executable, "-m", "ddpexp", f"resume={evil}", "hydra.run.dir=job"],
        cwd=tmp_path, env=ddpexp_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"ddpexp: error: checkpoint {evil}: refused, not a plain tensor checkpoint")
    assert not marker.exists() and not (tmp_path / "job" / "logs").exists()


def test_resume_latest_is_the_newest_job_dir_of_this_config(tmp_path: Path) -> None:
    """resume=latest: under the run dir's root (outputs/), the newest job dir whose newest checkpoint was trained
    under this config as resume judges it (no model, data, optimizer, seed, ... changed; max_steps may); one line
    when there is none."""
    from ddpexp.exceptions import ConfigError
    from ddpexp.parent.resume_decision import latest_job_dir, run_root

    def job(name: str, config: str, mtime: float | None) -> None:
        (tmp_path / name / ".hydra").mkdir(parents=True)
        if mtime is not None:
            path = checkpoint.save({**state(4), "config": config}, str(tmp_path / name / "checkpoints"), 4, 2)
            os.utime(path, (mtime, mtime))

    mlp, cnn = "model: {_target_: mlp}\nseed: 1\nmax_steps: 2\n", "model: {_target_: cnn}\nseed: 1\n"
    job("outputs/d1/t1", mlp, 100)
    job("outputs/d1/t2", mlp.replace("max_steps: 2", "max_steps: 3"), 200)  # trained longer: the same run
    job("outputs/d2/t1", cnn, 300)  # another model
    job("outputs/d2/t2", mlp, None)  # no checkpoint (the new job's own dir, say)
    (tmp_path / "outputs" / "d2" / "t3" / ".hydra").mkdir(parents=True)
    (tmp_path / "outputs" / "d2" / "t3" / "checkpoints").mkdir()
    (tmp_path / "outputs" / "d2" / "t3" / "checkpoints" / "step-00000009.pt").write_bytes(b"garbled")  # skipped
    root = str(tmp_path / "outputs")
    assert latest_job_dir(root, mlp.replace("max_steps: 2", "max_steps: 8")) == str(tmp_path / "outputs/d1/t2")
    assert latest_job_dir(root, cnn) == str(tmp_path / "outputs/d2/t1")
    with pytest.raises(ConfigError, match=r"^resume=latest: no job dir under .*outputs holds a checkpoint of this "
                                          r"config \(model, data, optimizer, .*\); give resume=PATH$"):  # fmt: skip
        latest_job_dir(root, "model: {_target_: resnet18}\n")
    assert run_root("outputs/${now:%Y-%m-%d}/${now:%H-%M-%S}") == "outputs"
    assert run_root("/abs/runs/${now:%H}-${hydra.job.name}") == "/abs/runs"


@pytest.mark.timeout(120)
def test_resume_latest_continues_the_newest_run_of_this_config(tmp_path: Path) -> None:
    """One rank, 2 steps under outputs/; then `resume=latest max_steps=3` starts from its step 2 without its path."""
    from conftest import read_summary, run_ddpexp

    tiny = ["gpus=1", "wandb.mode=disabled", "checkpoint_every_n_steps=1"]
    run_ddpexp(*tiny, "max_steps=2", cwd=tmp_path, timeout=60)
    (first,) = (tmp_path / "outputs").glob("*/*")
    proc = run_ddpexp(*tiny, "max_steps=3", "resume=latest", "model=mlp", cwd=tmp_path, check=False, timeout=30)
    assert proc.returncode == 2 and proc.stderr.startswith("ddpexp: error: resume=latest: no job dir under "), proc
    proc = run_ddpexp(*tiny, "max_steps=3", "resume=latest", cwd=tmp_path, timeout=60)
    assert f"resuming from {first}/checkpoints/step-00000002.pt (resume=latest" in proc.stdout, proc.stdout
    (second,) = set((tmp_path / "outputs").glob("*/*")) - {first}
    summary = read_summary(second)
    assert (summary["status"], summary["steps"], summary["resumed_from"]["step"]) == ("completed", 3, 2), summary
