"""Typed run configuration: the dataclasses Hydra's YAML is checked against, converted once in the parent.

Every check lives in a `__post_init__` and raises ConfigError naming the key and the fix, so bad input fails
before any rank starts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from omegaconf import MISSING

from ddpexp.exceptions import ConfigError

PRECISIONS = ("auto", "fp32", "bf16", "fp16")
DEVICES = ("auto", "cuda", "cpu")
WANDB_MODES = ("auto", "online", "offline", "disabled")
OBJECTIVE_MODES = ("auto", "min", "max")


def check(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


def is_number(value: Any) -> bool:
    """An int or float, not a bool (YAML's true is an int to Python)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_choice(key: str, value: Any, choices: tuple[str, ...]) -> None:
    check(value in choices, f"{key}={value!r}: must be one of {', '.join(choices)}")


@dataclass
class LauncherConfig:
    """Fields every launcher has; each launcher's dataclass extends it (see launchers/)."""

    _target_: str = MISSING


@dataclass
class WandbConfig:
    mode: str = "auto"  # auto: online if an API key is configured, else offline
    project: str = "ddpexp"
    entity: str | None = None
    group: str | None = None  # default: the sweep (all jobs of one -m share it); none for single runs
    name: str | None = None  # default: the job's overrides
    tags: list[str] = field(default_factory=list)
    notes: str | None = None
    job_type: str | None = None
    init_timeout_s: float = 30.0  # wandb.init waiting longer than this falls back to offline

    def __post_init__(self) -> None:
        check_choice("wandb.mode", self.mode, WANDB_MODES)
        check(self.init_timeout_s > 0, f"wandb.init_timeout_s={self.init_timeout_s}: must be > 0")

    def with_environment(self, env: Mapping[str, str]) -> WandbConfig:
        """W&B's own variables (WANDB_MODE, WANDB_PROJECT, ...) for the keys left at their defaults: ddpexp passes
        every key to wandb.init, where an argument would override the variable. A key set in the config wins."""
        values: dict[str, Any] = {}
        mode = "disabled" if env.get("WANDB_DISABLED", "").lower() in ("true", "1") else env.get("WANDB_MODE")
        if self.mode == "auto" and mode:
            mode = {"dryrun": "offline", "run": "online"}.get(mode, mode)  # W&B's older names
            check_choice("WANDB_MODE", mode, WANDB_MODES[1:])
            values["mode"] = mode
        if self.project == "ddpexp" and env.get("WANDB_PROJECT"):
            values["project"] = env["WANDB_PROJECT"]
        if not self.tags and env.get("WANDB_TAGS"):
            values["tags"] = [t.strip() for t in env["WANDB_TAGS"].split(",") if t.strip()]
        for key, var in _WANDB_VARS.items():
            if getattr(self, key) is None and env.get(var):
                values[key] = env[var]
        return replace(self, **values)


_WANDB_VARS = {"entity": "WANDB_ENTITY", "group": "WANDB_RUN_GROUP", "name": "WANDB_NAME", "notes": "WANDB_NOTES",
               "job_type": "WANDB_JOB_TYPE"}  # fmt: skip


@dataclass
class DDPConfig:
    """Knobs passed to torch.nn.parallel.DistributedDataParallel."""

    find_unused_parameters: bool = False
    static_graph: bool = False
    gradient_as_bucket_view: bool = True
    bucket_cap_mb: float | None = None  # null: PyTorch's own, 25 MiB buckets after a 1 MiB first one
    sync_batchnorm: bool = False

    def __post_init__(self) -> None:
        check(
            self.bucket_cap_mb is None or self.bucket_cap_mb > 0, f"ddp.bucket_cap_mb={self.bucket_cap_mb}: must be > 0"
        )


@dataclass
class EarlyStopConfig:
    """Stop training when the objective has not improved for a while (checked after each evaluation)."""

    patience: int | None = None  # evaluations in a row without an improvement larger than min_delta; null: off
    min_delta: float = 0.0  # how much better than the best so far counts as an improvement

    def __post_init__(self) -> None:
        check(
            self.patience is None or (isinstance(self.patience, int) and self.patience >= 1),
            f"early_stop.patience={self.patience}: must be >= 1 (evaluations) or null (off)",
        )
        check(
            is_number(self.min_delta) and self.min_delta >= 0 and self.min_delta != float("inf"),
            f"early_stop.min_delta={self.min_delta}: must be a finite number >= 0",
        )


@dataclass
class DebugConfig:
    """Test and diagnosis hooks; all off by default."""

    check_replicas: bool = False  # all-gather the final parameters and record whether ranks agree
    fail_at_step: int | None = None  # raise on `fail_rank` after this optimizer step
    kill_at_step: int | None = None  # SIGKILL `fail_rank` after this step (not in a resumed run)
    hang_at_step: int | None = None  # `fail_rank` sleeps forever after this step (not in a resumed run)
    kill_in_save_at_step: int | None = None  # SIGKILL rank 0 midway through writing this step's checkpoint (idem)
    fail_rank: int = 0
    step_delay_s: float = 0.0  # sleep after every step: makes a short run long enough to signal in tests


@dataclass
class SweepConfig:
    """How a `-m` sweep runs its jobs (one sweep's jobs; a single run ignores it)."""

    parallel: int = 1  # jobs at once on this machine (spawn, torchrun), each on its own GPUs, or CPU cores without

    def __post_init__(self) -> None:
        check(
            isinstance(self.parallel, int) and self.parallel >= 1,
            f"sweep.parallel={self.parallel}: must be >= 1 (jobs of a sweep at once)",
        )


@dataclass
class Config:
    launcher: Any = MISSING  # a LauncherConfig subclass, chosen by `launcher=`
    model: Any = MISSING  # {_target_: ..., **kwargs}; called with the data's facts it accepts (num_classes, ...)
    data: Any = MISSING  # {_target_: ..., **kwargs}; returns ddpexp.data.Splits
    task: Any = MISSING  # {_target_: ..., **kwargs}; loss and metrics (ddpexp.tasks)
    optimizer: Any = MISSING  # {_target_: torch.optim.X, _partial_: true, ...}
    scheduler: Any = None  # {_target_: ..., _partial_: true, ...} or null
    wandb: WandbConfig = field(default_factory=WandbConfig)  # the W&B tracker's keys
    tracker: Any = None  # {name: keys} of `tracker=NAME` or `tracker=[A,B]`; typed by ddpexp.trackers; null: W&B
    strategy: Any = None  # `strategy=ddp` or `fsdp2`: a ddpexp.strategies dataclass; null: ddp (before the group)
    ddp: DDPConfig = field(default_factory=DDPConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    early_stop: EarlyStopConfig = field(default_factory=EarlyStopConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)

    gpus: int | None = None  # processes per node; null: all visible GPUs, or 2 CPU processes without GPUs
    device: str = "auto"
    epochs: int = 5
    max_steps: int | None = None  # optimizer steps; stops before `epochs` when reached
    batch_size: int = 64  # per process
    grad_accum: int = 1
    drop_last: bool = False  # true: each epoch leaves out its last, short global micro-batch (false: every sample once)
    precision: str = "auto"  # auto: bf16 autocast on a CUDA GPU that has bf16, else fp32 (bit-exact)
    clip_grad_norm: float | None = None
    seed: int = 0
    objective: str = "val/acc"  # the final metric a job returns to a sweeper (Optuna's study optimizes it): any it logs
    objective_mode: str = "auto"  # min or max; auto: the task's declared direction for `objective`
    on_nonfinite: str = "stop"  # a NaN/inf loss or metric: stop (exit 1, the last finite checkpoint kept) or warn
    dist_timeout_s: float = 300.0  # a collective waiting longer than this fails the job instead of hanging it
    log_every_n_steps: int = 10
    eval_every_n_epochs: int = 1
    checkpoint_every_n_epochs: int | None = None  # last.pt is always written at the end
    checkpoint_every_n_steps: int | None = None  # also mid-epoch; resume continues at the exact batch
    resume: str = "auto"  # auto: from this job dir's newest valid checkpoint if any; never; latest; or a PATH
    resume_allow_config_change: bool = False  # resume although model/data/optimizer/batch/seed/world size differ
    keep_last_checkpoints: int = 2  # step-N.pt files kept beside last.pt
    num_workers: int = 0
    compile: bool = False
    channels_last: bool | None = None  # null: on CUDA for models with 2-d convolutions
    keep_freed_memory: bool = True  # glibc malloc re-uses freed CPU memory instead of page-faulting it back each step
    plan: bool = False  # print what each rank would run (and the sbatch script), start nothing
    progress_bar: bool = True  # rank 0 only, and only when stderr is a terminal

    def __post_init__(self) -> None:
        check(self.gpus is None or self.gpus >= 1, f"gpus={self.gpus}: must be >= 1 (processes per node)")
        check_choice("device", self.device, DEVICES)
        check_choice("precision", self.precision, PRECISIONS)
        check_choice("on_nonfinite", self.on_nonfinite, ("stop", "warn"))
        check(
            self.objective == "train/loss" or (self.objective.startswith("val/") and len(self.objective) > 4),
            f"objective={self.objective!r}: must be train/loss or val/NAME, a metric the task logs (val/acc, val/loss, ...)",
        )
        check_choice("objective_mode", self.objective_mode, OBJECTIVE_MODES)
        check(self.epochs >= 1, f"epochs={self.epochs}: must be >= 1")
        check(self.max_steps is None or self.max_steps >= 1, f"max_steps={self.max_steps}: must be >= 1 or null")
        check(self.batch_size >= 1, f"batch_size={self.batch_size}: must be >= 1 (per process)")
        check(self.grad_accum >= 1, f"grad_accum={self.grad_accum}: must be >= 1")
        check(
            self.clip_grad_norm is None or self.clip_grad_norm > 0,
            f"clip_grad_norm={self.clip_grad_norm}: must be > 0 or null",
        )
        check(self.log_every_n_steps >= 1, f"log_every_n_steps={self.log_every_n_steps}: must be >= 1")
        check(self.eval_every_n_epochs >= 1, f"eval_every_n_epochs={self.eval_every_n_epochs}: must be >= 1")
        check(self.dist_timeout_s > 0, f"dist_timeout_s={self.dist_timeout_s}: must be > 0")
        check(self.keep_last_checkpoints >= 1, f"keep_last_checkpoints={self.keep_last_checkpoints}: must be >= 1")
        for key in ("checkpoint_every_n_steps", "checkpoint_every_n_epochs"):
            value = getattr(self, key)
            check(value is None or value >= 1, f"{key}={value}: must be >= 1 or null")
        check(bool(self.resume), "resume='': must be auto, never, latest or a checkpoint PATH")
        check(self.num_workers >= 0, f"num_workers={self.num_workers}: must be >= 0")
        for group in ("model", "data", "task", "optimizer"):
            node = getattr(self, group)
            check(
                isinstance(node, dict) and "_target_" in node,
                f"{group}: needs a _target_ (pick one with {group}=NAME or set {group}._target_)",
            )
