"""The parent's dry build of a run's parts, before any rank starts: model, optimizer and scheduler are built on
PyTorch's meta device (no memory, no compute) and one batch of the data's shape goes through the model, so a bad
model, data, optimizer or scheduler value is one ConfigError line here instead of a traceback from every rank."""

from __future__ import annotations

import inspect
import pydoc
import warnings
from collections.abc import Callable
from typing import Any

from ddpexp import data
from ddpexp.config import Config, ConfigError, check, is_number

DRY_STEPS = 3  # scheduler steps taken: a StepLR with step_size=0 fails on its first


def components(cfg: Config) -> None:
    """Raise ConfigError, naming the key and value, for a part of `cfg` that the ranks could not build or run."""
    import torch
    from hydra.utils import instantiate

    from ddpexp.optim import call_accepting

    for group in ("model", "data", "optimizer", "scheduler"):
        if getattr(cfg, group):
            _resolve(group, getattr(cfg, group))
    check_values(cfg)
    shape = data.shape(cfg.data)
    # The ranks warn about their real build; the dry one keeps stderr to the one error line.
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if shape is None:  # a user's dataset: its shape is known once built, in the ranks; check the rest
            params = [torch.nn.Parameter(torch.empty(1))]
        else:
            params = list(_model(cfg, *shape).parameters())
        optimizer = _build(f"optimizer={_call(cfg.optimizer)}", lambda: instantiate(cfg.optimizer)(params))
        if not cfg.scheduler:
            return
        # The real total comes from the loader's length (ranks); any count >= 1 builds the same kind of schedule.
        total_steps = cfg.max_steps or cfg.epochs
        scheduler = _build(
            f"scheduler={_call(cfg.scheduler)}",
            lambda: call_accepting(instantiate(cfg.scheduler), optimizer, total_steps=total_steps),
        )
        for _ in range(DRY_STEPS):
            _build(f"scheduler={_call(cfg.scheduler)}", scheduler.step)


def check_values(cfg: Config) -> None:
    """Values PyTorch accepts at construction but that break or silently spoil a run."""
    lr = cfg.optimizer.get("lr", 0)
    check(is_number(lr) and lr >= 0, f"optimizer.lr={lr!r}: must be a number >= 0")
    if cfg.scheduler:
        step_size, gamma = cfg.scheduler.get("step_size", 1), cfg.scheduler.get("gamma", 1)
        check(is_number(step_size) and step_size >= 1, f"scheduler.step_size={step_size!r}: must be >= 1 (steps)")
        check(is_number(gamma) and gamma > 0, f"scheduler.gamma={gamma!r}: must be > 0 (the LR's factor)")


def _model(cfg: Config, in_channels: int, image_size: int, num_classes: int) -> Any:
    import torch
    from hydra.utils import instantiate

    from ddpexp.optim import call_accepting

    name = f"model={_call(cfg.model)}"
    sizes = dict(num_classes=num_classes, in_channels=in_channels, image_size=image_size)
    model = _build(name, lambda: call_accepting(instantiate(cfg.model, _partial_=True), **sizes))
    images = f"{in_channels}x{image_size}x{image_size} images ({_data_keys(cfg.data)})"
    out = _build(f"{name} on {images}", lambda: model(torch.empty(2, in_channels, image_size, image_size)))
    got = tuple(getattr(out, "shape", ()))
    check(got == (2, num_classes), f"{name}: outputs {got} for 2 {images}; the data has {num_classes} classes")
    return model


def _build(what: str, build: Callable[[], Any]) -> Any:
    """`build()`, any error but a ConfigError turned into one line saying what was built."""
    try:
        return build()
    except ConfigError:
        raise
    except Exception as e:
        lines = str(e).strip().splitlines()
        raise ConfigError(f"{what}: {type(e).__name__}: {lines[0] if lines else ''}".rstrip(": ")) from e


def _resolve(group: str, node: dict) -> None:
    """`_target_` imports, and takes every key of its group (a typo fails here, not as a TypeError per rank)."""
    path = node.get("_target_")
    try:
        target = pydoc.locate(path) if isinstance(path, str) else None
    except pydoc.ErrorDuringImport as e:  # the module exists but raised while importing
        raise ConfigError(f"{group}._target_={path!r}: importing it failed: {e.exc.__name__}: {e.value}") from e
    check(callable(target), f"{group}._target_={path!r}: no such callable (a dotted path like mypkg.module.fn)")
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):  # some builtins have no signature
        return
    unknown = [k for k in node if not k.startswith("_") and k not in params]
    if unknown and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        key = unknown[0]
        raise ConfigError(f"{group}.{key}={node[key]!r}: {path} takes no such argument (it takes {', '.join(params)})")


def _call(node: dict) -> str:
    """A config group as the call it makes: torch.optim.AdamW(lr=0.001, weight_decay=0.01)."""
    kwargs = ", ".join(f"{k}={v!r}" for k, v in node.items() if not k.startswith("_"))
    return f"{node['_target_']}({kwargs})"


def _data_keys(node: dict) -> str:
    keys = [f"data.{k}={node[k]}" for k in ("name", "in_channels", "image_size") if k in node]
    return ", ".join(keys) or f"data={node['_target_'].rsplit('.', 1)[-1]}"
