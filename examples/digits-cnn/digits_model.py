"""A small CNN of our own for 8x8 grayscale digits. p2pfl builds it with
``DigitsCNN(num_classes=10, input_shape=(1, 8, 8))``; the topology's ``model.personal``
makes its whole classifier head the personal part each node keeps."""

from __future__ import annotations

from torch import nn


class DigitsCNN(nn.Module):
    def __init__(self, num_classes: int, input_shape: tuple[int, ...], width: int = 16):
        super().__init__()
        channels, height, width_px = input_shape
        self.conv = nn.Sequential(
            nn.Conv2d(channels, width, 3, padding=1),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
        )
        features = 2 * width * (height // 2) * (width_px // 2)
        self.head = nn.Sequential(nn.Linear(features, 64), nn.ReLU(), nn.Linear(64, num_classes))

    def forward(self, x):
        return self.head(self.conv(x))
