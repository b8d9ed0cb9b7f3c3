"""The source of a user's own model module, written by tests into a temporary directory
(users keep theirs beside their topology). Shared by the tests of user models."""

USER_MODULE = '''
import math
import torch
from torch import nn


class Net(nn.Module):
    """An MLP with a BatchNorm, a dropout and a two-layer classifier: its default personal
    part is the last Linear, classifier.2."""

    def __init__(self, num_classes, input_shape, hidden=12):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), hidden), nn.ReLU())
        self.norm = nn.BatchNorm1d(hidden)
        self.drop = nn.Dropout(0.2)
        self.classifier = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))

    def forward(self, x):
        return self.classifier(self.drop(self.norm(self.body(x))))


def make(num_classes, input_shape, hidden=12):
    return Net(num_classes, input_shape, hidden)


class Logistic(nn.Module):
    """One parametrized module: a logistic regression over the flattened input."""

    def __init__(self, num_classes, input_shape):
        super().__init__()
        self.linear = nn.Linear(math.prod(input_shape), num_classes)

    def forward(self, x):
        return self.linear(x.flatten(1))


def logistic(num_classes, input_shape):
    return Logistic(num_classes, input_shape)


def bare_linear(num_classes, input_shape):
    return nn.Linear(input_shape[0], num_classes)


def raises(num_classes, input_shape):
    raise RuntimeError("no GPU found for this model")


def wrong_input(num_classes, input_shape):
    return nn.Sequential(nn.Flatten(), nn.Linear(999, 8), nn.ReLU(), nn.Linear(8, num_classes))


def not_a_module(num_classes, input_shape):
    return "a string"
'''
