"""DFedAvgM's card: its kind, what it shares and its knobs, read without importing the
method (:mod:`p2pfl.algorithms.dfedavgm`, docs/algorithms.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from p2pfl.algorithms.cards.card import MethodCard, Params
from p2pfl.config.bounds import MAX_NODES


class DFedAvgMParams(Params):
    mixing: Literal["models", "deltas"] = Field(
        "models",
        description="models: x_i ← weighted mean of the trained models (the paper); "
        "deltas: x_i ← x_i + weighted mean of the round's deltas",
    )
    fp16_deltas: bool = Field(
        False,
        description="publish what peers pull (model or delta) as float16 (half the bytes; "
        "~5e-4 relative rounding, clamped to ±65504); receivers cast back to float32",
    )
    weighted: bool = Field(
        True, description="weight deltas by the nodes' training sample counts (False: uniform)"
    )
    peers: int | None = Field(
        None,
        ge=1,
        le=MAX_NODES,
        description="neighbours drawn each round (None: every live neighbour)",
    )


CARD = MethodCard(
    name="dfedavgm",
    kind="decentralized",
    shares=frozenset({"whole_weights"}),
    Params=DFedAvgMParams,
    summary="decentralized federated averaging with momentum (Sun et al., 2021)",
    implementation="p2pfl.algorithms.dfedavgm:DFedAvgM",
)
