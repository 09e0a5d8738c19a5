"""Exact evaluation: N gloo ranks over a dataset size not divisible by N give the single-process metrics, of the
model rank 0 holds (BatchNorm's running stats included, which DDP leaves different on each rank)."""

from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from ddpexp.launchers.spawn import SpawnConfig, launch


def dataset_and_model() -> tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(101, 4, generator=g), torch.randint(0, 3, (101,), generator=g)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.BatchNorm1d(5), torch.nn.Linear(5, 3))
    with torch.no_grad():
        model[1].running_mean.uniform_(-1, 1, generator=g)
        model[1].running_var.uniform_(0.5, 2, generator=g)
    return torch.utils.data.TensorDataset(x, y), model


def eval_worker(cfg: Any, job: Any) -> None:
    import torch
    import torch.distributed as dist

    from ddpexp.worker import evaluate

    dist.init_process_group("gloo", init_method="env://")
    try:
        dataset, model = dataset_and_model()
        with torch.no_grad():  # as after a training step: each rank's stats moved with its own batch
            model[1].running_mean += dist.get_rank()
        before = torch.get_rng_state()
        metrics = evaluate(model, dataset, 8, torch.device("cpu"), nullcontext())  # sliced in memory
        as_loader = torch.utils.data.Subset(dataset, range(len(dataset)))  # no batch(): through a DataLoader
        metrics.update(
            {f"loader_{k}": v for k, v in evaluate(model, as_loader, 8, torch.device("cpu"), nullcontext()).items()}
        )
        metrics["rng_untouched"] = torch.equal(before, torch.get_rng_state())
        out = Path(job.dir) / f"rank{dist.get_rank()}_of{dist.get_world_size()}.json"
        out.write_text(json.dumps(metrics))
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_distributed_eval_equals_single_process(tmp_path: Path) -> None:
    import torch
    import torch.nn.functional as F

    for n in (1, 2, 3):
        launch(
            eval_worker,
            SimpleNamespace(gpus=n, launcher=SpawnConfig(inline_single=True)),
            SimpleNamespace(dir=tmp_path),
        )
    dataset, model = dataset_and_model()
    model.eval()
    x, y = dataset.tensors
    with torch.no_grad():
        out = model(x)
    expected_loss = F.cross_entropy(out, y).item()
    expected_acc = (out.argmax(1) == y).sum().item() / 101
    for n in (1, 2, 3):
        for rank in range(n):
            got = json.loads((tmp_path / f"rank{rank}_of{n}.json").read_text())
            assert got["val/acc"] == expected_acc  # counts are integers: exactly equal, no padded duplicates
            assert got["val/loss"] == pytest.approx(expected_loss, rel=1e-6)
            assert (got["loader_val/acc"], got["loader_val/loss"]) == (got["val/acc"], got["val/loss"])
            assert got["rng_untouched"]  # a DataLoader draws its seed: the training RNG must not see it
