"""The registry of methods that run: their classes, imported (torch with them) by the
processes that train, validate or list them. The package's docstring says how a method is
added; what a method is without importing it is its card (:mod:`p2pfl.algorithms.cards`)."""

from __future__ import annotations

import importlib
import importlib.metadata
import pkgutil
from typing import Any

from pydantic import ValidationError

import p2pfl.algorithms as algorithms
from p2pfl.algorithms.base import (
    REGISTRY,
    CentralizedAlgorithm,
    DecentralizedAlgorithm,
    Method,
    check_shares,
)
from p2pfl.algorithms.cards import PLUGIN_GROUP, params_error
from p2pfl.algorithms.cards.card import recorded_params
from p2pfl.config.suggest import with_suggestion

ENTRY_POINT_GROUP = PLUGIN_GROUP
_NOT_METHODS = ("base", "build", "cards", "registry")  # modules of the package that hold no method
_loaded = False
_SOURCES: dict[str, str] = {}  # method name -> where it came from (built-in, a package, a path)
_PLUGIN_ERRORS: dict[str, str] = {}  # entry-point name -> why it did not load


def register_method(cls: type[Method], *, name: str | None = None) -> type[Method]:
    """Register a method class made outside ``p2pfl/algorithms/`` (the same contract as a
    built-in one: a :class:`DecentralizedAlgorithm` or :class:`CentralizedAlgorithm` with a
    ``name`` and a ``Params`` model). ``name`` overrides ``cls.name``. Registering the same
    class twice is harmless; another class under a taken name is a ``ValueError``."""
    if not (
        isinstance(cls, type)
        and issubclass(cls, (DecentralizedAlgorithm, CentralizedAlgorithm))
        and cls not in (DecentralizedAlgorithm, CentralizedAlgorithm)
    ):
        raise TypeError(
            f"{cls!r} is not a method: derive it from DecentralizedAlgorithm or "
            "CentralizedAlgorithm (p2pfl.algorithms)"
        )
    key = name or getattr(cls, "name", None)
    if not isinstance(key, str) or not key:
        raise ValueError(f"{cls.__name__}: a method needs a class attribute name = '...'")
    check_shares(cls)
    _load_all()
    if REGISTRY.get(key) is cls:
        return cls
    if key in REGISTRY:
        raise ValueError(f"method {key!r} is registered already ({method_source(key)})")
    REGISTRY[key] = cls
    _SOURCES[key] = f"{cls.__module__}.{cls.__qualname__}"
    return cls


def _load_entry_points() -> None:
    """Import every ``p2pfl.methods`` entry point; a class it names is registered under the
    entry point's name unless its module registered it already. Every method that appears
    while one entry point loads comes from that entry point's package."""
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = getattr(ep, "dist", None)
        origin = f"package {dist.name}" if dist is not None else f"entry point {ep.value}"
        before = set(REGISTRY)
        try:
            obj = ep.load()
        except Exception as exc:  # a broken plugin must not break the built-in methods
            _PLUGIN_ERRORS[ep.name] = f"entry point {ep.value!r} failed to load: {exc!r}"
            obj = None
        if isinstance(obj, type) and obj not in REGISTRY.values():
            try:
                register_method(obj, name=ep.name)
            except (TypeError, ValueError) as exc:  # not a method, or a name already taken
                _PLUGIN_ERRORS[ep.name] = f"entry point {ep.value!r}: {exc}"
        for key in set(REGISTRY) - before:
            _SOURCES[key] = origin


def _load_all() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True  # before the entry points: they may call register_method
    for info in pkgutil.iter_modules(algorithms.__path__):
        if info.name not in _NOT_METHODS and not info.name.startswith("_"):
            importlib.import_module(f"{algorithms.__name__}.{info.name}")
    for key in REGISTRY:
        _SOURCES.setdefault(key, "built-in")
    _load_entry_points()


def method_source(name: str) -> str:
    """Where method ``name`` comes from: ``built-in``, ``package <dist>``, or the class's
    import path."""
    _load_all()
    return _SOURCES.get(name, "registered in this process")


def known_algorithms() -> list[str]:
    _load_all()
    return sorted(REGISTRY)


def get_algorithm(name: str) -> type[Method]:
    """The method registered as ``name``; a ``package.module:Class`` path is imported and
    registered under that path. ``ValueError`` naming the known methods otherwise."""
    _load_all()
    if name in REGISTRY:
        return REGISTRY[name]
    if name in _PLUGIN_ERRORS:
        raise ValueError(f"method {name!r}: {_PLUGIN_ERRORS[name]}")
    if ":" in name:
        from p2pfl.learning.user_code import UserCodeError, import_object

        try:
            cls = import_object(name, "method")
            return register_method(cls, name=name)
        except (UserCodeError, TypeError, ValueError) as exc:
            raise ValueError(str(exc)) from None
    what = with_suggestion(f"unknown algorithm {name!r}", name, known_algorithms())
    raise ValueError(
        f"{what}; known: {', '.join(known_algorithms())} (or a 'package.module:Class' path)"
    )


def validate_params(name: str, params: dict[str, Any]) -> dict[str, Any]:
    """Validate a method's knobs with its own pydantic model; return them with defaults."""
    cls = get_algorithm(name)
    try:
        return recorded_params(cls.Params.model_validate(params or {}))
    except ValidationError as exc:
        raise ValueError(params_error(cls.Params, exc)) from None
