"""UAPDFL's card: its kind, what it shares and its knobs, read without importing the
method (:mod:`p2pfl.algorithms.uapdfl`, docs/algorithms.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from p2pfl.algorithms.cards.card import MethodCard, Params
from p2pfl.config.bounds import MAX_NODES


class UAPDFLParams(Params):
    divergence_rule: Literal["relative", "fixed"] = Field(
        "relative",
        description="relative: Div / mean drift of the pair against kappa; fixed: Div against th_I",
    )
    kappa: float = Field(2.0, gt=0, description="relative rule: threshold on Div / mean drift")
    th_I: float = Field(0.1, ge=0, description="fixed rule: divergence threshold (paper)")
    mu: float = Field(0.01, ge=0, description="weight of the auxiliary proximal term")
    aux_reduction: Literal["sum", "mean"] = Field(
        "sum", description="‖·‖² over the feature vector (paper) or its mean (÷ F)"
    )
    com: int = Field(
        5, ge=1, le=MAX_NODES, description="peers drawn among the neighbours each round"
    )
    unit_value: float = Field(1.0, description="value of every element of X_unit")
    eps: float = Field(1e-8, gt=0, description="guard against log(0) in KL")
    order: Literal["merge_first", "train_first"] = Field(
        "merge_first",
        description="merge then train, scored trained (paper's loop); or train then merge, "
        "scored merged",
    )


CARD = MethodCard(
    name="uapdfl",
    kind="decentralized",
    shares=frozenset({"representations", "whole_weights"}),
    Params=UAPDFLParams,
    summary="unit-representation-aided personalized decentralized FL (the native method)",
    implementation="p2pfl.algorithms.uapdfl:UAPDFL",
)
