"""FedAvg's card: its kind, what it shares and its knobs, read without importing the
method (:mod:`p2pfl.algorithms.fedavg`, docs/algorithms.md)."""

from __future__ import annotations

from pydantic import Field

from p2pfl.algorithms.cards.card import CentralizedParams, MethodCard


class FedAvgParams(CentralizedParams):
    """FedAvg's and FedPer's knobs: the client fraction, and FedProx's proximal term."""

    mu: float = Field(
        0.0,
        ge=0,
        le=1e6,
        description="FedProx (Li et al., 2020): each node adds (mu/2)·||w − w_t||² to its loss, "
        "w_t the model it received (its shared part under FedPer); 0: plain FedAvg",
    )


CARD = MethodCard(
    name="fedavg",
    kind="centralized",
    shares=frozenset({"whole_weights"}),
    Params=FedAvgParams,
    summary="the sample-weighted mean of the participants' whole models",
    implementation="p2pfl.algorithms.fedavg:FedAvg",
)
