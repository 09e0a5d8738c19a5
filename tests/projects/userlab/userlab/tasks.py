"""The project's task: cross entropy to train, bits per character to score (lower is better, which its name does not
say). Written before ddpexp's tasks declared `directions`: it declares none. The others are broken on purpose."""

import math

import torch.nn.functional as F


class CharLM:
    def loss(self, model, batch):
        x, y = batch
        return F.cross_entropy(model(x), y)

    def metrics(self, model, batch):
        x, y = batch
        out = model(x)
        bits = F.cross_entropy(out, y, reduction="sum") / math.log(2)
        return {"bits_per_char": (bits, len(y)), "acc": ((out.argmax(1) == y).sum(), len(y))}


class PerCharLoss(CharLM):
    def loss(self, model, batch):
        x, y = batch
        return F.cross_entropy(model(x), y, reduction="none")  # not the mean: not a scalar


class TrainLossMetric(CharLM):
    def metrics(self, model, batch):
        return {**super().metrics(model, batch), "train/loss": (0.0, 1)}
