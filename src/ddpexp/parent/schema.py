"""The config schema as Hydra and the parent use it: the dataclasses put in Hydra's ConfigStore (`base_config`,
`launcher/base_<name>`), and the keys they know, so a typo is one line naming the closest key instead of a key
added with `+` and silently never read."""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

from ddpexp.config import Config, DDPConfig, DebugConfig, EarlyStopConfig, SweepConfig, WandbConfig
from ddpexp.launchers import launcher_schemas
from ddpexp.strategies import SCHEMAS

# Groups whose keys are their _target_'s arguments (checked against its signature by ddpexp.parent.check): `+` adds here.
FREE = ("model", "data", "task", "optimizer", "scheduler")
SECTIONS = {
    "wandb": WandbConfig,
    "ddp": DDPConfig,
    "debug": DebugConfig,
    "early_stop": EarlyStopConfig,
    "sweep": SweepConfig,
}


def register_configs() -> None:
    """Put the schemas in Hydra's ConfigStore: `base_config` for the root, `launcher/base_<name>` per launcher (and
    `launcher/<name>` itself for a launcher an installed package brings, with no YAML of ddpexp's)."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    for name, schema in SCHEMAS.items():
        cs.store(group="strategy", name=f"base_{name}", node=schema)
    for name, schema in launcher_schemas().items():
        cs.store(group="launcher", name=f"base_{name}", node=schema)
        if not schema.__module__.startswith("ddpexp.launchers."):  # an installed package's: `launcher=NAME`, no YAML
            cs.store(group="launcher", name=name, node=schema)


def unknown_keys(container: dict[str, Any], launcher: type) -> list[str]:
    """Dotted keys of a composed config (the DictConfig as a dict) that no schema field names."""
    unknown = []
    for key, value in container.items():
        if key == "hydra" or key in FREE:
            continue
        if key not in _fields(Config):
            while isinstance(value, dict) and value:  # the key as typed: +optimzer.lr=0.1 gives optimzer.lr
                inner, value = next(iter(value.items()))
                key = f"{key}.{inner}"
            unknown.append(key)
            continue
        schema = launcher if key == "launcher" else SECTIONS.get(key)
        if schema is not None and isinstance(value, dict):
            unknown += [f"{key}.{k}" for k in value if k not in _fields(schema)]
    return unknown


def closest_key(dotted: str, launcher: type | None = None) -> str:
    """' (did you mean X?)' for the known key closest to `dotted`, or '' when none is close."""
    head, _, rest = dotted.partition(".")
    if head not in _fields(Config):
        match = difflib.get_close_matches(head, [k for k in _fields(Config) if k != "hydra"], n=1)
        return f" (did you mean {match[0]}{'.' + rest if rest else ''}?)" if match else ""
    if head in FREE or not rest:
        return ""
    schemas = [launcher] if launcher and head == "launcher" else list(launcher_schemas().values())
    names = SECTIONS[head] if head in SECTIONS else None
    known = sorted(_fields(names) if names else {f for s in schemas for f in _fields(s)})
    match = difflib.get_close_matches(rest.split(".")[0], known, n=1)
    return f" (did you mean {head}.{match[0]}?)" if match else ""


def _fields(schema: type) -> set[str]:
    return {f.name for f in dataclasses.fields(schema)}
