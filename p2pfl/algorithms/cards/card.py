"""A method's card: what a method is, without importing it (no torch).

A card is read by everyone who must judge a run before running it: a site's daemon and its
policy (what the method sends off the site, whether it loads outside code), ``p2pfl
submit`` and ``p2pfl policy check`` (the knobs), and ``p2pfl methods``. The method's class
takes its ``name``, ``kind``, ``shares`` and ``Params`` from its card, and
:func:`~p2pfl.algorithms.base.register` refuses a built-in class that disagrees with its
card, so the two cannot drift.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from p2pfl.config.schema import SHARE_KINDS

MethodKind = Literal["decentralized", "centralized"]


class Params(BaseModel):
    """Base for a method's knobs (unknown keys rejected)."""

    model_config = ConfigDict(extra="forbid")

    # knobs left out of the recorded knobs while unset (None), so a run that does not use
    # them records what it recorded before they existed (:func:`recorded_params`)
    unrecorded_when_none: ClassVar[frozenset[str]] = frozenset()


def recorded_params(params: BaseModel) -> dict[str, Any]:
    """A method's validated knobs as a run records them: every knob, less those its class
    names in ``unrecorded_when_none`` while they are None (a plugin's own model has none)."""
    data = params.model_dump()
    for name in getattr(type(params), "unrecorded_when_none", ()):
        if data.get(name) is None:
            data.pop(name, None)
    return data


class CentralizedParams(Params):
    """The knobs every centralized method has, defined once: each centralized method's
    ``Params`` derives from this model (a method whose ``Params`` does not gets it mixed in
    by :class:`~p2pfl.algorithms.base.CentralizedAlgorithm`)."""

    fraction: float = Field(
        1.0,
        gt=0,
        le=1,
        description="client fraction C (McMahan et al.): each round max(1, round(C·K)) of "
        "the round's K live members are drawn from the round's seed to train and upload; "
        "the others sit the round out and still receive the result (1: every member)",
    )


@dataclass(frozen=True)
class MethodCard:
    """What a method declares of itself: its ``name``; its ``kind`` (``decentralized``:
    peers pull from peers; ``centralized``: a rotating aggregator peer acts as the server);
    what it ``shares`` off a node, of :data:`~p2pfl.config.schema.SHARE_KINDS` (a site's
    policy ``share`` is checked against it, never against the name); its knobs' schema
    (``Params``, a pydantic model: defaults, bounds, descriptions); one line of
    ``summary``; and where its implementation lives (``implementation``,
    ``module:Class``), imported only by the processes that train."""

    name: str
    kind: MethodKind
    shares: frozenset[str]
    Params: type[BaseModel]
    summary: str
    implementation: str

    def __post_init__(self) -> None:
        if not self.shares <= set(SHARE_KINDS):
            raise ValueError(f"card {self.name}: shares {sorted(self.shares)} not of {SHARE_KINDS}")
        if self.kind == "centralized" and not issubclass(self.Params, CentralizedParams):
            raise ValueError(
                f"card {self.name}: a centralized method's Params derive from CentralizedParams"
            )
