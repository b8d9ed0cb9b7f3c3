"""One node under ``privacy.dp`` without a swarm: the node loaded from the synthetic
topology, its services over a transport that is never connected, and a round record. Shared
by the tests of both DP levels (test_privacy_node.py, test_update_privacy_node.py)."""

from __future__ import annotations

from p2pfl.check.load import load_topology
from p2pfl.config.schema import TopologyConfig
from p2pfl.node.daemon import Node, NodeOptions
from p2pfl.services.bundle import NodeServices
from p2pfl.services.exchange import PACK_POOL
from p2pfl.services.ledger import RoundMeter
from p2pfl.wire.transport import Transport


def synthetic_cfg(*overrides: str) -> TopologyConfig:
    """topologies/synthetic.yaml for 3 rounds, with ``overrides``."""
    return load_topology("topologies/synthetic.yaml", ["rounds=3", *overrides])


def loaded_node(cfg: TopologyConfig, out=None, node_id: str = "a") -> Node:
    """Node ``node_id`` of ``cfg`` with its method, data and privacy loaded, not started."""
    node = Node(cfg, node_id, NodeOptions(out_dir=out))
    node._load()
    return node


def node_services(node: Node) -> NodeServices:
    """``node``'s services, with its privacy and its kept optimizer, over an unconnected
    transport."""
    assert node.method is not None and node.data is not None
    return NodeServices(
        cfg=node.cfg,
        node_id=node.id,
        neighbours=node.neighbours,
        method=node.method,
        data=node.data,
        transport=Transport(
            "s", node.id, "127.0.0.1", 1, compress=node.cfg.transfer.compress, pack_pool=PACK_POOL
        ),
        rng=node.rng,
        device=node.device,
        out_dir=node.out_dir,
        privacy=node.privacy,
        optimizer=node.optimizer,
    )


def round_record(svc: NodeServices, round_no: int, trained) -> dict:
    """The record of round ``round_no`` after ``trained``, with fixed evaluation values."""
    return svc.ledger.round_record(
        round_no,
        meter=RoundMeter(svc.exchange.transport),
        evaluated=(0.5, 1.0),
        lr=0.05,
        trained=trained,
        comm_s=0.0,
        peers=[],
    )
