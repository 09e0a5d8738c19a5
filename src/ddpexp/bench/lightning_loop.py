"""D for the benchmark: the same model, data, batch and optimizer trained by Lightning, as its users write it.

    python -m ddpexp.bench.lightning_loop --root R --world-size N --batch B --steps S --warmup W --out DIR

A LightningModule around the benchmark's model, torchvision's MNIST with ToTensor + Normalize in a DataLoader
(Lightning adds the DistributedSampler), and `Trainer(devices=N, strategy="ddp_spawn")`. Lightning itself sets
each process's threads to cores // processes. Writes DIR/result.json and DIR/weights.pt as the other loops do.
Needs `pip install lightning` (the `bench` extra); the benchmark runs it with --lightning."""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader

from ddpexp.bench.loops import MEAN, STD, build_model, parse_args


class Classifier(L.LightningModule):
    def __init__(self, model: str):
        super().__init__()
        self.net = build_model(model)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.01)


class Timing(L.Callback):
    """The figures the other loops report: end of the first optimizer step, steady samples/s, peak RSS."""

    def __init__(self, args: argparse.Namespace):
        self.args, self.first_step_at, self.steady_from, self.steady_to = args, 0.0, 0.0, 0.0

    def _sync(self) -> None:
        if torch.cuda.is_available() and self.args.device == "cuda":
            torch.cuda.synchronize()  # CUDA runs ahead of the host: time what it finished

    def on_train_batch_end(self, trainer: L.Trainer, *_: Any) -> None:
        step = trainer.global_step  # optimizer steps taken
        if step in (1, self.args.warmup, self.args.steps):
            self._sync()
        if step == 1 and not self.first_step_at:
            self.first_step_at = time.time()
        if step == self.args.warmup:
            self.steady_from = time.perf_counter()
        if step == self.args.steps:
            self.steady_to = time.perf_counter()

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        rss: list[Any] = [None] * trainer.world_size
        dist.all_gather_object(rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
        if trainer.global_rank != 0:
            return
        a = self.args
        os.makedirs(a.out, exist_ok=True)
        torch.save(module.net.state_dict(), os.path.join(a.out, "weights.pt"))
        result = {
            "loop": "lightning",
            "first_step_at": self.first_step_at,
            "samples_per_s": (a.steps - a.warmup) * a.batch * trainer.world_size / (self.steady_to - self.steady_from),
            "peak_rss_mb": [round(r, 1) for r in rss],
            "threads_per_rank": torch.get_num_threads(),
        }
        with open(os.path.join(a.out, "result.json"), "w") as f:
            json.dump(result, f)


def main() -> None:
    args = parse_args("python -m ddpexp.bench.lightning_loop", __doc__.split("\n\n")[0])
    from torchvision import datasets, transforms

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    L.seed_everything(args.seed, verbose=False)
    tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize((MEAN,), (STD,))])
    loader = DataLoader(datasets.MNIST(args.root, train=True, transform=tf), batch_size=args.batch, shuffle=True)
    trainer = L.Trainer(
        accelerator=args.device, devices=args.world_size, strategy="ddp_spawn", max_steps=args.steps,
        callbacks=[Timing(args)], logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=args.out,
    )  # fmt: skip
    trainer.fit(Classifier(args.model), loader)


if __name__ == "__main__":
    main()
