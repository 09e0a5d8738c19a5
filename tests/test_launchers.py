"""The launcher contract (ddpexp.testing.LauncherContract) on every launcher ddpexp finds, on a user project's own
launcher (examples/myproject: launcher=nice, which wraps spawn) and on one an installed package brings through the
`ddpexp.launchers` entry points; a module that breaks the contract is refused in one line naming what it lacks."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, ddpexp_env, read_summary, run_ddpexp, scontrol_job
from ddpexp.launchers import launcher_modules
from ddpexp.testing import LauncherContract

EXAMPLE = ROOT / "examples" / "myproject"


def slurm_failed(self: LauncherContract, proc: subprocess.CompletedProcess[str], job: Path) -> None:
    """Slurm's state of the failed job, as the command says and as scontrol says."""
    assert "line" in proc.stderr  # the traceback's tail
    job_id = re.search(r"submitted Slurm job (\d+)", proc.stdout).group(1)  # type: ignore[union-attr]
    assert f"Slurm job {job_id} ended FAILED" in proc.stdout
    assert scontrol_job(job_id, self.slurm_env)["JobState"] == "FAILED"


def slurm_env(self: LauncherContract, slurm: dict[str, str]) -> dict[str, str]:
    self.slurm_env = {**ddpexp_env(), **slurm}  # type: ignore[attr-defined]
    return self.slurm_env  # type: ignore[attr-defined]


def contract_for(name: str, module: str) -> type:
    """A LauncherContract subclass for one of ddpexp's launchers, found as ddpexp finds them (not a fixed list)."""
    attrs: dict[str, object] = {"launcher": name, "module": module, "overrides": ("device=cpu",)}
    if name == "slurm":  # on the local test cluster (tests/slurm/cluster.sh)
        attrs["launcher_env"] = pytest.fixture(slurm_env)
        attrs["overrides"] = ("device=cpu", "launcher.poll_interval_s=0.5")
        attrs["pytestmark"] = [pytest.mark.slurm, pytest.mark.slow]
    elif name == "ray":  # on the session's Ray head (RAY_ADDRESS), which the contract's runs share
        attrs["launcher_env"] = pytest.fixture(lambda self, ray_head: ray_head)
        attrs["pytestmark"] = [pytest.mark.ray, pytest.mark.slow]
    else:
        attrs["launcher_env"] = pytest.fixture(lambda self: ddpexp_env())
        attrs["pytestmark"] = [pytest.mark.slow]
    if name == "env":  # each rank a command that torchrun starts (each shows its failure, and torchrun its own)
        attrs["starter"] = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2")
        attrs["tracebacks_shown"] = None
    if name == "slurm":
        attrs["check_failed"] = slurm_failed
    return type(f"TestContract{name.title()}", (LauncherContract,), attrs)


for _name, _module in launcher_modules().items():
    globals()[f"TestContract{_name.title()}"] = contract_for(_name, _module)


def test_every_launcher_module_is_under_contract() -> None:
    assert {"spawn", "torchrun", "slurm", "ray"} <= set(launcher_modules())
    assert all(f"TestContract{n.title()}" in globals() for n in launcher_modules())


@pytest.mark.slow
class TestProjectLauncher(LauncherContract):
    """A launcher in the user's own project (conf/launcher/nice.yaml names myproject.launcher.launch)."""

    launcher, module, config_dir = "nice", "myproject.launcher", str(EXAMPLE / "conf")

    @pytest.fixture
    def launcher_env(self) -> dict[str, str]:
        return ddpexp_env()  # the command puts the project on its path; this process imports it for the module check

    @pytest.fixture(autouse=True)
    def _importable_here(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.syspath_prepend(str(EXAMPLE))

    def test_its_ranks_run_niced_and_the_record_says_so(self, tmp_path: Path, launcher_env: dict[str, str]) -> None:
        proc = self.ddpexp(tmp_path, launcher_env, "hydra.run.dir=job", "launcher.niceness=7")
        assert proc.returncode == 0, proc.stderr
        summary = read_summary(tmp_path / "job")
        assert summary["launcher"] == "nice" and summary["niceness"] == 7 and summary["world_size"] == 2
        proc = self.ddpexp(tmp_path, launcher_env, "launcher.niceness=30")
        assert (proc.returncode, proc.stderr) == (2, "ddpexp: error: launcher.niceness=30: must be 0..19\n")
        proc = self.ddpexp(tmp_path, launcher_env, "+launcher.nicenes=3")
        assert proc.returncode == 2 and proc.stderr == (
            "ddpexp: error: +launcher.nicenes: no such key (did you mean launcher.niceness?) (NiceConfig)\n"
        )


BROKEN = {
    # (module source, what the one line says it lacks)
    "nolaunch": ("from ddpexp.launchers.spawn import plan, resolve, world_size, SpawnConfig as NolaunchConfig\n",
                 "it lacks launch()"),
    "noschema": ("from ddpexp.launchers.spawn import launch, plan, resolve, world_size\n",
                 "it lacks a NoschemaConfig dataclass"),
    "bare": ("", "it lacks resolve(), world_size(), plan(), launch(), a BareConfig dataclass"),
}  # fmt: skip


def test_a_launcher_that_breaks_the_contract_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "conf" / "launcher").mkdir(parents=True)
    for name, (source, lacks) in BROKEN.items():
        (tmp_path / f"broken_{name}.py").write_text(source)
        (tmp_path / "conf" / "launcher" / f"{name}.yaml").write_text(f"_target_: broken_{name}.launch\n")
        proc = run_ddpexp(f"launcher={name}", "hydra.run.dir=job", cwd=tmp_path, check=False, timeout=60)
        assert proc.returncode == 2 and proc.stderr == (
            f"ddpexp: error: launcher={name}: broken_{name} is not a ddpexp launcher: {lacks} "
            "(the contract: ddpexp.launchers.base.Launcher)\n"
        ), proc.stderr
        assert not (tmp_path / "job").exists()  # refused before the job: no job dir left


PLUGIN = '''
"""An installed launcher: spawn's, under its own name."""
from dataclasses import dataclass
from ddpexp.launchers import spawn

@dataclass
class LocalpairConfig(spawn.SpawnConfig):
    _target_: str = "pairlaunch.launch"

resolve, world_size, plan, launch = spawn.resolve, spawn.world_size, spawn.plan, spawn.launch
'''

SETUP = """
[project]
name = "pairlaunch"
version = "0.1"
[project.entry-points."ddpexp.launchers"]
localpair = "pairlaunch"
"""


@pytest.mark.slow
def test_an_installed_launcher_is_found_by_its_entry_point(tmp_path: Path) -> None:
    """A real install (pip, into a folder of its own) of a package that declares a `ddpexp.launchers` entry point:
    `launcher=localpair` runs with no YAML anywhere, through the same contract, and the contract suite passes."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "pairlaunch.py").write_text(PLUGIN)
    (src / "pyproject.toml").write_text(SETUP)
    site = tmp_path / "site"
    pip = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--quiet",
        "--no-deps",
        "--no-build-isolation",
        "--target",
        str(site),
    ]
    subprocess.run([*pip, str(src)], check=True, capture_output=True, timeout=120)
    shutil.rmtree(src)  # only the installed copy is left
    env = {
        **ddpexp_env(),
        "PYTHONPATH": os.pathsep.join([str(site), *ddpexp_env().get("PYTHONPATH", "").split(os.pathsep)]),
    }
    suite = tmp_path / "test_localpair.py"
    suite.write_text(
        "import os\nimport pytest\nfrom ddpexp.testing import LauncherContract\n\n"
        "class TestLocalpair(LauncherContract):\n    launcher, module = 'localpair', 'pairlaunch'\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(suite), "-k", "contract or plan or runs"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0 and "3 passed" in proc.stdout, proc.stdout[-3000:]


def _chained_traceback(site: str, ddpexp: str) -> str:
    """A rank's traceback as worker.py records it when a user's data factory raises under hydra's instantiate."""
    call = f'  File "{site}/hydra/_internal/instantiate/_instantiate2.py", line '
    return f"""Traceback (most recent call last):
{call}129, in _call_target
    result = _target_(*args, **kwargs)
             ^^^^^^^^^^^^^^^^^^^^^^^^^
  File "/home/me/proj/mydata.py", line 7, in splits
    return load_csv("/no/such/dir/train.csv")
           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "/home/me/proj/mydata.py", line 2, in load_csv
    with open(path) as f:
         ^^^^^^^^^^
FileNotFoundError: [Errno 2] No such file or directory: '/no/such/dir/train.csv'

The above exception was the direct cause of the following exception:

Traceback (most recent call last):
  File "{ddpexp}/rank/worker.py", line 63, in main
    summary.update(train(cfg, job, device, tracker, resumed, stop))
                   ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "{ddpexp}/rank/train.py", line 113, in train
    p = build(cfg, device, resumed)
        ^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "{ddpexp}/rank/train.py", line 68, in build
    splits = instantiate(cfg.data)
             ^^^^^^^^^^^^^^^^^^^^^
{call}251, in instantiate
    return _instantiate_impl(config, args, kwargs)
           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
{call}299, in _instantiate_impl
    return instantiate_node(
           ^^^^^^^^^^^^^^^^^
{call}420, in instantiate_node
    return _call_target(_target_, partial, args, kwargs, full_key)
           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
{call}138, in _call_target
    raise InstantiationException(_with_full_key(msg, full_key)) from e
hydra.errors.InstantiationException: Error in call to target 'mydata.splits':
FileNotFoundError(2, 'No such file or directory')
"""


def test_a_long_traceback_is_trimmed_from_the_middle_keeping_the_users_frames_and_errors() -> None:
    """The last 25 lines alone began with a dangling "The above exception ..." and left out mydata.py."""
    import ddpexp
    from ddpexp.launchers.base import tail

    site = "/opt/venv/lib/python3.11/site-packages"
    text = _chained_traceback(site, os.path.dirname(ddpexp.__file__))
    assert len(text.splitlines()) > 25
    assert tail(text).splitlines() == [
        "Traceback (most recent call last):",
        "  ... 1 frame(s) of torch, ddpexp or other packages",
        '  File "/home/me/proj/mydata.py", line 7, in splits',
        '    return load_csv("/no/such/dir/train.csv")',
        '  File "/home/me/proj/mydata.py", line 2, in load_csv',
        "    with open(path) as f:",
        "FileNotFoundError: [Errno 2] No such file or directory: '/no/such/dir/train.csv'",
        "",
        "The above exception was the direct cause of the following exception:",
        "",
        "Traceback (most recent call last):",
        "  ... 6 frame(s) of torch, ddpexp or other packages",
        f'  File "{site}/hydra/_internal/instantiate/_instantiate2.py", line 138, in _call_target',
        "    raise InstantiationException(_with_full_key(msg, full_key)) from e",
        "hydra.errors.InstantiationException: Error in call to target 'mydata.splits':",
        "FileNotFoundError(2, 'No such file or directory')",
    ]
    short = 'Traceback (most recent call last):\n  File "x.py", line 1, in f\nValueError: no'
    assert tail(short) == short  # what fits is shown whole, frames of every package too
    deep = "Traceback (most recent call last):\n" + '  File "/home/me/m.py", line 3, in f\n    f()\n' * 40
    trimmed = tail(deep + "RecursionError: too deep").splitlines()  # the user's frames alone are too many
    assert len(trimmed) <= 25 and trimmed[0].startswith("Traceback") and trimmed[-1] == "RecursionError: too deep"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_forkserver_ranks_get_the_environment_and_affinity_their_job_started_with(tmp_path: Path) -> None:
    """Two spawn jobs in one process (ddpexp.run), under another DDPEXP_PROBE and CPU affinity each: the first
    job's forkserver forks the second's ranks too, and each job's ranks train in their own job's environment and
    affinity, as spawned ranks would (tests/env_probe.py)."""
    import json

    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "env_probe.py"), str(tmp_path)], cwd=tmp_path,
        env={**ddpexp_env(), "PYTHONPATH": str(ROOT / "tests")}, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads((tmp_path / "probe.json").read_text())
    assert (seen["1"]["probe"], seen["2"]["probe"]) == (1.0, 2.0)  # every rank's metric: the mean over the ranks
    assert seen["1"]["affinity"] == [[0], [0]] and seen["2"]["cores"] != [0]
    assert seen["2"]["affinity"] == [seen["2"]["cores"]] * 2
    assert len(seen["1"]["forkservers"]) == 1 and seen["2"]["forkservers"] == seen["1"]["forkservers"]
