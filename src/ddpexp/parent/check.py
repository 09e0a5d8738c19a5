"""The parent's dry build of a run's parts, before any rank starts: the task is built and its methods checked; the
model, optimizer and scheduler are built on PyTorch's meta device (no memory, no compute) and one batch of the
data's shape goes through the model and the task's loss and metrics, `objective` checked to be a metric the task
logs, so a bad model, data, task, optimizer or scheduler value is one ConfigError
line here instead of a traceback from every rank."""

from __future__ import annotations

import inspect
import pydoc
import warnings
from collections.abc import Callable
from typing import Any

from ddpexp.config import Config, check, is_number
from ddpexp.exceptions import ConfigError
from ddpexp.parts import data

DRY_STEPS = 3  # scheduler steps taken: a StepLR with step_size=0 fails on its first
GROUPS = ("model", "data", "task", "optimizer", "scheduler")


def components(cfg: Config, stated_mode: str | None = None) -> str | None:
    """Raise ConfigError, naming the key and value, for a part of `cfg` that the ranks could not build or run.
    Returns a warning line when the objective's direction is unknown (`stated_mode`: a sweeper's direction)."""
    import torch
    from hydra.utils import instantiate

    from ddpexp.parts.optim import call_accepting
    from ddpexp.parts.tasks import check_interface

    for group in GROUPS:
        if getattr(cfg, group):
            _resolve(group, getattr(cfg, group))
    check_values(cfg)
    task, task_name = build_task(cfg.task)
    check_interface(task, task_name)
    example = data.example(cfg.data)
    # The ranks warn about their real build; the dry one keeps stderr to the one error line.
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if example is None:  # a user's dataset: its shape is known once built, in the ranks; check the rest
            params = [torch.nn.Parameter(torch.empty(1))]
        else:
            params = list(_model_and_task(cfg, task, task_name, *example).parameters())
        optimizer = _build(f"optimizer={_call(cfg.optimizer)}", lambda: instantiate(cfg.optimizer)(params))
        if cfg.scheduler:
            # The real total comes from the loader's length (ranks); any count >= 1 builds the same kind of schedule.
            total_steps = cfg.max_steps or cfg.epochs
            scheduler = _build(
                f"scheduler={_call(cfg.scheduler)}",
                lambda: call_accepting(instantiate(cfg.scheduler), optimizer, total_steps=total_steps),
            )
            for _ in range(DRY_STEPS):
                _build(f"scheduler={_call(cfg.scheduler)}", scheduler.step)
    # Last, after every check of the parts: which way the objective is better.
    return direction_warning(cfg, task, task_name, stated_mode)


def direction_warning(cfg: Config, task: Any, task_name: str, stated_mode: str | None) -> str | None:
    """None when the objective's direction is known. Without one the run trains and records as ever (a task
    written before `directions` existed), and this line says what it does without: early stopping cannot work,
    so it is refused."""
    from ddpexp.parts.tasks import objective_mode, unknown_direction

    if objective_mode(task, cfg.objective, cfg.objective_mode, stated_mode) is not None:
        return None
    why = unknown_direction(task, task_name, cfg.objective)
    if cfg.early_stop.patience is not None:
        raise ConfigError(f"early_stop.patience={cfg.early_stop.patience} needs to know which way is better: {why}")
    return f"{why}; without it no best.pt is kept and `ddpexp report` lists the runs unsorted"


def build_task(node: Any) -> tuple[Any, str]:
    """The task that `node` (the `task` config) builds, and its name for messages (task=_target_)."""
    from hydra.utils import instantiate

    name = f"task={node['_target_']}"
    return _build(name, lambda: instantiate(node, _convert_="all")), name


def check_values(cfg: Config) -> None:
    """Values PyTorch accepts at construction but that break or silently spoil a run."""
    lr = cfg.optimizer.get("lr", 0)
    check(is_number(lr) and lr >= 0, f"optimizer.lr={lr!r}: must be a number >= 0")
    if cfg.scheduler:
        step_size, gamma = cfg.scheduler.get("step_size", 1), cfg.scheduler.get("gamma", 1)
        check(is_number(step_size) and step_size >= 1, f"scheduler.step_size={step_size!r}: must be >= 1 (steps)")
        check(is_number(gamma) and gamma > 0, f"scheduler.gamma={gamma!r}: must be > 0 (the LR's factor)")


def _model_and_task(cfg: Config, task: Any, task_name: str, facts: dict[str, Any], batch: Callable) -> Any:
    """The model built from the data's facts, one meta batch through it and through the task's loss and
    metrics; `objective` checked against the metrics' names. Returns the model."""
    from hydra.utils import instantiate

    from ddpexp.parts.optim import call_accepting
    from ddpexp.parts.tasks import check_loss, check_metrics, finalize

    name = f"model={_call(cfg.model)}"
    model = _build(name, lambda: call_accepting(instantiate(cfg.model, _partial_=True), **facts))
    shapes = f"{_facts(facts)} ({_data_keys(cfg.data)})"
    out = _on_meta(f"{name} on {shapes}", lambda: model(batch(2)[0]))
    if "num_classes" in facts and isinstance(task, _builtin("Classification")):
        got = tuple(getattr(out, "shape", ()))
        check(got == (2, facts["num_classes"]), f"{name}: outputs {got} for 2 samples of {shapes}; the data has {facts['num_classes']} classes")  # fmt: skip
    _on_meta(f"{task_name}.loss", lambda: check_loss(task.loss(model, batch(2)), task_name))
    scores = _on_meta(f"{task_name}.metrics", lambda: check_metrics(task.metrics(model, batch(2)), task_name))
    if scores is not None and cfg.objective != "train/loss":
        try:  # the names finalize adds (ppl, r2), from stand-in averages
            names = list(finalize(task, {k: 0.5 for k in scores}))
        except Exception:  # a finalize that needs real values: the ranks check the objective after the first eval
            return model
        logged = [f"val/{k}" for k in names if not k.startswith("_")]
        check(
            cfg.objective in logged,
            f"objective={cfg.objective}: {task_name} logs no such metric; it logs train/loss, {', '.join(logged)}",
        )
    return model


def _on_meta(what: str, run: Callable[[], Any]) -> Any:
    """`run()` on meta tensors; None where the code needs real values (`.item()`, data-dependent shapes), which
    the meta device cannot give: that part is then checked by the ranks, on real data."""
    try:
        return run()
    except ConfigError:
        raise
    except Exception as e:
        if "meta" in str(e).lower() or isinstance(e, NotImplementedError):
            return None
        lines = str(e).strip().splitlines()
        raise ConfigError(f"{what}: {type(e).__name__}: {lines[0] if lines else ''}".rstrip(": ")) from e


def _builtin(name: str) -> type:
    from ddpexp.parts import tasks

    return getattr(tasks, name)


def _build(what: str, build: Callable[[], Any]) -> Any:
    """`build()`, any error but a ConfigError turned into one line saying what was built."""
    try:
        return build()
    except ConfigError:
        raise
    except Exception as e:
        if isinstance(e.__cause__, ConfigError):  # raised in a constructor that Hydra's instantiate called
            raise e.__cause__ from None
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


def _facts(facts: dict[str, Any]) -> str:
    if "image_size" in facts:
        return f"{facts['in_channels']}x{facts['image_size']}x{facts['image_size']} images"
    return ", ".join(f"{k}={v}" for k, v in facts.items())


def _data_keys(node: dict) -> str:
    keys = [f"data.{k}={node[k]}" for k in ("name", "in_channels", "image_size", "block_size") if k in node]
    return ", ".join(keys) or f"data={node['_target_'].rsplit('.', 1)[-1]}"
