"""A user's own tasks, outside ddpexp (the tests put this folder on PYTHONPATH and pick one by task._target_).

BrierTask is a plain class, no ddpexp base: cross entropy to train, and its own metric, the Brier score (the
squared error of the predicted class probabilities), which it declares minimized. BitsPerChar scores in bits, lower
is better, which no metric name could tell. The others are broken on purpose, one way each."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


class BrierTask:
    directions = {"brier": "min", "acc": "max"}

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


class BitsPerChar(BrierTask):
    """Each digit a character: the cross entropy of its prediction in bits (a language model's bits per char)."""

    directions = {"bits_per_char": "min", "acc": "max"}

    def metrics(self, model, batch):  # type: ignore[no-untyped-def]
        x, y = batch
        out = model(x)
        bits = F.cross_entropy(out, y, reduction="sum") / math.log(2)
        return {"bits_per_char": (bits, len(y)), "acc": ((out.argmax(1) == y).sum(), len(y))}


class Undeclared:
    """BrierTask without `directions`: which way val/brier is better, nothing says."""

    temperature = 1.0
    loss = BrierTask.loss
    metrics = BrierTask.metrics


class BadDirections(BrierTask):
    directions = {"brier": "minimize", "acc": "max"}  # min or max


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


class UndeclaredVectorLoss(Undeclared):
    """Broken twice: no directions (fine) and a per-sample loss (not): the loss is what gets named."""

    loss = VectorLoss.loss
