"""Attacks: Byzantine and free-riding behaviour for robustness experiments.

A topology's ``attacks:`` section makes some nodes misbehave: poison the models or
aggregates they serve (sign flip, scaling, Gaussian noise, NaN, ALIE, IPM, free riding),
train on flipped labels, claim inflated sample counts, or answer pulls late. An attack is a
wrapper around what a node serves or how it trains, never a branch inside a method: the node
asks its :class:`Adversary` (None for an honest node) at a few fixed points, and the methods
keep their honest code paths. :mod:`p2pfl.attacks.transforms` holds the pure maths,
:mod:`p2pfl.attacks.adversary` the per-node, per-round wrapper.
"""

from __future__ import annotations

from p2pfl.attacks.adversary import Adversary

__all__ = ["Adversary"]
