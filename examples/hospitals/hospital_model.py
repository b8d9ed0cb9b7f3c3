"""The hospitals' own model: a small MLP over the 30 tabular features. p2pfl builds it with
``HospitalMLP(num_classes=2, input_shape=(30,), hidden=...)``; its last layer,
``classifier``, is the personal part each hospital keeps (p2pfl's default: the last
``nn.Linear``)."""

from __future__ import annotations

import math

from torch import nn


class HospitalMLP(nn.Module):
    def __init__(self, num_classes: int, input_shape: tuple[int, ...], hidden: int = 32):
        super().__init__()
        self.features = nn.Sequential(
            nn.Flatten(),
            nn.Linear(math.prod(input_shape), hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
        )
        self.classifier = nn.Linear(hidden, num_classes)

    def forward(self, x):
        return self.classifier(self.features(x))
