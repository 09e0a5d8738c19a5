"""The project's own model. ddpexp calls it with the keys of conf/model/tinynet.yaml plus whichever of the data's
facts (Splits: here num_classes and in_features) it accepts."""

from __future__ import annotations

from torch import nn


class TinyNet(nn.Module):
    """Features -> LayerNorm'd hidden layer with a residual block -> class logits."""

    def __init__(self, num_classes: int, in_features: int, hidden: int = 32):
        super().__init__()
        self.inp = nn.Sequential(nn.Linear(in_features, hidden), nn.LayerNorm(hidden), nn.GELU())
        self.block = nn.Sequential(nn.Linear(hidden, hidden), nn.GELU())
        self.out = nn.Linear(hidden, num_classes)

    def forward(self, x):
        h = self.inp(x)
        return self.out(h + self.block(h))
