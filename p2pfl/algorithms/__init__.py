"""Federated-learning methods: one module per method and its card, found automatically
(``build`` builds a node's model and method from the registry's class).

Adding a built-in method is two new files and no other change: ``p2pfl/algorithms/<name>.py``
with a class derived from :class:`~p2pfl.algorithms.base.DecentralizedAlgorithm` (or
:class:`~p2pfl.algorithms.base.CentralizedAlgorithm`) decorated with :func:`register` (if it
keeps state between rounds beyond its model, it overrides ``extra_state`` and
``load_extra_state`` in the same file, base.py, "Checkpoints"), and its card,
``p2pfl/algorithms/cards/<name>.py`` (kind, shares, ``Params``): what a site judges a run by
without importing the method (:mod:`p2pfl.algorithms.cards`). Importing this package imports
neither: its names come with their first use (the registry, :mod:`~p2pfl.algorithms.registry`).

Outside this repository, the same one file registers a method in three ways, with the same
contract:

* an installed package declares it in the entry-point group ``p2pfl.methods``
  (``[project.entry-points."p2pfl.methods"] mymethod = "mypkg.mymethod:MyMethod"``); every
  entry point is loaded with the built-in methods, and one that fails to load is reported
  when its name is asked for;
* a topology names it by import path, ``algorithm.name: "mypkg.mymethod:MyMethod"``
  (registered under that path, in every node process);
* :func:`register_method` in the running process (a notebook, a test).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "SHARE_KINDS",
    "Aggregate",
    "DecentralizedAlgorithm",
    "CentralizedAlgorithm",
    "Method",
    "Upload",
    "AlgorithmContext",
    "PullPlan",
    "register",
    "get_algorithm",
    "validate_params",
    "known_algorithms",
    "register_method",
    "method_source",
    "ENTRY_POINT_GROUP",
]

_FROM_BASE = {
    "SHARE_KINDS",
    "Aggregate",
    "AlgorithmContext",
    "CentralizedAlgorithm",
    "DecentralizedAlgorithm",
    "Method",
    "PullPlan",
    "Upload",
    "register",
}


def __getattr__(name: str) -> Any:
    """The package's names, imported when first asked for: importing
    ``p2pfl.algorithms`` (or its torch-free :mod:`~p2pfl.algorithms.cards`) imports no
    method and no torch; the classes and the registry come with their first use."""
    if name in _FROM_BASE:
        return getattr(importlib.import_module("p2pfl.algorithms.base"), name)
    if name in __all__:
        return getattr(importlib.import_module("p2pfl.algorithms.registry"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
