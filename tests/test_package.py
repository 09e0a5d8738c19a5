"""ddpexp as an installed package: a wheel built from the checkout's files, installed (not editable) into a fresh
folder, runs the default job from another directory with the wheel's code and the configs inside it."""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, ddpexp_env, read_summary

BUILD_INPUTS = ("pyproject.toml", "README.md", "src", "conf")  # what the wheel is built from


def pip(*args: str, timeout: float = 300) -> None:
    proc = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"pip {' '.join(args)}:\n{proc.stdout}\n{proc.stderr}"


def build_isolation() -> list[str]:
    """The test env's own setuptools when it is new enough (no download); else pip's isolated build env."""
    try:
        major = int(importlib.metadata.version("setuptools").split(".")[0])
    except importlib.metadata.PackageNotFoundError:
        return []
    return ["--no-build-isolation"] if major >= 64 else []


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_wheel_installed_elsewhere_runs_the_default_job(tmp_path: Path) -> None:
    source = tmp_path / "checkout"  # a copy: the build's own files (build/, egg-info) stay out of the checkout
    source.mkdir()
    for name in BUILD_INPUTS:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(ROOT / name, source / name)
    pip("wheel", "--no-deps", *build_isolation(), "-w", str(tmp_path / "dist"), str(source))
    (wheel,) = (tmp_path / "dist").glob("ddpexp-*.whl")

    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {f"ddpexp/{p.relative_to(ROOT / 'src' / 'ddpexp')}" for p in (ROOT / "src" / "ddpexp").rglob("*.py")}
    configs = {f"ddpexp/conf/{p.relative_to(ROOT / 'conf')}" for p in (ROOT / "conf").rglob("*.yaml")}
    assert modules <= names, sorted(modules - names)  # a new subpackage must be listed in pyproject's packages
    assert configs <= names and "ddpexp/conf/__init__.py" in names, sorted(configs - names)
    assert len(configs) > 20 and "ddpexp/conf/config.yaml" in configs
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "ddpexp = ddpexp.__main__:main" in zipfile.ZipFile(wheel).read(entry_points).decode()

    site = tmp_path / "site"
    pip("install", "--no-deps", "--target", str(site), str(wheel))
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {**ddpexp_env(), "PYTHONPATH": str(site)}
    where = subprocess.run([sys.executable, "-c", "import ddpexp; print(ddpexp.__file__)"], cwd=work, env=env,
                           capture_output=True, text=True, timeout=60)  # fmt: skip
    assert where.stdout.strip() == str(site / "ddpexp" / "__init__.py"), where.stderr

    proc = subprocess.run([str(site / "bin" / "ddpexp"), "max_steps=3", "hydra.run.dir=job"], cwd=work, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    summary = read_summary(work / "job")
    assert summary["status"] == "completed" and summary["steps"] == 3 and summary["world_size"] == 2
    assert summary["ddpexp_path"] == str(site / "ddpexp")  # the ranks ran the wheel's code, not the checkout's
    assert f"-> {work / 'job'}" in proc.stdout.splitlines()[-1]
    hydra = yaml.safe_load((work / "job" / ".hydra" / "hydra.yaml").read_text())["hydra"]
    main = [s for s in hydra["runtime"]["config_sources"] if s["provider"] == "main"]
    assert main == [{"path": "ddpexp.conf", "schema": "pkg", "provider": "main"}]
    assert (hydra["runtime"]["choices"]["model"], hydra["runtime"]["choices"]["data"]) == ("cnn", "digits")


def test_import_ddpexp_stays_light(tmp_path: Path) -> None:
    """`import ddpexp` and its public names (ConfigError aside: omegaconf) import neither torch nor Hydra."""
    code = (
        "import sys, ddpexp\n"
        "assert callable(ddpexp.run) and ddpexp.Summary and ddpexp.RunFailed and ddpexp.Interrupted\n"
        "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'hydra', 'omegaconf', 'wandb'})\n"
        "assert issubclass(ddpexp.ConfigError, ValueError)\n"
        "print(heavy, 'torch' in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=ddpexp_env(), capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0 and proc.stdout.strip() == "[] False", proc.stderr
