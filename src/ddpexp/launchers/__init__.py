"""Launcher backends: `launcher=NAME` is conf/launcher/NAME.yaml, launchers/NAME.py and its NameConfig dataclass.

A launcher's `launch(worker, cfg, job)` only starts ranks with PyTorch's env:// variables and calls `worker(cfg, job)`
in each; it raises RankFailure when a rank fails.
"""

from __future__ import annotations

import importlib
import pkgutil
import socket
from typing import Any

from ddpexp.exceptions import ConfigError, Interrupted, RankFailure  # noqa: F401 (the launchers' API)


def schema_name(name: str) -> str:
    return "".join(part.title() for part in name.split("_")) + "Config"


def launcher_schemas() -> dict[str, Any]:
    """{name: dataclass} for every module in this package (a new launcher is found by its file name)."""
    schemas = {}
    for mod in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{mod.name}")
        schemas[mod.name] = getattr(module, schema_name(mod.name))
    return schemas


def tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def check_resolves(key: str, host: str, shown: str | None = None) -> None:
    """Refuse an address that does not resolve: the ranks would retry the rendezvous there until its timeout."""
    try:
        socket.getaddrinfo(host, None)
    except (OSError, UnicodeError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise ConfigError(f"{key}={shown or host!r}: cannot resolve host {host!r} ({why})") from None
