"""`task=`: what a run learns. A task owns what the loop treats as opaque: how a batch reaches the device, the
training loss and the evaluation metrics. Batches are whatever the data yields (a tuple, a dict, a dataclass).

Any object with these methods is a task (subclassing `Task` gives the defaults of the optional ones):

- `loss(model, batch) -> Tensor`: a scalar, the mean over the batch's items (samples, or what `count` counts).
- `metrics(model, batch) -> {name: (sum, count)}`: summed over every batch and rank, then divided; each
  evaluation sample is scored once. Logged as `val/NAME` (a name starting with `_` only feeds `finalize`).
- `count(batch) -> int | Tensor` (optional): how many items `loss` averages over, when that is not the number of
  samples (tokens, pixels, labels that are not ignored). The loop weights every micro-batch on every rank by it,
  so a step's gradient is that of the mean over all its items, exactly. Without it, items are samples.
- `items: str` (optional): what `count` counts, for the `{items}_per_s` throughput (e.g. "tokens").
- `directions: {name: "min" | "max"}` (optional): which way each metric is better, so that `objective_mode=auto`
  knows whether `val/NAME` is minimized or maximized, for best.pt, early stopping, a search's direction and
  `ddpexp report`'s order (train/loss is always minimized). Without it the run trains and records as ever.
- `finalize(averages) -> averages` (optional): metrics computed from the averaged ones, e.g. perplexity.
- `to_device(batch, device, memory_format)` (optional): the default moves every tensor in the batch.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import torch
import torch.nn.functional as F

from ddpexp.config import check, is_number
from ddpexp.exceptions import ConfigError

DIRECTIONS = ("min", "max")


class Task:
    """Defaults for a task's optional methods; `loss` and `metrics` are the task's own."""

    items = "items"
    # Read-only: a subclass gives its own dict; none declared: objective_mode=auto knows no direction for them.
    directions: Mapping[str, str] = MappingProxyType({})

    def to_device(self, batch: Any, device: torch.device, memory_format: Any = torch.contiguous_format) -> Any:
        return move(batch, device, memory_format)

    def loss(self, model: Any, batch: Any) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__}.loss(model, batch)")

    def metrics(self, model: Any, batch: Any) -> dict[str, tuple[Any, Any]]:
        raise NotImplementedError(f"{type(self).__name__}.metrics(model, batch)")

    def finalize(self, averages: dict[str, float]) -> dict[str, float]:
        return averages


class Classification(Task):
    """Cross entropy on integer class labels; metrics loss (plain cross entropy), acc and top-k accuracy."""

    directions: Mapping[str, str] = {"loss": "min", "acc": "max"}  # and each topK: max

    def __init__(self, top_k: Sequence[int] = (1,), label_smoothing: float = 0.0):
        check(
            isinstance(top_k, Sequence) and all(isinstance(k, int) and k >= 1 for k in top_k) and len(top_k) > 0,
            f"task.top_k={top_k!r}: must be a list of ints >= 1 (1: acc, 5: top5)",
        )
        check(
            is_number(label_smoothing) and 0 <= label_smoothing < 1,
            f"task.label_smoothing={label_smoothing!r}: must be >= 0 and < 1",
        )
        self.top_k, self.label_smoothing = sorted(set(top_k)), float(label_smoothing)
        self.directions = {**type(self).directions, **{f"top{k}": "max" for k in self.top_k if k > 1}}

    def loss(self, model: Any, batch: Any) -> torch.Tensor:
        x, y = batch
        out = model(x)
        _check_classes(out, y)
        return F.cross_entropy(out, y, label_smoothing=self.label_smoothing)

    def metrics(self, model: Any, batch: Any) -> dict[str, tuple[Any, Any]]:
        x, y = batch
        out = model(x)
        _check_classes(out, y)
        n = len(y)
        scores = {"loss": (F.cross_entropy(out.float(), y, reduction="sum"), n)}
        for k in self.top_k:
            hit = out.argmax(1) == y if k == 1 else (out.topk(min(k, out.shape[1]), 1).indices == y[:, None]).any(1)
            scores["acc" if k == 1 else f"top{k}"] = (hit.sum(), n)
        return scores


def _check_classes(out: torch.Tensor, y: torch.Tensor) -> None:
    """Refuse what cross entropy would silently accept: float targets (read as class probabilities) and a model
    with one output (log-softmax over one class is 0: the loss is 0.0000 and nothing is learned)."""
    if y.is_floating_point():
        raise ConfigError(
            f"task=classification: the targets are {y.dtype} values, not integer class labels; "
            "for real-valued targets use task=regression"
        )
    if out.dim() != 2 or out.shape[1] < 2:
        raise ConfigError(
            f"task=classification: the model outputs shape {tuple(out.shape)}; it needs (batch, classes) with "
            ">= 2 classes (one output: task=regression)"
        )


class Regression(Task):
    """Mean squared error; metrics mse, mae and r2 (1 - mse / the targets' variance: 0 is predicting the mean)."""

    directions: Mapping[str, str] = {"mse": "min", "mae": "min", "r2": "max"}

    def loss(self, model: Any, batch: Any) -> torch.Tensor:
        x, y = batch
        out = model(x)
        _check_regression(out, y)
        return F.mse_loss(out, y)

    def metrics(self, model: Any, batch: Any) -> dict[str, tuple[Any, Any]]:
        x, y = batch
        out = model(x)
        _check_regression(out, y)
        err, y = out.double() - y.double(), y.double()
        n = y.numel()
        return {"mse": ((err**2).sum(), n), "mae": (err.abs().sum(), n), "_y": (y.sum(), n), "_y2": ((y**2).sum(), n)}

    def finalize(self, averages: dict[str, float]) -> dict[str, float]:
        mean, square = averages.pop("_y"), averages.pop("_y2")
        variance = square - mean**2
        if variance > 0:  # undefined for constant targets (e.g. one val sample): not logged then
            averages["r2"] = 1 - averages["mse"] / variance
        return averages


def _check_regression(out: torch.Tensor, y: torch.Tensor) -> None:
    if not y.is_floating_point():
        raise ConfigError(f"task=regression: the targets are {y.dtype}; class labels need task=classification")
    if out.shape != y.shape:  # mse_loss would broadcast (batch, 1) against (batch,) into (batch, batch)
        raise ConfigError(
            f"task=regression: the model outputs shape {tuple(out.shape)} for targets of shape {tuple(y.shape)}; "
            "they must match"
        )


class LanguageModel(Task):
    """Next-token cross entropy averaged over the target tokens (those not `ignore_index`); batches are
    (tokens [B, T], next tokens [B, T]) and the model returns logits [B, T, vocab]. Metrics loss, acc, ppl."""

    items = "tokens"
    directions: Mapping[str, str] = {"loss": "min", "acc": "max", "ppl": "min"}

    def __init__(self, ignore_index: int = -100):
        check(isinstance(ignore_index, int), f"task.ignore_index={ignore_index!r}: must be an int")
        self.ignore_index = ignore_index

    def count(self, batch: Any) -> torch.Tensor:
        return (batch[1] != self.ignore_index).sum()

    def loss(self, model: Any, batch: Any) -> torch.Tensor:
        x, y = batch
        logits = model(x)
        _check_tokens(logits, y)
        return F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=self.ignore_index)

    def metrics(self, model: Any, batch: Any) -> dict[str, tuple[Any, Any]]:
        x, y = batch
        logits = model(x)
        _check_tokens(logits, y)
        logits, y = logits.flatten(0, 1).float(), y.flatten()
        valid = y != self.ignore_index
        n = valid.sum()
        loss = F.cross_entropy(logits, y, ignore_index=self.ignore_index, reduction="sum")
        return {"loss": (loss, n), "acc": (((logits.argmax(1) == y) & valid).sum(), n)}

    def finalize(self, averages: dict[str, float]) -> dict[str, float]:
        averages["ppl"] = math.exp(min(averages["loss"], 700.0))  # exp overflows a float past ~709
        return averages


def _check_tokens(logits: torch.Tensor, y: torch.Tensor) -> None:
    if y.is_floating_point() or logits.dim() != 3 or logits.shape[:2] != y.shape:
        raise ConfigError(
            f"task=language_model: the model outputs shape {tuple(logits.shape)} for targets of shape "
            f"{tuple(y.shape)} ({y.dtype}); it needs logits (batch, time, vocab) for integer tokens (batch, time)"
        )


def to_device(task: Any, batch: Any, device: torch.device, memory_format: Any) -> Any:
    """`task.to_device`, or the default for a task without one (any object with loss and metrics is a task)."""
    own = getattr(task, "to_device", None)
    return own(batch, device, memory_format) if own is not None else move(batch, device, memory_format)


def finalize(task: Any, averages: dict[str, float]) -> dict[str, float]:
    """`task.finalize`, or the averages as they are."""
    own = getattr(task, "finalize", None)
    return own(averages) if own is not None else averages


def directions(task: Any) -> dict[str, str]:
    """Which way each metric is better (min or max), as the task declares it, by the names the run record uses
    (val/NAME); train/loss is always minimized: it is the loss the loop steps on."""
    return {"train/loss": "min", **{f"val/{k}": v for k, v in dict(getattr(task, "directions", None) or {}).items()}}


def objective_mode(task: Any, objective: str, mode: str, stated: str | None = None) -> str | None:
    """`objective_mode` resolved to min or max: as given, or (auto) the task's own declaration for `objective`, or
    else the direction the user stated elsewhere (`stated`: a sweeper's `direction`). None when nothing says:
    guessing from the name would sort val/mse upside down, so the run trains and records without a direction
    (no best.pt, an unsorted report); only what cannot work without one is refused (early stopping)."""
    if mode != "auto":
        return mode
    return directions(task).get(objective) or stated


def unknown_direction(task: Any, task_name: str, objective: str) -> str:
    """Why objective_mode=auto found no direction for `objective`, and what to set: for a warning or an error."""
    declared = ", ".join(f"{k} {v}" for k, v in dict(getattr(task, "directions", None) or {}).items())
    return (
        f"objective_mode=auto: {task_name} declares no direction for objective={objective} "
        f"({'its directions: ' + declared if declared else 'it has no directions'}); set objective_mode=min or "
        f"objective_mode=max, or add {objective.removeprefix('val/')!r} to the task's directions"
    )


def move(batch: Any, device: torch.device, memory_format: Any = torch.contiguous_format) -> Any:
    """Every tensor of a batch (nested tuples, lists, dicts, dataclasses; anything with .to) on `device`; 4-d float
    tensors (images) in `memory_format`."""
    if isinstance(batch, torch.Tensor):
        if memory_format is not torch.contiguous_format and batch.dim() == 4 and batch.is_floating_point():
            return batch.to(device, non_blocking=True, memory_format=memory_format)
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return type(batch)({k: move(v, device, memory_format) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(move(v, device, memory_format) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(move(v, device, memory_format) for v in batch)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        fields = {f.name: move(getattr(batch, f.name), device, memory_format) for f in dataclasses.fields(batch)}
        return dataclasses.replace(batch, **{k: v for k, v in fields.items() if _init_field(batch, k)})
    if hasattr(batch, "to"):
        return batch.to(device)
    return batch


def _init_field(obj: Any, name: str) -> bool:
    return next(f for f in dataclasses.fields(obj) if f.name == name).init


def samples(batch: Any) -> int:
    """How many samples a batch holds: the length of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return len(batch)
    if isinstance(batch, dict):
        batch = list(batch.values())
    elif dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        batch = [getattr(batch, f.name) for f in dataclasses.fields(batch)]
    if isinstance(batch, (list, tuple)):
        for item in batch:
            n = samples(item)
            if n >= 0:
                return n
    return -1


def check_interface(task: Any, name: str) -> None:
    """The methods the loop calls exist and take the arguments it passes; ConfigError naming the method."""
    for method, params in (("loss", 2), ("metrics", 2), ("count", 1), ("finalize", 1), ("to_device", 3)):
        fn = getattr(task, method, None)
        if fn is None:
            check(method not in ("loss", "metrics"), f"{name}: has no {method}(model, batch) method")
            continue
        check(callable(fn), f"{name}.{method}: is not a method")
        try:
            inspect.signature(fn).bind(*range(params))
        except TypeError as e:
            expected = {"loss": "model, batch", "metrics": "model, batch", "count": "batch", "finalize": "averages",
                        "to_device": "batch, device, memory_format"}[method]  # fmt: skip
            raise ConfigError(f"{name}.{method}{inspect.signature(fn)}: must take ({expected}) ({e})") from None
        except ValueError:  # a builtin without a signature
            continue
    declared = getattr(task, "directions", None)
    check(
        declared is None or _is_directions(declared),
        f"{name}.directions={declared!r}: must map metric names as metrics() returns them (no val/) to 'min' or 'max'",
    )


def _is_directions(value: Any) -> bool:
    return isinstance(value, Mapping) and all(
        isinstance(k, str) and "/" not in k and v in DIRECTIONS for k, v in value.items()
    )


def check_loss(loss: Any, name: str) -> torch.Tensor:
    """A loss the loop can step on: a scalar floating tensor."""
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.is_floating_point():
        got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ConfigError(f"{name}.loss: must return a scalar float tensor (the mean over the batch), got {got}")
    return loss


def check_metrics(scores: Any, name: str) -> dict[str, tuple[Any, Any]]:
    """{name: (sum, count)}, each name plain: it is logged as val/NAME beside train/loss, lr, step and epoch, so
    a '/' or a 'val/' of its own would collide with the record's namespaces. Names starting with '_' are helpers
    for `finalize` and are not logged."""
    if not isinstance(scores, dict):
        raise ConfigError(f"{name}.metrics: must return a dict {{name: (sum, count)}}, got {type(scores).__name__}")
    for key, value in scores.items():
        if not isinstance(key, str) or not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", key):
            raise ConfigError(
                f"{name}.metrics: metric name {key!r} collides with the record's keys: use a plain name such as "
                "'acc' (letters, digits, _ . -), logged as val/NAME"
            )
        if not (isinstance(value, (tuple, list)) and len(value) == 2):
            raise ConfigError(f"{name}.metrics: {key!r} must be a (sum, count) pair, got {value!r}")
    return scores
