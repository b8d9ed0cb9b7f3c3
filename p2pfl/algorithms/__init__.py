"""Registry of federated-learning methods: one module per method, found automatically.

Adding a method touches one file: write ``p2pfl/algorithms/<name>.py`` with a class derived
from :class:`~p2pfl.algorithms.base.DecentralizedAlgorithm` (or
:class:`~p2pfl.algorithms.base.CentralizedAlgorithm`) decorated with :func:`register`; if it
keeps state between rounds beyond its model, it overrides ``extra_state`` and
``load_extra_state`` in the same file (base.py, "Checkpoints").
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from pydantic import ValidationError

from p2pfl.algorithms.base import (
    REGISTRY,
    Aggregate,
    AlgorithmContext,
    CentralizedAlgorithm,
    DecentralizedAlgorithm,
    Method,
    PullPlan,
    Upload,
    register,
)

__all__ = [
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
]

_loaded = False


def _load_all() -> None:
    global _loaded
    if _loaded:
        return
    for info in pkgutil.iter_modules(__path__):
        if info.name != "base" and not info.name.startswith("_"):
            importlib.import_module(f"{__name__}.{info.name}")
    _loaded = True


def known_algorithms() -> list[str]:
    _load_all()
    return sorted(REGISTRY)


def get_algorithm(name: str) -> type[Method]:
    _load_all()
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown algorithm {name!r}; known: {', '.join(known_algorithms())}"
        ) from None


def validate_params(name: str, params: dict[str, Any]) -> dict[str, Any]:
    """Validate a method's knobs with its own pydantic model; return them with defaults."""
    cls = get_algorithm(name)
    try:
        return cls.Params.model_validate(params or {}).model_dump()
    except ValidationError as exc:
        parts = []
        for err in exc.errors():
            loc = ".".join(str(x) for x in err["loc"])
            msg = "unknown field" if err["type"] == "extra_forbidden" else err["msg"]
            parts.append(f"params.{loc}: {msg}")
        raise ValueError("; ".join(parts)) from None
