"""Exact evaluation for every built-in task: N gloo ranks (1, 2, 3) over a dataset whose length N does not divide
score each sample once (the samples scored are counted) and give the single-process metrics, of the model rank 0
holds (BatchNorm's running stats included, which DDP leaves different on each rank)."""

from __future__ import annotations

import json
import math
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from ddpexp.launchers.spawn import SpawnConfig, launch

N = 101  # odd, and not a multiple of 2 or 3


def case(name: str) -> tuple[Any, Any, Any]:
    """(task, dataset, model) of one task, with the model's BatchNorm stats set to something other than init."""
    import torch

    from ddpexp.parts import tasks
    from ddpexp.parts.models import gpt

    g = torch.Generator().manual_seed(1)
    torch.manual_seed(0)
    if name == "language_model":
        x = torch.randint(0, 11, (N, 6), generator=g)
        y = torch.randint(0, 11, (N, 6), generator=g)
        y[::7, 2] = -100  # ignored targets count for nothing
        return tasks.LanguageModel(), torch.utils.data.TensorDataset(x, y), gpt(11, 6, n_layer=1, n_embd=16)
    x = torch.randn(N, 4, generator=g)
    outputs = 3 if name == "classification" else 2
    y = torch.randint(0, 3, (N,), generator=g) if name == "classification" else torch.randn(N, 2, generator=g)
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.BatchNorm1d(5), torch.nn.Linear(5, outputs))
    with torch.no_grad():
        model[1].running_mean.uniform_(-1, 1, generator=g)
        model[1].running_var.uniform_(0.5, 2, generator=g)
    task = tasks.Classification(top_k=[1, 2]) if name == "classification" else tasks.Regression()
    return task, torch.utils.data.TensorDataset(x, y), model


NAMES = ("classification", "regression", "language_model")


def eval_worker(cfg: Any, job: Any) -> None:
    import torch
    import torch.distributed as dist

    from ddpexp.rank.evaluation import evaluate

    dist.init_process_group("gloo", init_method="env://")
    try:
        out = {}
        for name in NAMES:
            task, dataset, model = case(name)
            with torch.no_grad():  # as after a training step: each rank's stats moved with its own batch
                for m in model.modules():
                    if isinstance(m, torch.nn.BatchNorm1d):
                        m.running_mean += dist.get_rank()
            before = torch.get_rng_state()
            metrics, scored = evaluate(task, model, dataset, 8, torch.device("cpu"), nullcontext())  # in memory
            as_loader = torch.utils.data.Subset(dataset, range(len(dataset)))  # no batch(): through a DataLoader
            loader_metrics, loader_scored = evaluate(task, model, as_loader, 8, torch.device("cpu"), nullcontext())
            out[name] = {
                "metrics": metrics, "scored": scored, "loader": loader_metrics, "loader_scored": loader_scored,
                "rng_untouched": torch.equal(before, torch.get_rng_state()),
            }  # fmt: skip
        (Path(job.dir) / f"rank{dist.get_rank()}_of{dist.get_world_size()}.json").write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()


def expected(name: str) -> dict[str, float]:
    """The same metrics computed by hand in one process, over the whole set at once."""
    import torch
    import torch.nn.functional as F

    task, dataset, model = case(name)
    model.eval()
    x, y = dataset.tensors
    with torch.no_grad():
        out = model(x)
    if name == "classification":
        top2 = (out.topk(2, 1).indices == y[:, None]).any(1).float().mean().item()
        return {"val/loss": F.cross_entropy(out, y).item(), "val/acc": (out.argmax(1) == y).float().mean().item(),
                "val/top2": top2}  # fmt: skip
    if name == "regression":
        mse = ((out - y) ** 2).mean().item()
        return {
            "val/mse": mse,
            "val/mae": (out - y).abs().mean().item(),
            "val/r2": 1 - mse / y.var(unbiased=False).item(),
        }
    loss = F.cross_entropy(out.flatten(0, 1), y.flatten(), ignore_index=-100).item()
    valid = y.flatten() != -100
    acc = (out.flatten(0, 1).argmax(1) == y.flatten())[valid].float().mean().item()
    return {"val/loss": loss, "val/acc": acc, "val/ppl": math.exp(loss)}


@pytest.mark.timeout(180)
def test_distributed_eval_equals_single_process_for_every_task(tmp_path: Path) -> None:
    for n in (1, 2, 3):
        launch(
            eval_worker,
            SimpleNamespace(gpus=n, launcher=SpawnConfig(inline_single=True)),
            SimpleNamespace(dir=tmp_path),
        ).wait()
    for name in NAMES:
        want = expected(name)
        for n in (1, 2, 3):
            for rank in range(n):
                got = json.loads((tmp_path / f"rank{rank}_of{n}.json").read_text())[name]
                assert got["scored"] == got["loader_scored"] == N, (name, n)  # each sample once, none padded
                assert set(got["metrics"]) == set(want), (name, got["metrics"])
                for key, value in want.items():
                    assert got["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), (name, n, key)
                    assert got["loader"][key] == got["metrics"][key]  # sliced in memory or loaded: the same sums
                if name == "classification":  # counts are integers: exactly equal
                    assert got["metrics"]["val/acc"] * N == round(want["val/acc"] * N)
                assert got["rng_untouched"]  # a DataLoader draws its seed: the training RNG must not see it
