"""`python -m ddpexp.bench` at a tiny size: it runs A, B and C end to end and B's and C's weights are bit-equal.

Never a speed threshold: the figures are the benchmark's to print (README, "Performance")."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import ddpexp_env
from ddpexp.bench.digits import has_mnist, write_mnist_idx


def test_the_synthetic_digits_are_mnist_files_torchvision_reads(tmp_path: Path) -> None:
    from torchvision.datasets import MNIST

    write_mnist_idx(tmp_path / "a", n_train=500, n_test=60, seed=1)
    write_mnist_idx(tmp_path / "b", n_train=500, n_test=60, seed=1)
    write_mnist_idx(tmp_path / "c", n_train=500, n_test=60, seed=2)
    assert has_mnist(tmp_path / "a") and not has_mnist(tmp_path)
    train, test = MNIST(str(tmp_path / "a"), train=True), MNIST(str(tmp_path / "a"), train=False)
    assert tuple(train.data.shape) == (500, 28, 28) and tuple(test.data.shape) == (60, 28, 28)
    assert sorted(set(train.targets.tolist())) == list(range(10))
    images = train.data.numpy().astype(int)
    assert len({im.tobytes() for im in images}) == 500  # no two alike
    # a digit's ink: its mean image differs from every other digit's (the labels mean something)
    means = np.stack([images[train.targets.numpy() == d].mean(0) for d in range(10)])
    gaps = [np.abs(means[i] - means[j]).mean() for i in range(10) for j in range(i + 1, 10)]
    assert min(gaps) > 5
    same = MNIST(str(tmp_path / "b"), train=True)
    other = MNIST(str(tmp_path / "c"), train=True)
    assert (same.data == train.data).all() and not (other.data == train.data).all()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_benchmark_runs_all_three_loops_and_b_equals_c(tmp_path: Path) -> None:
    cmd = [
        sys.executable, "-m", "ddpexp.bench", "--world-sizes", "2", "--steps", "6", "--warmup", "2",
        "--repeats", "1", "--n-train", "400", "--n-test", "50", "--root", "data", "--out", "out", "--lightning",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, env=ddpexp_env(), capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    per = results["by_world_size"]["2"]
    assert per["b_equals_c"] is True
    assert results["loops"] == "ABCD"
    for loop in "ABCD":
        assert per[loop]["samples_per_s"] > 0 and 0 < per[loop]["first_step_s"] < 120
        assert len(per[loop]["peak_rss_mb"]) == 2 and min(per[loop]["peak_rss_mb"]) > 50
    # every loop but the tutorial's splits the cores between the ranks (Lightning does it itself)
    assert per["C"]["threads_per_rank"] == max(1, len(os.sched_getaffinity(0)) // 2)
    assert per["B"]["threads_per_rank"] == per["C"]["threads_per_rank"] == per["D"]["threads_per_rank"]
    assert set(results["ratios"]) == {
        "C / B samples/s, world size 2", "C / A samples/s, world size 2", "C / D samples/s, world size 2",
        "C - B first step s, world size 2",
    }  # fmt: skip
    md = (tmp_path / "out" / "results.md").read_text()
    assert md in proc.stdout and "| 2 | C (ddpexp) |" in md and "| 2 | D (lightning) |" in md and "bit-equal" in md
    # C's run record says which path it took: the in-memory one, fp32 on the CPU, glibc keeping freed memory
    summary = json.loads((tmp_path / "out" / "runs" / "ws2-C-0" / "summary.json").read_text())
    assert summary["data_path"] == "InMemoryLoader" and summary["precision"] == "fp32"
    assert summary["keep_freed_memory"] is True
    # DDP's own bucketing: the head's gradients (first ready) fill a first bucket, all-reduced during the convs' backward
    from ddpexp.bench.loops import build_model

    sizes = [p.numel() * p.element_size() for p in build_model("cnn").parameters()]
    assert summary["ddp_buckets"] == [sum(sizes[4:]), sum(sizes[:4])]


def test_a_loop_that_crashes_once_is_run_again_and_counted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from ddpexp.bench import __main__ as bench

    marker, out = tmp_path / "crashed-once", tmp_path / "run"
    script = (
        "import json, os, sys, time\n"
        f"m, out = {str(marker)!r}, {str(out)!r}\n"
        "if not os.path.exists(m):\n"
        "    open(m, 'w').close(); sys.exit(134)\n"
        "os.makedirs(out, exist_ok=True)\n"
        "json.dump({'first_step_at': time.time(), 'samples_per_s': 5.0, 'peak_rss_mb': [1.0]},"
        " open(os.path.join(out, 'result.json'), 'w'))\n"
    )
    monkeypatch.setattr(bench, "command", lambda *a: [sys.executable, "-c", script])
    result = bench.run_one("A", argparse.Namespace(timeout=60), 1, out)
    assert marker.exists() and result["attempts"] == 2 and result["samples_per_s"] == 5.0


def test_lightning_asked_for_but_missing_is_one_line(monkeypatch: pytest.MonkeyPatch, capsys) -> None:  # type: ignore[no-untyped-def]
    import importlib.util

    from ddpexp.bench import __main__ as bench

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "lightning" else real(name, *a))
    with pytest.raises(SystemExit) as e:
        bench.main(["--lightning"])
    assert e.value.code == 2
    assert capsys.readouterr().err == (
        "python -m ddpexp.bench: error: --lightning: Lightning is not installed (pip install -e '.[bench]')\n"
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ddp_cost_runs_the_variants_and_only_ddp_keeps_the_replicas_equal(tmp_path: Path) -> None:
    """`python -m ddpexp.bench.ddp_cost`: the un-reduced comm hook really skips the all-reduce (the ranks end with
    different weights), DDP's all-reduce keeps them equal; every rank's busy figures are read back."""
    write_mnist_idx(tmp_path / "data", n_train=400, n_test=50, seed=0)
    cmd = [
        sys.executable, "-m", "ddpexp.bench.ddp_cost", "--root", "data", "--pairs", "1", "--steps", "6",
        "--warmup", "2", "--batch", "32", "--variants", "ddp", "unsynced", "--out", "cost.json",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, env=ddpexp_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    runs = json.loads((tmp_path / "cost.json").read_text())["runs"]
    assert set(runs) == {"ddp", "unsynced"}
    (ddp,), (unsynced,) = runs["ddp"], runs["unsynced"]
    assert ddp["replicas_identical"] is True and unsynced["replicas_identical"] is False
    for r in (ddp, unsynced):
        assert r["samples_per_s"] > 0 and len(r["process_busy"]) == len(r["main_thread_busy"]) == 2
        assert all(0 < m <= p + 0.01 for m, p in zip(r["main_thread_busy"], r["process_busy"]))
    assert "| ddp |" in proc.stdout and "| +0.0% |" in proc.stdout and "| unsynced |" in proc.stdout


def test_ddp_cost_without_data_is_one_line(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    from ddpexp.bench import ddp_cost

    with pytest.raises(SystemExit) as e:
        ddp_cost.main(["--root", str(tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith(f"--root {tmp_path}: no MNIST files (run python -m ddpexp.bench once, or point at MNIST)")


def test_paired_summarizes_the_pairs_and_refuses_a_tree_without_ddpexp(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    from ddpexp.bench import paired

    s = paired.summarize([(100.0, 90.0), (100.0, 110.0), (200.0, 190.0)])
    assert (s["pairs"], s["median_before"], s["median_after"], s["slower_after"]) == (3, 100.0, 110.0, 2)
    assert abs(s["mean_change"] - (-0.1 + 0.1 - 0.05) / 3) < 1e-12
    assert abs(s["se_change"] - np.std([-0.1, 0.1, -0.05], ddof=1) / 3**0.5) < 1e-12
    assert "mean paired change -1.7 %" in paired.line(2, s) and "slower after in 2 of 3 pairs" in paired.line(2, s)
    with pytest.raises(SystemExit) as e:
        paired.main(["--before", str(tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith(f"--before {tmp_path}: no ddpexp package there (give the src folder of a checkout)")
