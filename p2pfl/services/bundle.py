"""What a round driver may use of its node: :class:`NodeServices`, a small bundle of
ports (docs/architecture.md, "Node services").

The daemon (:mod:`p2pfl.node.daemon`) owns the lifecycle: it loads the data and the method,
builds the transport and one :class:`NodeServices` over it, then hands the services to the
round driver its method asks for (:mod:`p2pfl.rounds.driver`). A driver decides *what*
happens in a round; the ports do the parts every round has:

- ``peers`` (:mod:`p2pfl.services.peers`): the presence view, waits, the refused-peer gate;
- ``exchange`` (:mod:`p2pfl.services.exchange`): prepare, serve, pull, gossip, send — the
  only road to the transport;
- ``robust`` (:mod:`p2pfl.services.robust`): admit, cap, reject, trust;
- ``ledger`` (:mod:`p2pfl.services.ledger`): the meter, presence and live status, the
  round record and drop counts;
- ``training`` (:mod:`p2pfl.services.training`): local training and evaluation;
- ``device`` (:mod:`p2pfl.services.device`): the torch device, emulated speed and offline
  windows;
- ``privacy`` (:mod:`p2pfl.services.privacy`, :mod:`p2pfl.services.update_privacy`): the
  DP settings and accountant under ``privacy.dp``, else None.

Beside them the node's identity, read-only: ``id``, ``cfg``, ``neighbours``, ``method``,
``data``, ``rng``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from p2pfl.algorithms.base import Method
from p2pfl.attacks import Adversary
from p2pfl.config.schema import TopologyConfig
from p2pfl.learning.data import NodeData
from p2pfl.services.device import EmulatedDevice, NodeDevice
from p2pfl.services.exchange import Exchange
from p2pfl.services.ledger import Ledger
from p2pfl.services.optimizer_state import KeptOptimizer
from p2pfl.services.peers import PeerView
from p2pfl.services.robust import Robustness
from p2pfl.services.training import LocalTraining
from p2pfl.wire.codec import state_nbytes
from p2pfl.wire.transport import Transport

if TYPE_CHECKING:  # Opacus is imported only by a node that trains under privacy.dp
    from p2pfl.services.privacy import NodePrivacy
    from p2pfl.services.update_privacy import NodeUpdatePrivacy


class NodeServices:
    """The node as a driver sees it: its identity and the ports listed in the module
    docstring, all over one ``transport``. ``records`` (kept by the ledger) and
    ``resumed_round`` (the round of the checkpoint the node resumed from) come from the
    daemon."""

    def __init__(
        self,
        *,
        cfg: TopologyConfig,
        node_id: str,
        neighbours: list[str],
        method: Method,
        data: NodeData,
        transport: Transport,
        rng: np.random.Generator,
        device: torch.device,
        out_dir: Path | None = None,
        records: list[dict[str, Any]] | None = None,
        privacy: NodePrivacy | NodeUpdatePrivacy | None = None,
        resumed_round: int = 0,
        optimizer: KeptOptimizer | None = None,
    ):
        self.cfg = cfg
        self.id = node_id
        self.neighbours = neighbours
        self.method = method
        self.data = data
        self.rng = rng
        self.privacy = privacy
        # an experiment's attack on this node (topology ``attacks:``), None when honest:
        # it wraps what the node serves, claims and how it trains, never a method's code
        adversary = Adversary.for_node(cfg, node_id, data.num_classes)
        self.peers = PeerView(node_id, transport.peers, transport.dropped)
        self.robust = Robustness(
            cfg,
            node_id,
            method.ctx.defence,
            len(data.train_y),
            transport.dropped,
            adversary,
            privacy,
        )
        self.ledger = Ledger(
            cfg=cfg,
            node_id=node_id,
            transport=transport,
            robust=self.robust,
            method=method,
            rng=rng,
            out_dir=out_dir,
            records=records,
            privacy=privacy,
            resumed_round=resumed_round,
            optimizer=optimizer,
        )
        self.exchange = Exchange(
            cfg=cfg,
            node_id=node_id,
            transport=transport,
            robust=self.robust,
            ledger=self.ledger,
            model_bytes=state_nbytes(method.model.state_dict()),
            adversary=adversary,
        )
        # the topology's ``devices:`` entry for this node (speed, offline windows)
        emulated = EmulatedDevice.of(cfg, node_id)
        self.device = NodeDevice(node_id, device, emulated, self.exchange.set_status)
        self.training = LocalTraining(
            cfg=cfg,
            node_id=node_id,
            method=method,
            data=data,
            rng=rng,
            device=device,
            privacy=privacy,
            adversary=adversary,
            emulated=emulated,
            optimizer=optimizer,
        )

    async def aclose(self) -> None:
        """Stop what the ports still run in the background (best-effort publishes): the
        node is leaving."""
        await self.exchange.aclose()
        await self.ledger.aclose()
