"""One rank of `ddpexp eval`: the run's parts built as training builds them (rank/model.py), the
checkpoint's weights loaded, then the training's own exact evaluation (rank/evaluation.py) over the split asked
for. Rank 0 writes the result where the parent said; the launcher calls `main(request, cfg, job)` per rank."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import torch
from hydra.utils import instantiate

from ddpexp.config import Config
from ddpexp.job import Job, write_json
from ddpexp.rank import checkpoint, distributed, speed
from ddpexp.rank.evaluation import evaluate
from ddpexp.rank.model import autocast_for, build_model, seed_everything
from ddpexp.rank.worker import device_for


@dataclass
class Request:
    """What the parent asks the ranks to score, and where rank 0 writes the record."""

    checkpoint: str  # the file's path
    split: str  # val or test: the Splits attribute
    record: str  # RUN_DIR/eval/NAME.json


def main(request: Request, cfg: Config, job: Job) -> None:
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    device = device_for(cfg, local_rank)
    speed.limit_threads(int(os.environ.get("LOCAL_WORLD_SIZE", world_size)), speed.cpu_quota())
    distributed.init(device, cfg.dist_timeout_s)
    try:
        start = time.time()
        state = checkpoint.load(request.checkpoint)  # weights_only
        seed_everything(cfg.seed)  # as training does before it builds the data: a factory that draws splits
        splits = instantiate(cfg.data)
        dataset = getattr(splits, request.split)
        task, task_name = instantiate(cfg.task, _convert_="all"), f"task={cfg.task['_target_']}"
        model, precision, channels_last = build_model(cfg, device, splits, None)
        checkpoint.model_weights(request.checkpoint, state, model)  # a sharded run's whole, on every rank
        memory_format = torch.channels_last if channels_last else torch.contiguous_format
        metrics, scored = evaluate(
            task, model, dataset, cfg.batch_size, device, autocast_for(device, precision), memory_format,
            task_name, split=request.split,
        )  # fmt: skip
        if rank == 0:
            record: dict[str, Any] = {
                "run_dir": job.dir, "checkpoint": request.checkpoint, "checkpoint_step": state.get("step"),
                "split": request.split, "metrics": metrics, "scored": scored, "split_samples": _length(dataset),
                "world_size": world_size, "device": str(device), "precision": precision,
                "batch_size": cfg.batch_size, "time": time.time(), "wall_time_s": round(time.time() - start, 3),
            }  # fmt: skip
            write_json(request.record, record)
    finally:
        distributed.teardown()


def _length(dataset: Any) -> int | None:
    try:
        return len(dataset)
    except TypeError:
        return None
