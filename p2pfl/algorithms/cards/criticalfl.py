"""CriticalFL's card: its kind, what it shares and its knobs, read without importing the
method (:mod:`p2pfl.algorithms.criticalfl`, docs/algorithms.md)."""

from __future__ import annotations

from pydantic import Field

from p2pfl.algorithms.cards.card import CentralizedParams, MethodCard


class CriticalFLParams(CentralizedParams):
    initial_fraction: float = Field(
        0.2, gt=0, le=1, description="starting participants k0 = max(1, round(fraction · K))"
    )
    delta: float = Field(
        0.01,
        ge=0,
        description="relative rise of the windowed mean gradnorm marking a critical round",
    )
    window: int = Field(
        3, ge=1, le=1000, description="rounds in the moving window of mean gradnorm"
    )
    max_fraction: float = Field(
        0.75, gt=0, le=1, description="cap on participants: max(k0, floor(max_fraction · K))"
    )
    initial_detections: int = Field(
        2, ge=0, le=1000, description="the first N aggregations count as critical"
    )


CARD = MethodCard(
    name="criticalfl",
    kind="centralized",
    shares=frozenset({"whole_weights"}),
    Params=CriticalFLParams,
    summary="FedAvg whose participant count follows the critical learning periods",
    implementation="p2pfl.algorithms.criticalfl:CriticalFL",
)
