"""Method cards: what every method is, read without importing any method (no torch).

A card (:class:`~p2pfl.algorithms.cards.card.MethodCard`) says a method's name, kind, what
it shares off a node and its knobs' schema. A built-in method's card is the module of its
name in this package (``cards/<name>.py``, holding ``CARD``), found automatically as the
methods are; the method's class takes its ``name``, ``shares`` and ``Params`` from it.

Who reads cards, and why not the methods: a site's daemon judges runs proposed by peers
(docs/design.md, "Site policy"), and ``p2pfl submit``, ``p2pfl policy check`` and
``p2pfl methods`` answer in well under a second. Nothing here imports torch, a method's
implementation, or code a run names:

- a ``package.module:Class`` method is *outside code*: never imported here
  (:func:`is_outside_code`);
- a method an installed package declares (entry-point group ``p2pfl.methods``) is known by
  its name from the package metadata alone (:func:`installed_plugins`); its card is
  whatever the class says, learned by a short-lived child process where a site's policy
  allows plugins (:mod:`p2pfl.algorithms.cards.probe`).
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import pkgutil
from typing import Any

from pydantic import BaseModel, ValidationError

from p2pfl.algorithms.cards.card import CentralizedParams, MethodCard, Params, recorded_params
from p2pfl.config.suggest import with_suggestion

__all__ = [
    "CentralizedParams",
    "MethodCard",
    "Params",
    "builtin_card",
    "builtin_cards",
    "check_method_name",
    "check_params",
    "installed_plugins",
    "is_outside_code",
    "method_names",
    "params_error",
    "PLUGIN_GROUP",
]

PLUGIN_GROUP = "p2pfl.methods"
"""The entry-point group an installed package registers its methods in."""

_CARDS: dict[str, MethodCard] | None = None


def builtin_cards() -> dict[str, MethodCard]:
    """Every built-in method's card, by name (``cards/<name>.py``'s ``CARD``)."""
    global _CARDS
    if _CARDS is None:
        cards: dict[str, MethodCard] = {}
        for info in pkgutil.iter_modules(__path__):
            if info.name in ("card", "probe") or info.name.startswith("_"):
                continue
            card = importlib.import_module(f"{__name__}.{info.name}").CARD
            if card.name != info.name:
                raise ValueError(f"cards/{info.name}.py declares method {card.name!r}")
            cards[card.name] = card
        _CARDS = cards
    return _CARDS


def builtin_card(name: str) -> MethodCard | None:
    """The card of built-in method ``name``; None for any other name."""
    return builtin_cards().get(name)


@functools.cache
def installed_plugins() -> dict[str, str]:
    """The methods installed packages declare (entry-point group :data:`PLUGIN_GROUP`): name
    -> ``package <dist>``, read from the packages' metadata (nothing is imported), once a
    process, as the registry loads them once."""
    found: dict[str, str] = {}
    for ep in importlib.metadata.entry_points(group=PLUGIN_GROUP):
        if ep.name in builtin_cards():
            continue  # a plugin cannot take a built-in name (the registry refuses it)
        dist = getattr(ep, "dist", None)
        found[ep.name] = f"package {dist.name}" if dist is not None else f"entry point {ep.value}"
    return found


def method_names() -> list[str]:
    """Every method name a run can give without a path: built-in and installed, sorted."""
    return sorted({*builtin_cards(), *installed_plugins()})


def is_outside_code(name: str) -> bool:
    """Whether a method or model ``name`` is code from outside p2pfl: a
    ``package.module:name`` path, or a method an installed plugin declares."""
    return ":" in name or name in installed_plugins()


def check_method_name(name: str) -> None:
    """``ValueError`` naming the known methods (with "did you mean") unless ``name`` is a
    built-in method, an installed plugin's or a ``package.module:Class`` path."""
    if ":" in name or name in builtin_cards() or name in installed_plugins():
        return
    known = method_names()
    what = with_suggestion(f"unknown algorithm {name!r}", name, known)
    raise ValueError(f"{what}; known: {', '.join(known)} (or a 'package.module:Class' path)")


def params_error(params_model: type[BaseModel], exc: ValidationError) -> str:
    """A knobs' validation error as one line: ``params.<knob>: <why>`` per error, an
    unknown knob with "did you mean"."""
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err["loc"])
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            knobs = params_model.model_fields if len(err["loc"]) == 1 else ()
            msg = with_suggestion("unknown field", str(err["loc"][-1]), knobs)
        parts.append(f"params.{loc}: {msg}")
    return "; ".join(parts)


def check_params(name: str, params: dict[str, Any]) -> dict[str, Any]:
    """A method's knobs validated by its card, returned with their defaults: the check a
    spec or a topology takes before anything is imported. A built-in method's knobs are
    checked and filled in here; an outside method's (a plugin, a path) are left as given
    for the process that imports it. ``ValueError`` for an unknown method or a bad knob."""
    check_method_name(name)
    card = builtin_card(name)
    if card is None:
        return dict(params or {})
    try:
        return recorded_params(card.Params.model_validate(params or {}))
    except ValidationError as exc:
        raise ValueError(params_error(card.Params, exc)) from None
