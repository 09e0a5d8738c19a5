"""The parent's side of `ddpexp eval` (ddpexp.evaluate) and of ddpexp.load_model: the run dir and the checkpoint
named, the run's own config (the one its checkpoint stores) with the command's overrides, then spawn's ranks
scoring the weights with the training's exact evaluation (rank/eval_worker.py); each result a new file in
RUN_DIR/eval/, beside (never over) the run's own record."""

from __future__ import annotations

import os
from collections.abc import Sequence
from functools import partial
from typing import Any

import yaml

from ddpexp.config import Config
from ddpexp.exceptions import ConfigError
from ddpexp.job import Job, read_json

CHECKPOINTS = ("best", "last")  # by name: RUN_DIR/checkpoints/NAME.pt; anything else is a file's path
SPLITS = ("val", "test")


def find_checkpoint(run_dir: str, checkpoint: str) -> str:
    """The checkpoint file `checkpoint` names in `run_dir` (best, last) or elsewhere (a PATH), refused in one line
    when the run dir or the file is not there."""
    if not os.path.isdir(run_dir):
        raise ConfigError(f"{run_dir}: no such run dir")
    marks = ("summary.json", "checkpoints", os.path.join(".hydra", "config.yaml"))
    if not any(os.path.exists(os.path.join(run_dir, m)) for m in marks):
        raise ConfigError(f"{run_dir}: not a ddpexp run dir (no summary.json, checkpoints/ or .hydra/config.yaml)")
    if checkpoint in CHECKPOINTS:
        path = os.path.join(run_dir, "checkpoints", f"{checkpoint}.pt")  # a file, or a sharded run's folder
        if not os.path.exists(path):
            why = "the run recorded no best evaluation" if checkpoint == "best" else "the run wrote no checkpoint"
            raise ConfigError(f"--checkpoint {checkpoint}: {path}: no such checkpoint ({why})")
        return path
    path = os.path.abspath(checkpoint)
    if not os.path.exists(path):
        raise ConfigError(f"--checkpoint {checkpoint}: no such file (best, last or a checkpoint's PATH)")
    return path


def project_conf(run_dir: str) -> str | None:
    """The user project's config dir the run was composed with (Hydra's record of its search path), whose folder
    must be importable for the project's `_target_`s; None for a run of ddpexp's own configs."""
    try:
        with open(os.path.join(run_dir, ".hydra", "hydra.yaml")) as f:
            sources = yaml.safe_load(f)["hydra"]["runtime"]["config_sources"]
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        return None
    found = [s["path"] for s in sources if isinstance(s, dict) and s.get("schema") == "file" and s.get("path")]
    return found[-1] if found else None


def eval_config(config_yaml: str, overrides: Sequence[str]) -> Config:
    """The run's resolved config on the spawn launcher, with the device and ranks picked as a training command
    picks them (`gpus=`, `device=` among the overrides), then the overrides (KEY=VALUE; `+KEY` adds a key to a
    `_target_`'s arguments), checked as the parent checks a training's."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from ddpexp.launchers.spawn import SpawnConfig
    from ddpexp.parent.launch import to_config
    from ddpexp.parent.schema import closest_key

    raw = yaml.safe_load(config_yaml)
    raw.pop("launcher", None)
    raw.update(gpus=None, device="auto", plan=False, resume="never")
    node = OmegaConf.merge(OmegaConf.structured(Config), raw)
    node.launcher = OmegaConf.structured(SpawnConfig)
    for override in overrides:
        key, eq, _ = override.partition("=")
        if not eq or not key.lstrip("+"):
            raise ConfigError(f"override {override!r}: must be KEY=VALUE")
        try:
            node = OmegaConf.merge(node, OmegaConf.from_dotlist([override.lstrip("+")]))
        except OmegaConfBaseException as e:
            near = closest_key(key.lstrip("+"), SpawnConfig)
            raise ConfigError(f"{override}: {str(e).splitlines()[0]}{near}") from None
    return to_config(node)


def evaluate(run_dir: str, checkpoint: str, split: str, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Score `checkpoint` of `run_dir` on `split` with the ranks `gpus=` asks for; returns the eval record (its
    metrics, the samples scored, where it was written: `path`)."""
    import torch
    from hydra.utils import instantiate

    from ddpexp.launchers import spawn
    from ddpexp.parts import data
    from ddpexp.rank import checkpoint as checkpoints
    from ddpexp.rank import eval_worker

    if split not in SPLITS:
        raise ConfigError(f"--split {split}: must be one of {', '.join(SPLITS)}")
    run_dir = os.path.abspath(run_dir)
    path = find_checkpoint(run_dir, checkpoint)
    state = checkpoints.load(path)  # weights_only; refuses a file that is no ddpexp checkpoint
    cfg = eval_config(state["config"], overrides)
    spawn.resolve(cfg)
    data.example(cfg.data)  # a built-in set's keys, checked in one line each
    data.prepare(cfg.data)
    with torch.random.fork_rng(devices=[]):  # the split must exist: built once here, as the ranks will build it
        torch.manual_seed(cfg.seed)
        if getattr(instantiate(cfg.data), split, None) is None:
            raise ConfigError(
                f"--split {split}: the run's data ({cfg.data['_target_']}) has no {split} split"
                + (" (the built-in sets carve one with data.test_fraction=0.1)" if split == "test" else "")
            )
    label = checkpoint if checkpoint in CHECKPOINTS else os.path.splitext(os.path.basename(path))[0]
    request = eval_worker.Request(path, split, new_record(run_dir, label, split))
    job = Job(dir=run_dir, name="eval", group=None, launcher="spawn", config_yaml=state["config"])
    try:
        spawn.launch(partial(eval_worker.main, request), cfg, job).wait()
        record = read_json(request.record)
        if not record:
            raise RuntimeError(f"the ranks wrote no eval record ({request.record})")
    except BaseException:
        os.remove(request.record)
        raise
    return {**record, "path": request.record}


def new_record(run_dir: str, label: str, split: str) -> str:
    """A new file RUN_DIR/eval/LABEL-SPLIT-N.json, taken (created empty) so that no other eval writes it."""
    folder = os.path.join(run_dir, "eval")
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{folder}: cannot write the eval record there ({e.strerror or e})") from None
    n = 1
    while True:
        path = os.path.join(folder, f"{label}-{split}-{n}.json")
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
            return path
        except FileExistsError:
            n += 1


def load_model(run_dir: str, checkpoint: str = "best") -> Any:
    """The run's model (its `model._target_`, given the data's facts) with the checkpoint's weights: unwrapped,
    on the CPU, in eval mode; a sharded run's (strategy=fsdp2) whole, its shards put together. The data is read
    only when its facts cannot be told from its config (a user's)."""
    import torch
    from hydra.utils import instantiate

    from ddpexp.parts import data
    from ddpexp.parts.optim import call_accepting
    from ddpexp.rank import checkpoint as checkpoints

    path = find_checkpoint(os.path.abspath(run_dir), checkpoint)
    state = checkpoints.load(path)
    config = yaml.safe_load(state["config"])
    with torch.random.fork_rng(devices=[]):  # building draws initial weights: the caller's RNG stays as it was
        torch.manual_seed(config.get("seed", 0))
        known = data.example(config["data"])
        facts = known[0] if known is not None else instantiate(config["data"]).facts
        model = call_accepting(instantiate(config["model"], _partial_=True), **facts)
    checkpoints.model_weights(path, state, model)
    return model.eval()
