"""A user's own tasks, outside ddpexp (the tests put this folder on PYTHONPATH and pick one by task._target_).

BrierTask is a plain class, no ddpexp base: cross entropy to train, and its own metric, the Brier score (the
squared error of the predicted class probabilities). The others are broken on purpose, one way each."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class BrierTask:
    def __init__(self, temperature: float = 1.0):
        self.temperature = temperature

    def loss(self, model, batch):  # type: ignore[no-untyped-def]
        x, y = batch
        return F.cross_entropy(model(x) / self.temperature, y)

    def metrics(self, model, batch):  # type: ignore[no-untyped-def]
        x, y = batch
        p = model(x).softmax(1)
        brier = ((p - F.one_hot(y, p.shape[1]).to(p.dtype)) ** 2).sum(1)
        return {"brier": (brier.sum(), len(y)), "acc": ((p.argmax(1) == y).sum(), len(y))}


class NoMetrics:
    def loss(self, model, batch):  # type: ignore[no-untyped-def]
        x, y = batch
        return F.cross_entropy(model(x), y)


class WrongSignature(BrierTask):
    def loss(self, batch):  # type: ignore[no-untyped-def,override]
        return torch.zeros(())


class VectorLoss(BrierTask):
    def loss(self, model, batch):  # type: ignore[no-untyped-def]
        x, y = batch
        return F.cross_entropy(model(x), y, reduction="none")  # per sample: not the mean


class CollidingMetric(BrierTask):
    def metrics(self, model, batch):  # type: ignore[no-untyped-def]
        scores = super().metrics(model, batch)
        return {**scores, "train/loss": scores["brier"]}  # would log as val/train/loss beside train/loss
