"""The project's own task: cross entropy to train, and its own metric, balanced accuracy (the mean of the
per-class recalls; wine's three cultivars are not equally common). ddpexp calls loss and metrics, adds the
(sum, count) pairs over every batch and rank, then finalize turns the per-class recalls into their mean; the
directions say which way each metric is better, for objective_mode=auto (sweeps and `ddpexp report`)."""

from __future__ import annotations

import torch.nn.functional as F


class BalancedAccuracy:
    directions = {"loss": "min", "acc": "max", "balanced_acc": "max"}  # which way each metric is better

    def __init__(self, num_classes: int = 3):
        self.num_classes = num_classes

    def loss(self, model, batch):
        x, y = batch
        return F.cross_entropy(model(x), y)

    def metrics(self, model, batch):
        x, y = batch
        out = model(x)
        hit = out.argmax(1) == y
        scores = {"loss": (F.cross_entropy(out, y, reduction="sum"), len(y)), "acc": (hit.sum(), len(y))}
        for c in range(self.num_classes):  # '_' names only feed finalize: they are not logged
            scores[f"_recall{c}"] = ((hit & (y == c)).sum(), (y == c).sum())
        return scores

    def finalize(self, averages):
        recalls = [averages.pop(f"_recall{c}") for c in range(self.num_classes)]
        averages["balanced_acc"] = sum(recalls) / len(recalls)
        return averages
