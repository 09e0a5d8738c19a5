"""Launcher backends: `launcher=NAME` is conf/launcher/NAME.yaml, launchers/NAME.py and its NameConfig dataclass.

A launcher module has `launch(worker, cfg, job)`, which only starts ranks with PyTorch's env:// variables, calls
`worker(cfg, job)` in each and raises RankFailure when a rank fails; `plan(cfg, job)` for plan=true; and, for the
parent before anything starts, `resolve(cfg)` (pins `device` and `gpus`, checks what only this machine can tell)
and `world_size(config) -> int | None` (the ranks a resolved config asks for; None: known only at start).
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import socket
import sys
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
    """Refuse an address that does not resolve: the ranks would retry the rendezvous there until its timeout.
    Called by `resolve`, in the parent only: building a config does no network look-up."""
    try:
        socket.getaddrinfo(host, None)
    except (OSError, UnicodeError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise ConfigError(f"{key}={shown or host!r}: cannot resolve host {host!r} ({why})") from None


def resolve_local(cfg: Any) -> None:
    """Pin `device` and `gpus` for a launcher that starts ranks on this machine, from the GPUs visible here."""
    import torch

    visible = torch.cuda.device_count()
    if cfg.device == "cuda" and visible == 0:
        raise ConfigError("device=cuda: no CUDA GPU is visible here; use device=cpu (or device=auto)")
    cfg.device = cfg.device if cfg.device != "auto" else ("cuda" if visible else "cpu")
    cfg.gpus = cfg.gpus or (visible if cfg.device == "cuda" else 2)
    if cfg.device == "cuda" and cfg.gpus > visible:
        raise ConfigError(f"gpus={cfg.gpus}: only {visible} CUDA GPU(s) visible here; use gpus<={visible}")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if cfg.device == "cpu" and cfg.gpus > cores:
        # Each rank then gets one thread (speed.limit_threads), and ranks take turns on the cores: allowed (a
        # test of many ranks on a laptop), but slower than it looks.
        print(f"ddpexp: warning: gpus={cfg.gpus} CPU ranks on {cores} core(s) here: the ranks oversubscribe the "
              f"cores; gpus<={cores} gives each rank a core of its own", file=sys.stderr, flush=True)  # fmt: skip
