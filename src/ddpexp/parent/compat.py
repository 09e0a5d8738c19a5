"""What keeps an older release's runs and command lines working after a release declares a key that used to be
added with `+`: the override still composes, and a config that lacks the key (at its default) is the same run."""

from __future__ import annotations

import copy
import itertools
import re
from collections.abc import Callable
from typing import Any

import yaml

# Keys a release declared in ddpexp's own YAMLs, with the default they have there (the value an older config
# that lacks them ran with). Each must be declared as the last key of its group: `+KEY=V` appended it there, so
# an older run's config, with the key set, is the same text.
ADDED_KEYS: dict[tuple[str, ...], Any] = {
    ("data", "test_fraction"): None,
    ("tracker",): {"wandb": {"_target_": "ddpexp.trackers.wandb.start", "on_error": "warn"}},  # W&B, as before
    ("strategy",): {"name": "ddp"},  # DistributedDataParallel, as before
    ("drop_last",): False,  # every sample once per epoch, as the padded order nearly did
    ("launcher", "start_method"): "forkserver",  # launcher=spawn's ranks, forked (the same weights as spawned)
}


def with_declared_keys(overrides: list[str]) -> list[str]:
    """`+data.test_fraction=F` (needed while the key was not declared) as `++data.test_fraction=F`: Hydra refuses
    `+` on a key that exists, and `++` sets it whether the data group declares it (a built-in set) or not (a
    user's own)."""
    added = {".".join(path) for path in ADDED_KEYS}
    out = []
    for o in overrides:
        match = re.fullmatch(r"\+([\w.]+)=(.*)", o, flags=re.DOTALL)
        out.append(f"+{o}" if match and match.group(1) in added else o)
    return out


def older_forms(config: dict[str, Any], dump: Callable[[dict[str, Any]], str]) -> set[str]:
    """`config` as `dump` writes it, and as releases before ADDED_KEYS wrote it: any of those keys left out where
    it holds its default (an older release lacked them all, a project's own YAML may lack one): each is the same
    run."""
    at_default = [path for path, default in ADDED_KEYS.items() if _get(config, path) == (True, default)]
    forms = {dump(config)}
    for n in range(1, len(at_default) + 1):
        for paths in itertools.combinations(at_default, n):
            older = copy.deepcopy(config)
            for *parents, key in paths:
                del _get(older, tuple(parents))[1][key]
            forms.add(dump(older))
    return forms


def _get(config: dict[str, Any], path: tuple[str, ...]) -> tuple[bool, Any]:
    """(found, value) of the dotted `path` in nested dicts."""
    node: Any = config
    for part in path:
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def same_run_configs(config_yaml: str) -> set[str]:
    """A job's config.yaml (parent/launch.py writes it with yaml.safe_dump) in each form that is the same run."""
    config = yaml.safe_load(config_yaml)
    if not isinstance(config, dict):
        return {config_yaml}
    return older_forms(config, lambda c: yaml.safe_dump(c, sort_keys=False)) | {config_yaml}


def same_hydra_configs(task_cfg: Any) -> set[str]:
    """Hydra's record of a job's config (.hydra/config.yaml, OmegaConf.to_yaml of its unresolved config: a
    DictConfig, or that file's text or bytes) in each form that is the same run; a file that is not a config is
    only itself."""
    from omegaconf import DictConfig, OmegaConf

    if isinstance(task_cfg, bytes):
        task_cfg = task_cfg.decode(errors="replace")
    try:
        cfg = task_cfg if isinstance(task_cfg, DictConfig) else OmegaConf.create(task_cfg)
        config = OmegaConf.to_container(cfg, resolve=False)
    except Exception:  # not YAML, or not a mapping: compared as it is
        return {task_cfg}
    if not isinstance(config, dict):
        return {OmegaConf.to_yaml(cfg)}
    return {OmegaConf.to_yaml(cfg)} | older_forms(config, lambda c: OmegaConf.to_yaml(OmegaConf.create(c)))


def drop_untaken(dcfg: Any) -> None:
    """An added key at its default, in a group whose `_target_` does not take it, is left out of `dcfg` (a
    DictConfig): a user's factory put in a built-in set's place (`data._target_=mine ~data.val_fraction`) ran
    before the key was declared, and runs the same now."""
    import inspect
    import pydoc

    from omegaconf import open_dict

    for (*parents, key), default in ADDED_KEYS.items():
        if not parents:  # a key of the root: no _target_ takes it
            continue
        node = dcfg
        for part in parents:
            node = node.get(part) if hasattr(node, "get") else None
        if not hasattr(node, "get") or key not in node or node.get(key) != default:
            continue
        try:
            params = inspect.signature(pydoc.locate(str(node.get("_target_")))).parameters  # type: ignore[arg-type]
        except Exception:  # no such target, or no signature: the group's own check says so
            continue
        if key not in params and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            with open_dict(node):
                del node[key]
