"""FedPer: federated averaging of the feature extractor ``g`` only.

Implements docs/algorithms.md, "FedPer": every participant uploads only ``g`` (the
convolutional / feature layers; docs/algorithms.md, "Split of every model into g and h"); the
aggregator averages it as FedAvg does (``g ← Σ n_i g_i / Σ n_i`` with the shared weighted
mean, docs/algorithms.md, "Shared aggregation": non-floating buffers from the first upload
in sorted node order, until the shared mean from the heaviest one) and sends it to all. Each
node keeps its own classifier ``h``.

A received state must hold exactly the model's ``g.*`` keys with the model's shapes; anything
else (an ``h`` key, an unknown key, a missing ``g`` key) is rejected with ``ValueError`` so a
peer can never overwrite a node's personal ``h``.
"""

from __future__ import annotations

from p2pfl.algorithms.base import register
from p2pfl.algorithms.cards.fedper import CARD
from p2pfl.algorithms.fedavg import FedAvg


@register
class FedPer(FedAvg):
    name = CARD.name
    shares = CARD.shares
    Params = CARD.Params
    upload_part = "g"
    needs_parts = frozenset({"g", "h"})  # g shared, h kept: without either it is FedAvg or Local
    # aggregate (mean of the uploaded g) and apply (load g only, strict=False after checking
    # the keys) are FedAvg's, driven by ``upload_part``.
