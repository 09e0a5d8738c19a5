"""A key a release declares (data.test_fraction, once added with `+`) breaks no older run or command line: `+KEY=V`
still composes, and a job dir whose config lacks the key (as the previous release wrote it) is the same run, so a
completed one is not redone nor refused as another run's record."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from conftest import ROOT, make_config, read_summary, run_ddpexp
from ddpexp.parent.compat import same_hydra_configs, same_run_configs, with_declared_keys

TINY = ["launcher=spawn", "gpus=1", "model=mlp", "max_steps=2", "wandb.mode=disabled"]


def test_plus_on_a_declared_key_is_read_as_set_or_add() -> None:
    given = ["+data.test_fraction=0.1", "+data.foo=1", "data.test_fraction=0.2", "+data.test_fraction=0.1,0.2", "x"]
    assert with_declared_keys(given) == [
        "++data.test_fraction=0.1", "+data.foo=1", "data.test_fraction=0.2", "++data.test_fraction=0.1,0.2", "x"
    ]  # fmt: skip
    assert make_config(*with_declared_keys(["+data.test_fraction=0.1"])).data["test_fraction"] == 0.1
    assert make_config().data["test_fraction"] is None  # declared, off


def test_a_config_without_the_declared_key_at_its_default_is_the_same_run() -> None:
    now = {"seed": 0, "data": {"_target_": "ddpexp.data.digits", "val_fraction": 0.2, "test_fraction": None}, "z": 1}
    older = {"seed": 0, "data": {"_target_": "ddpexp.data.digits", "val_fraction": 0.2}, "z": 1}
    dump = lambda c: yaml.safe_dump(c, sort_keys=False)  # noqa: E731  # how parent/launch.py writes config.yaml
    assert same_run_configs(dump(now)) == {dump(now), dump(older)}
    with_split = {**now, "data": {**now["data"], "test_fraction": 0.1}}
    assert same_run_configs(dump(with_split)) == {dump(with_split)}  # another split: another run
    hydra_now = OmegaConf.create({**now, "data": {**now["data"], "seed": "${seed}"}})
    hydra_older = OmegaConf.create({**older, "data": {**older["data"], "seed": "${seed}"}})
    assert OmegaConf.to_yaml(hydra_older) in same_hydra_configs(hydra_now)
    assert OmegaConf.to_yaml(hydra_older) in same_hydra_configs(OmegaConf.to_yaml(hydra_now))


def test_a_spawn_job_from_before_start_method_is_the_same_run() -> None:
    """launcher.start_method (2026-12-07) at its default: an older spawn job's config, without it, is that job."""
    from hydra import compose, initialize_config_dir

    from ddpexp.parent.schema import register_configs

    register_configs()
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        config = OmegaConf.to_container(compose("config", overrides=["launcher=spawn"]), resolve=True)
    assert list(config["launcher"].items())[-1] == ("start_method", "forkserver")  # last in its group (ADDED_KEYS)
    dump = lambda c: yaml.safe_dump(c, sort_keys=False)  # noqa: E731  # how parent/launch.py writes config.yaml
    older = {**config, "launcher": {k: v for k, v in config["launcher"].items() if k != "start_method"}}
    assert dump(older) in same_run_configs(dump(config))
    spawned = {**config, "launcher": {**config["launcher"], "start_method": "spawn"}}
    assert dump(older) not in same_run_configs(dump(spawned))  # only the default is the older form


@pytest.mark.timeout(180)
def test_a_job_the_previous_release_completed_is_still_completed(tmp_path: Path) -> None:
    """data=older, the previous release's digits.yaml (without the key), composes the config exactly as that
    release wrote it (Hydra's `~data.test_fraction` cannot delete a key whose value is null)."""
    older = tmp_path / "older" / "data"
    older.mkdir(parents=True)
    digits = (ROOT / "conf" / "data" / "digits.yaml").read_text()
    (older / "older.yaml").write_text("".join(line for line in digits.splitlines(True) if "test_fraction" not in line))
    run_ddpexp("--config-dir", str(older.parent), *TINY, "data=older", "hydra.run.dir=job", cwd=tmp_path, timeout=120)
    assert "test_fraction" not in (tmp_path / "job" / ".hydra" / "config.yaml").read_text()
    shutil.copytree(tmp_path / "job", tmp_path / "record")
    shutil.rmtree(tmp_path / "record" / "checkpoints")  # a record without checkpoints: parent/resume_decision.py
    for job in ("job", "record"):
        before = (tmp_path / job / "summary.json").read_text()
        proc = run_ddpexp(*TINY, f"hydra.run.dir={job}", cwd=tmp_path, timeout=120)
        assert f"{tmp_path / job} already completed (val/acc=" in proc.stdout, proc.stdout + proc.stderr
        assert (tmp_path / job / "summary.json").read_text() == before
        assert read_summary(tmp_path / job)["status"] == "completed"


def test_a_user_factory_in_a_built_in_sets_place_gets_no_key_it_does_not_take() -> None:
    """`data._target_=mine ~data.val_fraction ~data.seed` ran before data.test_fraction was declared: it still does."""
    cfg = make_config("data._target_=test_components.user_splits", "~data.val_fraction", "~data.seed")
    assert dict(cfg.data) == {"_target_": "test_components.user_splits"}
    assert make_config("data.test_fraction=0.1", "data._target_=ddpexp.data.diabetes").data["test_fraction"] == 0.1
