"""DiversiFed's card: its kind, what it shares and its knobs, read without importing the
method (:mod:`p2pfl.algorithms.diversifed`, docs/algorithms.md)."""

from __future__ import annotations

from pydantic import Field

from p2pfl.algorithms.cards.card import CentralizedParams, MethodCard


class DiversiFedParams(CentralizedParams):
    tau: float = Field(1.0, gt=0, description="temperature τ scaling the model distances")
    alpha: float = Field(1.0, gt=0, description="server step size α on L_d")
    lam: float = Field(2.0, ge=0, description="λ: the proximal term is (λ/2α)‖w − z_i‖²")
    eps: float = Field(1e-12, gt=0, description="distances ≤ eps count as coincident models")


CARD = MethodCard(
    name="diversifed",
    kind="centralized",
    shares=frozenset({"whole_weights"}),
    Params=DiversiFedParams,
    summary="learning from similar and dissimilar clients via a model-distance loss",
    implementation="p2pfl.algorithms.diversifed:DiversiFed",
)
