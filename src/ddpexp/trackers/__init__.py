"""Trackers: where rank 0 logs a job's rows besides its own run record (metrics.jsonl, summary.json), which it
always writes. One module each (wandb, tensorboard, mlflow here; a project's or an installed package's too),
keeping the contract in trackers/base.py.

`tracker=NAME` is conf/tracker/NAME.yaml, which puts the tracker's keys at `tracker.NAME` (`_target_` names the
module's `start`); `tracker=[wandb,tensorboard]` selects several, `tracker=none` none. Found here: every module of
this package but the contract's own, then the entry points of the `ddpexp.trackers` group (installed packages:
`NAME = "pkg.module"`), then a project's YAML naming its module.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import logging
import pkgutil
from types import ModuleType
from typing import Any

from ddpexp.exceptions import ConfigError
from ddpexp.trackers.base import CONTRACT, TrackerConfig, TrackerError

log = logging.getLogger("ddpexp")

NOT_TRACKERS = ("base",)
ENTRY_POINTS = "ddpexp.trackers"
# What a config without a `tracker` key ran with before the group existed, and what it runs with now: W&B, which
# never stops a job (it falls back to offline, then to the run record alone).
DEFAULT = {"wandb": {"_target_": "ddpexp.trackers.wandb.start", "on_error": "warn"}}


def schema_name(name: str) -> str:
    return "".join(part.title() for part in name.split("_")) + "TrackerConfig"


def tracker_modules() -> dict[str, str]:
    """{name: module} for this package's trackers and the installed ones (a built-in name wins)."""
    from importlib.metadata import entry_points

    found = {m.name: f"{__name__}.{m.name}" for m in pkgutil.iter_modules(__path__) if m.name not in NOT_TRACKERS}
    for ep in entry_points(group=ENTRY_POINTS):
        found.setdefault(ep.name, ep.value)
    return found


def load(name: str, module_name: str) -> tuple[ModuleType, type]:
    """The module of `tracker=name` and its NameTrackerConfig dataclass, checked against the contract: one line
    naming everything that is missing."""
    try:
        module = importlib.import_module(module_name)
    except (ImportError, ValueError) as e:  # ValueError: an empty module name
        raise ConfigError(f"tracker={name}: cannot import {module_name} ({type(e).__name__}: {e})") from None
    missing = [f"{f}()" for f in CONTRACT if not callable(getattr(module, f, None))]
    schema = getattr(module, schema_name(name), None)
    if not (isinstance(schema, type) and dataclasses.is_dataclass(schema) and issubclass(schema, TrackerConfig)):
        missing.append(f"a {schema_name(name)} dataclass extending ddpexp.trackers.base.TrackerConfig")
    if missing:
        raise ConfigError(
            f"tracker={name}: {module_name} is not a ddpexp tracker: it lacks {', '.join(missing)} "
            "(the contract: ddpexp.trackers.base.Tracker)"
        )
    return module, schema


def typed(raw: dict[str, Any] | None) -> dict[str, TrackerConfig]:
    """`tracker` as composed ({name: {_target_, keys...}}; None: a config from before the group, W&B) as each
    tracker's dataclass, its keys checked: a typo is one line naming the closest key."""
    raw = DEFAULT if raw is None else raw
    if not isinstance(raw, dict):
        raise ConfigError(f"tracker={raw!r}: pick trackers with tracker=NAME or tracker=[NAME,...] ({choices()})")
    out: dict[str, TrackerConfig] = {}
    for name, node in raw.items():
        if not isinstance(node, dict):
            raise ConfigError(f"tracker.{name}={node!r}: must be the tracker's keys; pick one with tracker={name}")
        target = str(node.get("_target_") or "")
        module_name = target.rpartition(".")[0] or tracker_modules().get(name, "")
        module, schema = load(name, module_name)
        start = getattr(module, target.rpartition(".")[2], None) if target else module.start
        if start is not module.start:
            raise ConfigError(f"tracker.{name}._target_={target!r}: must name {module_name}.start")
        fields = [f.name for f in dataclasses.fields(schema)]
        for key in node:
            if key not in fields:
                close = difflib.get_close_matches(key, fields, n=1)
                hint = f" (did you mean tracker.{name}.{close[0]}?)" if close else ""
                raise ConfigError(f"tracker.{name}.{key}: no such key{hint} ({schema.__name__})")
        try:
            out[name] = schema(**{**node, "_target_": f"{module_name}.start"})
        except ConfigError as e:
            raise ConfigError(f"tracker.{name}.{e}") from None
    return out


def choices() -> str:
    return ", ".join(sorted(tracker_modules())) + ", none"


def module_of(cfg: TrackerConfig) -> ModuleType:
    return importlib.import_module(cfg._target_.rpartition(".")[0])


def check(trackers: dict[str, TrackerConfig], job: Any) -> list[str]:
    """Each tracker's `check`, in the parent before any rank starts; one that cannot write fails the job in one
    line (on_error=fail) or is dropped from `trackers` with a warning line, returned (on_error=warn)."""
    warnings = []
    for name, cfg in list(trackers.items()):
        try:
            module_of(cfg).check(cfg, job)
        except TrackerError as e:
            if cfg.on_error == "fail":
                raise ConfigError(f"tracker={name}: {e} (tracker.{name}.on_error=warn: go on without it)") from None
            warnings.append(f"tracker={name}: {e}; going on without it (tracker.{name}.on_error=warn)")
            del trackers[name]
    return warnings
