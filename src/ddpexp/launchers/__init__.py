"""Launchers: how a job's ranks start. One module each (spawn, torchrun, slurm, env, ray here; a user project's or an installed
package's too), keeping the contract in launchers/base.py; the parent's process helpers in launchers/processes.py.

`launcher=NAME` is conf/launcher/NAME.yaml, whose `_target_` names the module's `launch`, and the module's
`NameConfig` dataclass. Found here: every module of this package but the contract's own, then the entry points of
the `ddpexp.launchers` group (installed packages: `NAME = "pkg.module"`), then a project's YAML naming its module.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import sys
from types import ModuleType
from typing import Any

from ddpexp.exceptions import ConfigError
from ddpexp.launchers.base import CONTRACT

NOT_LAUNCHERS = ("base", "processes", "world")  # this package's modules that are not launchers
ENTRY_POINTS = "ddpexp.launchers"


def schema_name(name: str) -> str:
    return "".join(part.title() for part in name.split("_")) + "Config"


def launcher_modules() -> dict[str, str]:
    """{name: module} for this package's launchers and the installed ones (a built-in name wins)."""
    from importlib.metadata import entry_points

    found = {m.name: f"{__name__}.{m.name}" for m in pkgutil.iter_modules(__path__) if m.name not in NOT_LAUNCHERS}
    for ep in entry_points(group=ENTRY_POINTS):
        found.setdefault(ep.name, ep.value)
    return found


def launcher_schemas() -> dict[str, Any]:
    """{name: dataclass} for every launcher found; an installed one that breaks the contract is skipped, once said."""
    schemas = {}
    for name, module in launcher_modules().items():
        try:
            schemas[name] = load(name, module)[1]
        except ConfigError as e:
            if module.startswith(f"{__name__}."):
                raise
            print(f"ddpexp: warning: skipped the launcher of entry point {name} = {module}: {e}", file=sys.stderr)
    return schemas


def load(name: str, module_name: str) -> tuple[ModuleType, type]:
    """The module of `launcher=name` and its NameConfig dataclass, checked against the contract (base.Launcher):
    one line naming everything that is missing."""
    try:
        module = importlib.import_module(module_name)
    except (ImportError, ValueError) as e:  # ValueError: an empty module name
        raise ConfigError(f"launcher={name}: cannot import {module_name} ({type(e).__name__}: {e})") from None
    missing = [f"{f}()" for f in CONTRACT if not callable(getattr(module, f, None))]
    schema = getattr(module, schema_name(name), None)
    if not (isinstance(schema, type) and dataclasses.is_dataclass(schema)):
        missing.append(f"a {schema_name(name)} dataclass")
    elif "_target_" not in {f.name for f in dataclasses.fields(schema)}:
        missing.append(f"a _target_ field in {schema_name(name)}")
    if missing:
        raise ConfigError(
            f"launcher={name}: {module_name} is not a ddpexp launcher: it lacks {', '.join(missing)} "
            "(the contract: ddpexp.launchers.base.Launcher)"
        )
    return module, schema
