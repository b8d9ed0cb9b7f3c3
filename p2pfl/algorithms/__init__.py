"""Registry of federated-learning methods: one module per method, found automatically
(``build`` builds a node's model and method from the registry's class).

Adding a method touches one file: write ``p2pfl/algorithms/<name>.py`` with a class derived
from :class:`~p2pfl.algorithms.base.DecentralizedAlgorithm` (or
:class:`~p2pfl.algorithms.base.CentralizedAlgorithm`) decorated with :func:`register`; if it
keeps state between rounds beyond its model, it overrides ``extra_state`` and
``load_extra_state`` in the same file (base.py, "Checkpoints").

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
import importlib.metadata
import pkgutil
from typing import Any

from pydantic import ValidationError

from p2pfl.algorithms.base import (
    REGISTRY,
    SHARE_KINDS,
    Aggregate,
    AlgorithmContext,
    CentralizedAlgorithm,
    DecentralizedAlgorithm,
    Method,
    PullPlan,
    Upload,
    check_shares,
    register,
)
from p2pfl.config.suggest import with_suggestion

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

ENTRY_POINT_GROUP = "p2pfl.methods"
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
    for info in pkgutil.iter_modules(__path__):
        if info.name not in ("base", "build") and not info.name.startswith("_"):
            importlib.import_module(f"{__name__}.{info.name}")
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
        return cls.Params.model_validate(params or {}).model_dump()
    except ValidationError as exc:
        parts = []
        for err in exc.errors():
            loc = ".".join(str(x) for x in err["loc"])
            msg = err["msg"]
            if err["type"] == "extra_forbidden":
                knobs = cls.Params.model_fields if len(err["loc"]) == 1 else ()
                msg = with_suggestion("unknown field", str(err["loc"][-1]), knobs)
            parts.append(f"params.{loc}: {msg}")
        raise ValueError("; ".join(parts)) from None
