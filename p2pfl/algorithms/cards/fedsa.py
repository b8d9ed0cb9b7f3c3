"""FedSA's card: its kind, what it shares and its knobs, read without importing the
method (:mod:`p2pfl.algorithms.fedsa`, docs/algorithms.md)."""

from __future__ import annotations

from pydantic import Field

from p2pfl.algorithms.cards.card import CentralizedParams, MethodCard
from p2pfl.config.bounds import MAX_NODES


class FedSAParams(CentralizedParams):
    cv_t: float = Field(0.2, ge=0, description="threshold on the normalised cv (high dispersion)")
    sim_t: float = Field(0.2, description="minimum similarity to join or form a cluster")
    c_mic: int = Field(4, ge=1, le=MAX_NODES, description="number of MIC categories C")
    s_mac: int = Field(4, ge=1, le=MAX_NODES, description="maximum number of MAC clusters S")
    eps: float = Field(1e-12, gt=0, description="guard for |μ| = 0 and zero ranges")
    weighted: bool = Field(
        False, description="low-dispersion positions: sample-weighted mean (paper: plain mean)"
    )


CARD = MethodCard(
    name="fedsa",
    kind="centralized",
    shares=frozenset({"whole_weights"}),
    Params=FedSAParams,
    summary="parameter-skew-aware aggregation (one global model)",
    implementation="p2pfl.algorithms.fedsa:FedSA",
)
