"""FedAvg's card: its kind, what it shares and its knobs, read without importing the
method (:mod:`p2pfl.algorithms.fedavg`, docs/algorithms.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from p2pfl.algorithms.cards.card import CentralizedParams, MethodCard


class FedAvgParams(CentralizedParams):
    """FedAvg's and FedPer's knobs: the client fraction, FedProx's proximal term, and the
    adaptive server optimizer (FedAdam, FedYogi, FedAdagrad) with its knobs, each left
    unset taking that optimizer's default (:mod:`p2pfl.learning.server_opt`)."""

    unrecorded_when_none = frozenset({"server_opt", "server_lr", "beta1", "beta2", "tau"})

    mu: float = Field(
        0.0,
        ge=0,
        le=1e6,
        description="FedProx (Li et al., 2020): each node adds (mu/2)·||w − w_t||² to its loss, "
        "w_t the model it received (its shared part under FedPer); 0: plain FedAvg",
    )
    server_opt: Literal["adam", "yogi", "adagrad"] | None = Field(
        None,
        description="an adaptive server optimizer (Reddi et al., 2021) taking the round's "
        "mean as its pseudo-gradient: adam (FedAdam), yogi (FedYogi), adagrad "
        "(FedAdagrad); every member takes the same step (none: the mean is the model)",
    )
    server_lr: float | None = Field(
        None,
        gt=0,
        le=1e6,
        description="server_opt: its learning rate eta (default: adam 0.1, yogi 0.01, adagrad 0.1)",
    )
    beta1: float | None = Field(
        None,
        ge=0,
        lt=1,
        description="server_opt: the first moment's decay (default 0.9; adagrad 0)",
    )
    beta2: float | None = Field(
        None, ge=0, lt=1, description="server_opt: the second moment's decay (default 0.99)"
    )
    tau: float | None = Field(
        None,
        gt=0,
        le=1e6,
        description="server_opt: the adaptivity tau added to sqrt(v) (default: adam and "
        "adagrad 1e-9, yogi 1e-3)",
    )


CARD = MethodCard(
    name="fedavg",
    kind="centralized",
    shares=frozenset({"whole_weights"}),
    Params=FedAvgParams,
    summary="the sample-weighted mean of the participants' whole models",
    implementation="p2pfl.algorithms.fedavg:FedAvg",
)
