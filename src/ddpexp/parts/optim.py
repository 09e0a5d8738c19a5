"""LR schedules behind `scheduler=`, stepped once per optimizer step."""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any


def cosine(optimizer: Any, total_steps: int, warmup_steps: int = 0, min_lr_ratio: float = 0.0) -> Any:
    """Linear warm-up to the base LR, then cosine decay to `min_lr_ratio` x base LR at `total_steps`."""
    from torch.optim.lr_scheduler import LambdaLR

    from ddpexp.config import check

    check(
        isinstance(warmup_steps, int) and warmup_steps >= 0,
        f"scheduler.warmup_steps={warmup_steps!r}: must be an int >= 0",
    )
    check(
        isinstance(min_lr_ratio, (int, float)) and 0 <= min_lr_ratio <= 1,
        f"scheduler.min_lr_ratio={min_lr_ratio!r}: must be >= 0 and <= 1",
    )

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return LambdaLR(optimizer, factor)


def build_optimizer(factory: Callable[..., Any], params: Any, device: Any) -> Any:
    """`optimizer=`'s partial called on the parameters, with torch's fused kernels on CUDA (one launch for all
    parameters) unless the config already chose `fused` or `foreach`."""
    return factory(params, **fused_kwargs(factory, device))


def fused_kwargs(factory: Callable[..., Any], device: Any) -> dict[str, bool]:
    keywords = getattr(factory, "keywords", {})
    accepts = "fused" in inspect.signature(getattr(factory, "func", factory)).parameters
    chosen = "fused" in keywords or "foreach" in keywords
    return {"fused": True} if device.type == "cuda" and accepts and not chosen else {}


def call_accepting(fn: Callable[..., Any], *args: Any, **runtime: Any) -> Any:
    """Call `fn` with the runtime keywords its signature takes (all of them if it has **kwargs).

    Lets a user's model or scheduler class ignore facts it does not need (image_size, total_steps, ...)."""
    params = inspect.signature(fn).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        runtime = {k: v for k, v in runtime.items() if k in params}
    return fn(*args, **runtime)
