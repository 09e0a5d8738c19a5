"""strategy=fsdp2: the model's parameters, gradients and optimizer state sharded over the ranks with FSDP2
(`torch.distributed.fsdp.fully_shard`), as torchtitan applies it: each unit (by default the model's repeated
blocks) is its own FSDP group, gathered for its forward and backward, then the root for what is left.

A checkpoint is a folder (rank/checkpoint.py save_sharded): every rank writes its own shards of the model and
optimizer with `torch.distributed.checkpoint` (DCP), rank 0 the plain rest; no rank ever gathers the whole model to
save. DCP reshards on load, so a resume at another world size loads the same state."""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from hydra.utils import instantiate
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from ddpexp.exceptions import ConfigError
from ddpexp.parts.optim import call_accepting
from ddpexp.rank import distributed, speed
from ddpexp.rank.model import build_model, seed_everything
from ddpexp.strategies import Fsdp2StrategyConfig, record

log = logging.getLogger("ddpexp")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class FSDP2:
    lockstep = True  # every forward all-gathers: the ranks run the same number of forwards, also in evaluation
    sharded = True  # a checkpoint is a DCP folder of every rank's shards

    def __init__(self, config: Fsdp2StrategyConfig, device: torch.device):
        self.config, self.device = config, device
        self.model: torch.nn.Module | None = None
        self.units: list[str] = []

    def build(self, cfg: Any, splits: Any, resumed: Any) -> tuple[torch.nn.Module, str, bool]:
        """The model on the meta device (no memory, no weights yet: `wrap` shards it, then gives each rank its
        shards' weights); (model, precision, channels_last: off, FSDP2 shards contiguous parameters)."""
        with torch.device("meta"):
            model = call_accepting(instantiate(cfg.model, _partial_=True), **splits.facts)
        precision, _ = speed.speed_defaults(cfg, self.device, model)
        self.resumed = resumed
        return model, precision, False

    def wrap(self, model: torch.nn.Module, cfg: Any, precision: str = "fp32", ckpt_dir: str = "") -> torch.nn.Module:
        """Shard the meta `model` in place (each unit, then the root), allocate this rank's shards on its device and
        fill them: from the checkpoint when resumed, else from the initial weights a ddp run of the same seed
        starts from (`_initial_weights`: written once by a process of rank 0's, read shard by shard)."""
        c = self.config
        param = DTYPES[c.param_dtype] if c.param_dtype else (torch.bfloat16 if precision == "bf16" else None)
        reduce = DTYPES[c.reduce_dtype] if c.reduce_dtype else (torch.float32 if param is not None else None)
        offload = CPUOffloadPolicy() if c.cpu_offload else OffloadPolicy()
        options = dict(
            reshard_after_forward=c.reshard_after_forward,
            mp_policy=MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce),
            offload_policy=offload,
        )
        units = find_units(model, c.units)
        for _, unit in units:
            if c.activation_checkpointing:
                from torch.distributed._composable import checkpoint

                checkpoint(unit)  # composable: the parameter names stay as they are
            fully_shard(unit, **options)
        fully_shard(model, **options)
        self.model, self.units = model, [name for name, _ in units]
        model.to_empty(device=self.device)
        if self.resumed is not None:
            self._load_weights(self.resumed.path)
        else:
            with _initial_weights(cfg, ckpt_dir) as path:
                self._load_weights(path)
        return model

    def _load_weights(self, path: str) -> None:
        """This rank's shards of the model's parameters, and its whole buffers, from the DCP folder `path`."""
        assert self.model is not None
        weights = {"model": get_model_state_dict(self.model)}
        buffers = dict(self.model.named_buffers())  # replicated, and non-persistent ones too (to_empty left them)
        if "buffers" in dcp_keys(path):
            weights["buffers"] = buffers
        dcp.load(weights, checkpoint_id=path)
        set_model_state_dict(self.model, weights["model"])

    def parameters(self) -> Any:
        assert self.model is not None
        return self.model.parameters()

    def micro_batch(self, sync: bool) -> AbstractContextManager[Any]:
        """The backward of a micro-batch: gradients reduce-scattered only at the step's last (sync)."""
        assert self.model is not None
        self.model.set_requires_gradient_sync(sync)  # type: ignore[operator]
        return nullcontext()

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """The norm over every shard's gradients (a DTensor reduction), each shard scaled by the same factor."""
        params = [p for p in self.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return norm

    def state(self, model: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
        return {}  # nothing of the model's in rank 0's file: the shards hold it

    def shards(self, model: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
        """The model's and optimizer's sharded state dicts (DTensors), for DCP: every rank's own part."""
        model_sd, optim_sd = get_state_dict(model, optimizer)
        return {"model": model_sd, "optimizer": optim_sd}

    def restore(self, resumed: Any, model: torch.nn.Module, optimizer: Any) -> None:
        """The weights and optimizer state from the checkpoint's shards, resharded to this world size."""
        if not resumed.state.get("sharded"):
            raise ConfigError(
                f"resume: {resumed.path} is a strategy=ddp checkpoint (one file); strategy=fsdp2 resumes its own "
                "sharded checkpoints only"
            )
        shards = self.shards(model, optimizer)
        dcp.load(shards, checkpoint_id=resumed.path)
        set_state_dict(model, optimizer, model_state_dict=shards["model"], optim_state_dict=shards["optimizer"])

    def replicas(self, model: torch.nn.Module) -> dict[str, Any]:
        return {"identical": None, "sharded": True}  # no replicas to compare: each rank holds its own shards

    def record(self) -> dict[str, Any]:
        return {"strategy": {**record(self.config), "units": self.units}}


def find_units(model: torch.nn.Module, units: Any) -> list[tuple[str, torch.nn.Module]]:
    """The submodules that become their own FSDP unit, outermost first, none inside another: those of the class
    names given, or (auto) the model's repeated blocks: of the children of its ModuleLists and Sequentials, the
    class that holds the most parameters, in at least two instances."""
    if units == "auto":
        totals: Counter[type] = Counter()
        counts: Counter[type] = Counter()
        for container in model.modules():
            if isinstance(container, (torch.nn.ModuleList, torch.nn.Sequential)):
                for child in container.children():
                    n = sum(p.numel() for p in child.parameters())
                    if n:
                        totals[type(child)] += n
                        counts[type(child)] += 1
        repeated = [
            cls for cls, n in counts.items() if n >= 2 and cls not in (torch.nn.Sequential, torch.nn.ModuleList)
        ]
        wanted = {max(repeated, key=lambda cls: totals[cls]).__name__} if repeated else set()
    else:
        wanted = set(units)
    found: list[tuple[str, torch.nn.Module]] = []
    for name, module in model.named_modules():
        if module is model or type(module).__name__ not in wanted:
            continue
        if any(name.startswith(f"{outer}.") for outer, _ in found):
            continue
        found.append((name, module))
    if units != "auto":
        missing = wanted - {type(m).__name__ for _, m in found}
        if missing:
            classes = sorted({type(m).__name__ for m in model.modules()})
            raise ConfigError(
                f"strategy.units: the model has no {', '.join(sorted(missing))} module (it has {', '.join(classes)})"
            )
    return found


def dcp_keys(path: str) -> set[str]:
    """The top-level keys of the DCP folder `path` ("model", "optimizer", "buffers")."""
    metadata = dcp.FileSystemReader(path).read_metadata()
    return {key.split(".", 1)[0] for key in metadata.state_dict_metadata}


@contextmanager
def _initial_weights(cfg: Any, ckpt_dir: str) -> Iterator[str]:
    """A DCP folder of the model's initial weights and buffers, as a ddp run of this seed builds them: rank 0 starts
    one process (not a rank: the ranks never hold the whole model) that seeds, builds the data, the task and the
    model as training does, and saves them; every rank then reads its shards of it; the folder is removed after."""
    path = os.path.join(ckpt_dir, f"initial.tmp.{distributed.broadcast(os.getpid())}")  # remove_partial's name
    if distributed.rank() == 0:
        os.makedirs(ckpt_dir, exist_ok=True)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # a project's modules too
        code = "from ddpexp.rank.fsdp2 import write_initial_weights as w; w()"
        done = subprocess.run([sys.executable, "-c", code], input=pickle.dumps((cfg, path)), env=env,
                              capture_output=True)  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"strategy=fsdp2: building the initial weights failed:\n{done.stderr.decode()[-2000:]}")
    distributed.barrier()
    try:
        yield path
    finally:
        distributed.barrier()
        if distributed.rank() == 0:
            shutil.rmtree(path, ignore_errors=True)


def write_initial_weights() -> None:
    """The process `_initial_weights` starts: (cfg, path) on stdin; the model as rank/train.py's build makes it,
    saved to `path` with DCP, in this one process."""
    cfg, path = pickle.loads(sys.stdin.buffer.read())  # from rank 0 of this job, through a pipe
    torch.set_num_threads(1)
    seed_everything(cfg.seed)
    splits = instantiate(cfg.data)
    instantiate(cfg.task, _convert_="all")  # as training builds it before the model: a task may draw numbers
    model, _, _ = build_model(cfg, torch.device("cpu"), splits, None)
    weights = {"model": model.state_dict(), "buffers": dict(model.named_buffers())}
    dcp.save(weights, checkpoint_id=path, no_dist=True)
