"""Shared test helpers: run `python -m ddpexp` as a user would, in a temp dir, and read its run record."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from wandb_offline import find_offline_runs, read_offline_run

ROOT = Path(__file__).resolve().parents[1]


def ddpexp_env(wandb: bool = False) -> dict[str, str]:
    """The environment of a test's command. W&B is off (WANDB_MODE=disabled, which ddpexp reads where wandb.mode
    keeps its default) unless the test reads W&B's run back: its service costs each run about a second of CPU on
    this suite's 2 cores. With `wandb=True`, wandb.mode=auto picks offline (no API key), as on a user's machine."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "TORCHELASTIC_", "HYDRA_"))}
    env.update(PYTHONUNBUFFERED="1", WANDB_SILENT="true", CUDA_VISIBLE_DEVICES="")  # the CPU/gloo path, on any host
    if not wandb:
        env["WANDB_MODE"] = "disabled"
    return env


def run_ddpexp(
    *args: str,
    cwd: Path,
    timeout: float = 120,
    check: bool = True,
    env: dict[str, str] | None = None,
    wandb: bool = False,
) -> subprocess.CompletedProcess[str]:
    """The command line, in a fresh process: a multi-process test must never hang the suite."""
    proc = subprocess.run(
        [sys.executable, "-m", "ddpexp", *args],
        cwd=cwd, env={**ddpexp_env(wandb), **(env or {})}, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    if check and proc.returncode != 0:
        raise AssertionError(f"ddpexp {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


def make_config(*overrides: str) -> Any:
    """The typed Config the parent builds from ddpexp's conf/ and these overrides (no job runs)."""
    from hydra import compose, initialize_config_dir

    from ddpexp.parent.launch import to_config
    from ddpexp.parent.schema import register_configs

    register_configs()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return to_config(compose("config", overrides=list(overrides)))


def read_summary(job_dir: Path) -> dict[str, Any]:
    return json.loads((job_dir / "summary.json").read_text())


def read_metrics(job_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (job_dir / "metrics.jsonl").read_text().splitlines()]


def load_weights(job_dir: Path) -> dict[str, Any]:
    import torch

    return torch.load(job_dir / "checkpoints" / "last.pt", weights_only=True)["model"]


CLASSIFICATION = {"train/loss", "val/loss", "val/acc"}  # what task=classification records


def check_run_record(job: Path, launcher: str, world_size: int, metrics: set[str] = CLASSIFICATION) -> dict:
    summary = read_summary(job)
    assert summary["status"] == "completed", summary
    assert (summary["launcher"], summary["world_size"], summary["device"]) == (launcher, world_size, "cpu")
    assert summary["replicas"]["identical"] and summary["replicas"]["max_abs_diff"] == 0.0
    assert set(summary["final"]) == metrics
    assert summary["versions"]["torch"] and summary["hostnames"] and summary["wall_time_s"] > 0
    from ddpexp.rank.speed import cpu_quota  # the container's CPU quota, as the ranks read it (null: none)

    assert "cpu_quota" in summary and summary["cpu_quota"] == cpu_quota()
    assert sorted(p.name for p in (job / "logs").iterdir()) == [f"rank{r}.log" for r in range(world_size)]
    assert (job / ".hydra" / "config.yaml").exists() and len(list(job.rglob(".hydra"))) == 1
    ckpt = __import__("torch").load(job / "checkpoints" / "last.pt", weights_only=True)
    assert {"model", "optimizer", "scheduler", "scaler", "epoch", "step", "rng", "config"} <= set(ckpt)
    assert ckpt["step"] == summary["steps"] and yaml.safe_load(ckpt["config"])["launcher"]["_target_"]
    return summary


def check_wandb_matches_record(job: Path) -> dict:
    """The W&B offline run, read back with wandb's own reader, holds the resolved config and metrics.jsonl."""
    runs = find_offline_runs(job / "wandb")
    assert len(runs) == 1
    run = read_offline_run(runs[0])
    summary, metrics = read_summary(job), read_metrics(job)
    assert run["id"] == summary["wandb"]["id"] and summary["wandb"]["mode"] == "offline"
    assert run["config"] == yaml.safe_load(ckpt_config(job))
    by_step: dict[int, dict] = {}
    for row in metrics:
        by_step.setdefault(row["step"], {}).update(row)
    history = {row["_step"]: row for row in run["history"]}
    assert sorted(history) == sorted(by_step)
    for step, row in by_step.items():
        for key, value in row.items():  # every metric the task logged, throughput too (the same numbers)
            if key != "step":
                assert history[step][key] == pytest.approx(value, rel=1e-12), (step, key)
    for key, value in summary["final"].items():
        assert run["summary"][key] == pytest.approx(value), key
    return run


def mtimes(*dirs: Path) -> dict[Path, int]:
    """Every file and link under `dirs` with its own mtime, not a link's target's: W&B links a run's
    logs/debug-core.log to a log in ~/.cache/wandb that every W&B service started in the same second writes to."""
    return {p: p.lstat().st_mtime_ns for d in dirs for p in d.rglob("*") if p.is_symlink() or not p.is_dir()}


def ckpt_config(job: Path) -> str:
    import torch

    return torch.load(job / "checkpoints" / "last.pt", weights_only=True)["config"]


def children_of(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def start(args: list[str], cwd: Path, env: dict[str, str] | None = None, wandb: bool = False) -> subprocess.Popen[str]:
    """As from a terminal: its own process group, which a Ctrl-C signals as a whole."""
    return subprocess.Popen(
        [sys.executable, "-m", "ddpexp", *args], cwd=cwd, env={**ddpexp_env(wandb), **(env or {})}, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip


def wait_for_step(job: Path, step: int, proc: subprocess.Popen[str], timeout: float = 90) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        metrics = job / "metrics.jsonl"
        if metrics.exists() and any(m["step"] >= step for m in read_metrics(job)):
            return
        time.sleep(0.2)
    raise AssertionError(f"never reached step {step}: {proc.communicate(timeout=30)}")


# The suite runs on 2 xdist workers (pyproject's addopts): most of its time is spent waiting on processes that
# start, rendezvous, time out or get signalled. A test file runs whole on one worker (its module fixtures once);
# the tests that use the session's Slurm cluster run on one worker together, which starts it once, and so do those
# that use its Ray head (test_launchers.py's contract classes go with their launcher's files): two scopes, which
# the workers take first, then the files, so neither worker waits on the other at the end.
LONGEST = (
    "test_faults",
    "test_launchers",
    "test_trackers",
    "test_e2e",
    "test_fsdp2",
    "test_tasks",
    "test_exact_samples",
    "test_bench",
    "test_legacy_project",
    "test_config",
    "test_multirun",
    "test_evaluate",
)
SLURM_FILES = frozenset({"test_env_launcher.py", "test_readme.py", "test_slurm.py"})
RAY_FILES = frozenset({"test_ray.py"})


def scope_of(nodeid: str) -> str:
    file, _, rest = nodeid.partition("::")
    name = Path(file).name
    if name in SLURM_FILES or (name == "test_launchers.py" and rest.startswith("TestContractSlurm")):
        return "slurm"
    if name in RAY_FILES or (name == "test_launchers.py" and rest.startswith("TestContractRay")):
        return "ray"
    return file


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    class ByScope(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid)

    return ByScope(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:  # a second worker must never start a second cluster
        for fixture, scope in (("slurm", "slurm"), ("ray_head", "ray")):
            if fixture in getattr(item, "fixturenames", ()) and scope_of(item.nodeid) != scope:
                raise pytest.UsageError(f"{item.nodeid} uses {fixture}: add {item.path.name} to conftest's scope_of")
    # The two longest scopes go out first, then the files longest first (measured here), so the last file a worker
    # takes is a short one and neither waits long on the other at the end; a stable sort keeps each file's order.
    first = {scope: n for n, scope in enumerate(("slurm", "ray", *(f"tests/{name}.py" for name in LONGEST)))}
    items.sort(key=lambda item: first.get(scope_of(item.nodeid), len(first)))


def until(condition: Callable[[], bool], proc: subprocess.Popen[str], timeout: float = 120) -> None:
    """Poll `condition` while `proc` runs, for at most `timeout` s (the asserts after say what did not happen)."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None and not condition():
        time.sleep(0.1)


def ctrl_c(proc: subprocess.Popen[str], ready: Callable[[], None], wait: float = 120) -> tuple[str, str]:
    """The terminal's Ctrl-C to a command `start` began: SIGINT to its process group once `ready()` returns; what
    the command printed. The command is killed if anything here fails."""
    try:
        ready()
        os.killpg(proc.pid, signal.SIGINT)
        return proc.communicate(timeout=wait)
    finally:
        proc.kill()


# Small, quick runs on the real digits: 2 epochs of 12 steps at batch 64 per rank.
QUICK = ["epochs=2", "log_every_n_steps=5"]


@pytest.fixture
def quick() -> list[str]:
    return list(QUICK)


# The faults' runs (test_faults, test_slurm): 2 ranks x 12 steps per epoch x 2 epochs; a checkpoint every 5
# steps, so step 15 is mid-epoch 1. The mlp has dropout: resuming must restore every rank's RNG streams too.
COMMON = ["gpus=2", "model=mlp", "model.dropout=0.3", "epochs=2", "log_every_n_steps=2",
          "checkpoint_every_n_steps=5", "seed=1"]  # fmt: skip


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("reference")
    run_ddpexp("launcher=spawn", *COMMON, "hydra.run.dir=ref", cwd=root, wandb=True)  # a W&B run of its own
    return root / "ref"


def assert_same_run(job: Path, reference: Path) -> None:
    """Bit-equal weights, and the same metrics at the same steps, once each (throughput aside)."""
    import torch

    ours, ref = load_weights(job), load_weights(reference)
    assert ours.keys() == ref.keys() and all(torch.equal(ours[k], ref[k]) for k in ref)
    strip = lambda rows: [{k: v for k, v in r.items() if not k.endswith("_per_s")} for r in rows]  # noqa: E731
    assert strip(read_metrics(job)) == strip(read_metrics(reference))
    assert read_summary(job)["final"] == read_summary(reference)["final"]


def check_sharded_run(job: Path, world_size: int, reference: Path | None = None) -> dict[str, Any]:
    """A completed strategy=fsdp2 job: its last checkpoint holds each rank's shards and no whole model; with a ddp
    `reference` of the same seed, data and steps, the same model up to float order (test_fsdp2.py's bound)."""
    import torch

    from ddpexp import load_model

    summary = read_summary(job)
    assert (summary["status"], summary["world_size"], summary["strategy"]["name"]) == ("completed", world_size, "fsdp2")
    last = (job / "checkpoints" / "last.pt").resolve()
    assert sorted(p.name for p in last.glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(world_size)]
    assert "model" not in torch.load(last / "state.pt", weights_only=True)
    if reference is not None:
        ours, ref = load_model(str(job), "last").state_dict(), load_weights(reference)
        assert ours.keys() == ref.keys() and max((ours[k] - ref[k]).abs().max().item() for k in ref) <= 2e-4
        assert [m["step"] for m in read_metrics(job)] == [m["step"] for m in read_metrics(reference)]
    return summary


def free_port_block(n: int) -> int:
    """A base port with `n` consecutive free ports (the test cluster's slurmctld + one slurmd per node)."""
    import socket

    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n >= 65535:
            continue
        try:
            for port in range(base, base + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
    raise RuntimeError("no block of free ports")


CLUSTER = ROOT / "tests" / "slurm" / "cluster.sh"


def scontrol_job(job_id: str, env: dict[str, str]) -> dict[str, str]:
    out = subprocess.run(["scontrol", "-o", "show", "job", job_id], env=env, capture_output=True, text=True).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


@pytest.fixture(scope="session")
def slurm() -> Iterator[dict[str, str]]:
    """A real Slurm cluster (slurmctld + 2 slurmd on 127.0.0.x) for this session; the env to reach it.

    Started and stopped by tests/slurm/cluster.sh, which stops only the daemons it started (pid files)."""
    import shutil

    if not all(shutil.which(b) for b in ("slurmctld", "slurmd", "munged", "sbatch")):
        pytest.skip("Slurm is not installed here: `bash tests/slurm/cluster.sh install` (CI does)")
    # Fresh state (job ids start at 1, so each test's submitit folder is its own). Not under pytest's 0700 tmp:
    # munged wants every directory above its socket searchable by all.
    state = tempfile.mkdtemp(prefix="ddpexp-slurm-")
    os.chmod(state, 0o755)
    env = {**os.environ, "DDPEXP_SLURM_DIR": str(state), "DDPEXP_SLURM_PORT": str(free_port_block(3))}
    started = subprocess.run(["bash", str(CLUSTER), "start"], env=env, timeout=120, capture_output=True, text=True)
    if started.returncode != 0:
        raise RuntimeError(f"tests/slurm/cluster.sh start failed:\n{started.stdout}\n{started.stderr}")
    exports = subprocess.run(["bash", str(CLUSTER), "env"], env=env, check=True, capture_output=True, text=True)
    cluster_env = {"DDPEXP_SLURM_DIR": str(state), "DDPEXP_SLURM_PORT": env["DDPEXP_SLURM_PORT"]}
    for line in exports.stdout.splitlines():
        key, _, value = line.removeprefix("export ").partition("=")
        cluster_env[key] = value.replace("$PATH", os.environ["PATH"])
    try:
        yield cluster_env
    finally:
        subprocess.run(["bash", str(CLUSTER), "stop"], env=env, timeout=120, capture_output=True)
        shutil.rmtree(state, ignore_errors=True)


def descendants(pids: set[int]) -> set[int]:
    found, todo = set(pids), list(pids)
    while todo:
        for kid in children_of(todo.pop()):
            if kid not in found:
                found.add(kid)
                todo.append(kid)
    return found


def in_group(pgid: int) -> set[int]:
    pids = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[2]) == pgid:
                pids.add(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return pids


RAY_STOP = pytest.StashKey[Callable[[], None]]()


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """After the session's last test that uses the Ray head, stop it: its idle processes take ~5 % of a core for
    as long as they live, and the ray scope runs first, so otherwise they would live through this worker's session."""
    uses = [i for i in item.session.items if "ray_head" in getattr(i, "fixturenames", ())]
    if uses and item is uses[-1] and RAY_STOP in item.config.stash:
        item.config.stash[RAY_STOP]()


@pytest.fixture(scope="session")
def ray_head(request: pytest.FixtureRequest) -> Iterator[dict[str, str]]:
    """A real Ray head (2 CPUs, on loopback) for this session; the env that points launcher=ray at it.

    Stopped by its own processes (the group `ray start` made, and their children: the actors' workers, which
    leave that group), never by `ray stop`, which would stop every Ray runtime of this machine's user."""
    import contextlib
    import shutil
    import signal
    from importlib.util import find_spec

    if find_spec("ray") is None:
        pytest.skip("Ray is not installed here: pip install -e '.[ray]'")
    temp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
    port = free_port_block(1)
    env = {**ddpexp_env(wandb=True), "RAY_AUTH_MODE": "disabled"}  # test_ray reads its runs' W&B back
    command = [str(Path(sys.executable).parent / "ray"), "start", "--head", "--num-cpus=2", "--include-dashboard=false",
               "--disable-usage-stats", f"--temp-dir={temp}", f"--port={port}", "--node-ip-address=127.0.0.1"]  # fmt: skip
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip

    def stop() -> None:  # once: after the last test that uses it (pytest_runtest_teardown), or at the session's end
        proc.kill()
        ours = descendants(in_group(proc.pid))
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in ours:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            deadline = time.time() + 5
            while time.time() < deadline and any(alive(p) for p in ours):
                time.sleep(0.2)
        shutil.rmtree(temp, ignore_errors=True)
        request.config.stash[RAY_STOP] = lambda: None

    request.config.stash[RAY_STOP] = stop
    try:
        out, _ = proc.communicate(timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"ray start failed:\n{out}")
        yield {**env, "RAY_ADDRESS": f"127.0.0.1:{port}"}
    finally:
        request.config.stash[RAY_STOP]()
