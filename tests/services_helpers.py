"""A node's services without a swarm: a real method on real data, a real transport that is
never connected. For tests of the services' and the round drivers' handlers."""

from __future__ import annotations

import numpy as np
import torch

from p2pfl.algorithms import get_algorithm
from p2pfl.algorithms.build import node_method
from p2pfl.config.schema import TopologyConfig
from p2pfl.learning.data import load_node_data
from p2pfl.services.bundle import NodeServices
from p2pfl.services.exchange import PACK_POOL
from p2pfl.wire.transport import Transport


def offline_services(cfg: TopologyConfig, node_id: str = "a") -> NodeServices:
    """Node ``node_id``'s services under ``cfg`` (its method, its data shard, every other
    node a neighbour), with an unconnected transport."""
    data = load_node_data(cfg.dataset, cfg.node_ids, node_id, cfg.seed)
    rng = np.random.default_rng(0)
    method = node_method(
        get_algorithm(cfg.algorithm.name), cfg, node_id, data, rng, torch.device("cpu")
    )
    return NodeServices(
        cfg=cfg,
        node_id=node_id,
        neighbours=[n for n in cfg.node_ids if n != node_id],
        method=method,
        data=data,
        transport=Transport(
            "s", node_id, "127.0.0.1", 1, compress=cfg.transfer.compress, pack_pool=PACK_POOL
        ),
        rng=rng,
        device=torch.device("cpu"),
    )
