"""Real multi-process DDP runs through the command line: spawn, torchrun (one and two nodes), a multirun sweep.

Each test starts few processes and checks many things; every run has a hard timeout."""

from __future__ import annotations

import re
import select
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from conftest import (
    QUICK,
    alive,
    check_run_record,
    check_wandb_matches_record,
    children_of,
    ckpt_config,
    ddpexp_env,
    load_weights,
    read_metrics,
    read_summary,
    run_ddpexp,
    start,
)
from wandb_offline import find_offline_runs, read_offline_run

pytestmark = pytest.mark.slow


def write_mnist_idx(root: Path, n_train: int = 300, n_test: int = 101) -> None:
    """MNIST's own IDX files (big-endian header + uint8 pixels), read back by torchvision's MNIST class."""
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for split, n in (("train", n_train), ("t10k", n_test)):
        labels = rng.integers(0, 10, n).astype(np.uint8)
        images = np.zeros((n, 28, 28), np.uint8)
        for i, label in enumerate(labels):  # a bright bar whose position encodes the label: learnable
            images[i, 2 + 2 * label : 5 + 2 * label, 4:24] = 255
        images = np.clip(images + rng.integers(0, 40, images.shape), 0, 255).astype(np.uint8)
        (raw / f"{split}-images-idx3-ubyte").write_bytes(struct.pack(">IIII", 0x803, n, 28, 28) + images.tobytes())
        (raw / f"{split}-labels-idx1-ubyte").write_bytes(struct.pack(">II", 0x801, n) + labels.tobytes())


def test_spawn_two_ranks_and_equal_to_one_rank_double_batch(tmp_path: Path) -> None:
    two, one = tmp_path / "two", tmp_path / "one"
    # SGD: the update is linear in the gradient, so float rounding stays at rounding size (Adam's m/sqrt(v)
    # magnifies it for near-zero gradients). An odd train set (1,437): the last step's slices are 15 and 14
    # samples, weighted exactly (DistributedSampler would repeat one sample and average the ranks' means).
    common = ["launcher=spawn", "debug.check_replicas=true", *QUICK, "seed=3", "optimizer=sgd", "optimizer.lr=0.05",
              "data.val_fraction=0.2005"]  # fmt: skip
    proc = run_ddpexp(*common, "gpus=2", "batch_size=32", f"hydra.run.dir={two}", cwd=tmp_path, wandb=True)
    summary = check_run_record(two, "spawn", 2)
    assert summary["steps"] == 2 * 23 and summary["val_samples"] == 360  # 22 steps of 2 x 32, then 29 samples
    assert summary["train_samples_per_epoch"] == [1437, 1437]
    assert f"val/acc={summary['final']['val/acc']:.4f}" in proc.stdout
    metrics = read_metrics(two)
    assert [m["step"] for m in metrics if "val/acc" in m] == [23, 46]
    assert all(m["lr"] == 0.05 and m["samples_per_s"] > 0 for m in metrics if "train/loss" in m)
    check_wandb_matches_record(two)

    single = run_ddpexp(*common, "gpus=1", "batch_size=64", f"hydra.run.dir={one}", cwd=tmp_path)
    assert read_summary(one)["world_size"] == 1
    for out in (proc.stdout, single.stdout):  # in-process (gpus=1) or spawned, rank 0 logs in one format, once
        lines = [line for line in out.splitlines() if "epoch 0 step 5: train/loss" in line]
        assert len(lines) == 1 and re.match(r"\[\d\d:\d\d:\d\d\]\[rank0\] epoch 0 step 5: train/loss", lines[0]), out
        # Where the run is, its pace and its ETA: from the first step on, then in each log line.
        assert re.search(r"\| 11% of 46 steps, [\d.e+]+ steps/s, ETA \d+:\d\d:\d\d$", lines[0]), lines[0]
        assert re.search(
            r"\]\[rank0\] epoch 0 step 1: started \| 2% of 46 steps, [\d.e+]+ steps/s, ETA \d+:\d\d:\d\d\n", out
        )
    w2, w1 = load_weights(two), load_weights(one)
    assert w2.keys() == w1.keys()
    max_diff = max((w2[k] - w1[k]).abs().max().item() for k in w1)
    assert 0 < max_diff < 1e-5 or max_diff == 0, max_diff
    first_change = [k for k in w1 if not w1[k].eq(load_init(one, k)).all()]
    assert first_change, "training changed no weight: the comparison would prove nothing"


def load_init(job: Path, key: str):  # type: ignore[no-untyped-def]
    """The seeded initial value of one parameter, rebuilt the way the worker builds the model."""
    import torch

    from ddpexp.parts import models

    torch.manual_seed(3)
    return models.cnn(10, 1, 8).state_dict()[key]


def test_torchrun_two_ranks_on_torchvision_mnist(tmp_path: Path) -> None:
    write_mnist_idx(tmp_path / "data")
    job = tmp_path / "job"
    run_ddpexp(
        "launcher=torchrun", "gpus=2", "data=mnist", f"data.root={tmp_path / 'data'}", "model=mlp",
        "debug.check_replicas=true", "epochs=3", "batch_size=30", f"hydra.run.dir={job}", cwd=tmp_path, wandb=True,
    )  # fmt: skip
    summary = check_run_record(job, "torchrun", 2)
    assert summary["val_samples"] == 101  # odd: exact eval counts each sample once
    assert summary["final"]["val/acc"] > 0.5 and summary["restarts"] == 0
    check_wandb_matches_record(job)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_two_nodes_on_loopback(tmp_path: Path) -> None:
    """Two elastic agents, the same command on each "node", form one job of world size 4."""
    endpoint = f"127.0.0.1:{free_port()}"
    args = ["launcher=torchrun", "gpus=2", "launcher.nnodes=2", f"launcher.rdzv_endpoint={endpoint}",
            "max_steps=6", "debug.check_replicas=true", "wandb.mode=disabled"]  # fmt: skip
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", "ddpexp", *args, f"hydra.run.dir={tmp_path / f'node{n}'}"],
            cwd=tmp_path,
            env=ddpexp_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for n in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=150)[0] for p in nodes]
    finally:
        for p in nodes:
            p.kill()
    assert [p.returncode for p in nodes] == [0, 0], outputs
    records = [d for d in tmp_path.glob("node*") if (d / "summary.json").exists()]
    assert len(records) == 1  # only global rank 0 writes the run record
    summary = read_summary(records[0])
    assert summary["world_size"] == 4 and summary["replicas"]["identical"] and summary["steps"] == 6
    logs = sorted(p.name for p in tmp_path.glob("node*/logs/rank*.log"))
    assert logs == ["rank0.log", "rank1.log", "rank2.log", "rank3.log"]


def test_one_torchrun_node_of_two_says_it_waits_and_gives_up_after_the_rendezvous_timeout(tmp_path: Path) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    args = ["launcher=torchrun", "gpus=2", "launcher.nnodes=2", f"launcher.rdzv_endpoint={endpoint}",
            "launcher.rdzv_timeout_s=5", "wandb.mode=disabled", "hydra.run.dir=job"]  # fmt: skip
    proc = start(args, tmp_path)
    try:
        assert select.select([proc.stdout], [], [], 60)[0], "said nothing for 60 s"
        said = proc.stdout.readline()  # type: ignore[union-attr]
        began = time.time()
        out, err = proc.communicate(timeout=90)
        waited = time.time() - began
    finally:
        proc.kill()
    assert said == (
        f"ddpexp: waiting for 1 more node(s) at the rendezvous {endpoint} (launcher.nnodes=2), "
        "for at most launcher.rdzv_timeout_s=5 s\n"
    )
    assert proc.returncode == 2 and 4 < waited < 45, (waited, out, err)
    assert err == (
        f"ddpexp: error: launcher.nnodes=2: fewer than 2 node(s) joined the rendezvous at {endpoint} within "
        "launcher.rdzv_timeout_s=5 s; start the same command (same launcher.rdzv_endpoint and rdzv_id) on every node\n"
    )
    assert read_summary(tmp_path / "job")["status"] == "failed" and not (tmp_path / "job" / "logs").exists()


def test_multirun_sweep_runs_full_ddp_jobs_in_one_wandb_group(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    run_ddpexp(
        "-m", "optimizer.lr=1e-3,3e-3", "model=cnn,mlp", "max_steps=4", "gpus=2", f"hydra.sweep.dir={sweep}",
        cwd=tmp_path, timeout=240, wandb=True,
    )  # fmt: skip
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir())
    assert [j.name for j in jobs] == ["0", "1", "2", "3"]
    assert all((j / ".hydra" / "overrides.yaml").exists() for j in jobs) and len(list(sweep.rglob(".hydra"))) == 4
    runs = [read_offline_run(r) for r in find_offline_runs(sweep)]
    assert len(runs) == 4 and {r["group"] for r in runs} == {str(sweep)}
    assert sorted(r["name"] for r in runs) == sorted(
        f"model={m},optimizer.lr={lr}" for m in ("cnn", "mlp") for lr in ("0.001", "0.003")
    )
    for job in jobs:
        summary = read_summary(job)
        assert (summary["status"], summary["world_size"], summary["steps"]) == ("completed", 2, 4)
        overrides = yaml.safe_load((job / ".hydra" / "overrides.yaml").read_text())
        config = yaml.safe_load(ckpt_config(job))  # what the ranks trained with is what this job was given
        assert f"optimizer.lr={config['optimizer']['lr']}" in overrides
        assert f"model={config['model']['_target_'].split('.')[-1]}" in overrides


def test_wandb_online_without_network_falls_back_to_offline(tmp_path: Path) -> None:
    """An API key but no reachable server: warn, keep the run offline, finish training."""
    env_key = "0" * 40
    # wandb.init alone would wait ~100 s without wandb.init_timeout_s: past this process's hard timeout.
    proc = subprocess.run(
        [sys.executable, "-m", "ddpexp", "gpus=1", "max_steps=3", "wandb.init_timeout_s=5", "hydra.run.dir=job"],
        cwd=tmp_path, env={**ddpexp_env(wandb=True), "WANDB_API_KEY": env_key}, capture_output=True, text=True, timeout=80,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "W&B online init failed" in proc.stdout + proc.stderr
    summary = read_summary(tmp_path / "job")
    assert summary["status"] == "completed" and summary["wandb"]["mode"] == "offline"
    assert read_offline_run(Path(summary["wandb"]["dir"]))["summary"]["val/acc"] == summary["final"]["val/acc"]


_SERVICE_DIES = """
import json, os, signal, sys, time
from ddpexp.config import WandbConfig
from ddpexp.job import Job
from ddpexp.rank.tracking import Tracker
from ddpexp.trackers.wandb import WandbTrackerConfig

job = Job(dir=sys.argv[1], name="n", group=None, launcher="spawn", config_yaml="a: 1\\n")
wandb = WandbTrackerConfig()
wandb.settings = WandbConfig(mode="offline")
tracker = Tracker(job, {"wandb": wandb}, {"a": 1}, progress_bar=False)
tracker.log({"train/loss": 1.0}, step=1, epoch=0)
for pid in os.listdir("/proc"):  # wandb-core, as a job's SIGTERM to all its processes would end it
    if pid.isdigit() and open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1] == str(os.getpid()):
        os.kill(int(pid), signal.SIGTERM)
time.sleep(1)
for step in range(2, 6):
    tracker.log({"train/loss": 1.0 / step}, step=step, epoch=0)
tracker.finish({"status": "completed"})
"""


def test_a_dying_wandb_service_leaves_training_and_the_local_record_intact(tmp_path: Path) -> None:
    """Slurm's scancel signals every process of a step, W&B's service too: the loop must not die with it."""
    proc = subprocess.run(
        [sys.executable, "-c", _SERVICE_DIES, str(tmp_path)],
        env=ddpexp_env(wandb=True), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("W&B failed (ConnectionResetError") == 1 and "Traceback" not in proc.stderr
    assert [m["step"] for m in read_metrics(tmp_path)] == [1, 2, 3, 4, 5]
    summary = read_summary(tmp_path)
    assert summary["status"] == "completed" and summary["wandb"]["failed"].startswith("ConnectionResetError")


@pytest.mark.parametrize("launcher", ["spawn", "torchrun"])
def test_no_rank_outlives_a_sigkilled_command(tmp_path: Path, launcher: str) -> None:
    """SIGKILL of `python -m ddpexp`, started with SIGINT ignored (as `cmd &` in a script): ranks die too."""
    import signal
    import time

    proc = subprocess.Popen(
        [sys.executable, "-m", "ddpexp", f"launcher={launcher}", "gpus=2", "epochs=1000", "wandb.mode=disabled",
         "hydra.run.dir=job"],
        cwd=tmp_path, env=ddpexp_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )  # fmt: skip
    try:
        deadline = time.time() + 90
        log = tmp_path / "job" / "logs" / "rank1.log"
        while time.time() < deadline and not (log.exists() and "train/loss" in log.read_text()):
            time.sleep(0.5)
        assert log.exists() and "train/loss" in log.read_text(), "ranks never started training"
        ranks = [pid for kid in children_of(proc.pid) for pid in [kid, *children_of(kid)]]
        assert len([p for p in ranks if alive(p)]) >= 2
        proc.kill()
        proc.wait()
        time.sleep(5)
        assert [p for p in ranks if alive(p)] == []
    finally:
        proc.kill()
