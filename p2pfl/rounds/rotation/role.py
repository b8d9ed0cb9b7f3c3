"""What every part of the rotation knows of its node: :class:`RotationRole`."""

from __future__ import annotations

from p2pfl.algorithms.base import CentralizedAlgorithm
from p2pfl.config.schema import TopologyConfig
from p2pfl.services.bundle import NodeServices


class RotationRole:
    """A part of one node's rotation (the driver, a member's steps, the aggregator's, the
    auditor's, secure rounds): its node's ``services``, its centralized method ``alg``, its
    ``id``, its ``cfg`` and the swarm's ``members``."""

    def __init__(self, services: NodeServices) -> None:
        assert isinstance(services.method, CentralizedAlgorithm)
        self.services = services
        self.alg: CentralizedAlgorithm = services.method
        self.id: str = services.id
        self.cfg: TopologyConfig = services.cfg
        self.members = set(services.cfg.node_ids)
