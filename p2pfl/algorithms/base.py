"""The contract between a decentralized method and the node daemon that runs it.

An algorithm is data-in, data-out (DESIGN.md, "Principles"): it never touches the network.
Each round the node

1. takes a :meth:`Algorithm.snapshot` and publishes :meth:`Algorithm.gossip` (small),
2. draws peers with :meth:`Algorithm.choose_peers` and waits (up to the round deadline) for
   their gossip,
3. asks :meth:`Algorithm.plan` which named part (``g``, ``h``, ``all``) to pull from whom,
4. pulls those parts (peers serve them from their snapshot of this round),
5. calls :meth:`Algorithm.merge` with what arrived, then trains locally with
   :meth:`Algorithm.extra_loss` added to the cross-entropy, then :meth:`Algorithm.after_train`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict

from p2pfl.models import SplitModel, part_keys

State = dict[str, torch.Tensor]
PullPlan = dict[str, str]  # peer id -> part ("g", "h" or "all")
ExtraLoss = Callable[[SplitModel, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

REGISTRY: dict[str, type[Algorithm]] = {}


class Params(BaseModel):
    """Base for a method's knobs (unknown keys rejected)."""

    model_config = ConfigDict(extra="forbid")


def register(cls: type[Algorithm]) -> type[Algorithm]:
    """Class decorator: make a method available under ``cls.name``."""
    if cls.name in REGISTRY:
        raise ValueError(f"algorithm {cls.name!r} registered twice")
    REGISTRY[cls.name] = cls
    return cls


@dataclass
class AlgorithmContext:
    """What a method may know about its node (no I/O handles)."""

    node_id: str
    model: SplitModel
    num_samples: int
    num_classes: int
    input_shape: tuple[int, ...]
    rng: np.random.Generator
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))


class Algorithm(ABC):
    """One decentralized method. Subclasses set ``name`` and ``Params``."""

    name: ClassVar[str]
    Params: ClassVar[type[BaseModel]] = Params

    def __init__(self, params: dict[str, Any], ctx: AlgorithmContext):
        self.params = self.Params.model_validate(params)
        self.ctx = ctx
        self.model = ctx.model

    # -- what peers see ------------------------------------------------------------------
    def snapshot(self) -> State:
        """A detached copy of the state that peers may pull this round."""
        return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}

    @staticmethod
    def select(state: State, part: str) -> State:
        """The named part (``g``, ``h``, ``all``) of a state, by parameter names."""
        return {k: state[k] for k in part_keys(list(state), part)}

    def gossip(self) -> dict[str, Any]:
        """Small per-round message published to neighbours (msgpack-able, may hold tensors)."""
        return {"n": self.ctx.num_samples}

    # -- one round -----------------------------------------------------------------------
    def choose_peers(self, candidates: list[str]) -> list[str]:
        """Peers to hear from this round (default: every live neighbour)."""
        return list(candidates)

    @abstractmethod
    def plan(self, gossip: dict[str, dict[str, Any]]) -> tuple[PullPlan, dict[str, Any]]:
        """Given the gossip of the peers that answered, return what to pull from whom and a
        dict of facts to log (divergences, decisions)."""

    @abstractmethod
    def merge(self, gossip: dict[str, dict[str, Any]], pulled: dict[str, State]) -> dict[str, Any]:
        """Combine the pulled parts (peers whose pull failed are absent) into the local model;
        return facts to log."""

    def extra_loss(self) -> ExtraLoss | None:
        """A term added to the cross-entropy during local training, or None."""
        return None

    def after_train(self) -> None:
        """Hook after local training (e.g. recompute representations); default: nothing."""
        return None
