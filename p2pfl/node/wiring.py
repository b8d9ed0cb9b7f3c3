"""A node's wiring: everything between its daemon and the network, built from the topology
and this device's options.

- :func:`load_security`: message signing and the TLS context (``security``; the device's
  certificate directory), checked before anything loads;
- :func:`direct_lane`: the direct TCP lane the node serves and pulls weights on
  (``transfer.direct``; docs/wire.md, "Direct lane");
- :func:`emulated_links`: the emulated links into the node (``network:``) and, under
  ``network.kernel``, its uplink shaped by the kernel;
- :func:`build_transport`: the transport over all of them (not connected yet);
- :func:`announce`: the node announced by mDNS while it runs, when its broker is on the LAN.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from p2pfl import PROTOCOL_VERSION
from p2pfl.config.emulation import access_links
from p2pfl.config.schema import BrokerAddress, TopologyConfig
from p2pfl.errors import ConfigError
from p2pfl.learning.layout import compact_layout
from p2pfl.services.exchange import PACK_POOL
from p2pfl.wire import direct
from p2pfl.wire.direct import local_address
from p2pfl.wire.emulation import LinkEmulator
from p2pfl.wire.shaping import shape_uplink
from p2pfl.wire.transport import Transport

log = logging.getLogger(__name__)


def load_security(
    cfg: TopologyConfig, node_id: str, certs: str | None, source: str
) -> tuple[Any, Any]:
    """(message security, TLS context) from ``security`` and this device's certificate
    directory ``certs`` (None, None when the swarm uses neither); a :class:`ConfigError` on
    ``security.certs`` when it needs one and has none. Loading keys checks the
    certificates."""
    sec = cfg.security
    if not sec.enabled:
        return None, None
    if not certs:
        raise ConfigError(
            source,
            [
                (
                    "security.certs",
                    "security.tls/sign need the swarm's certificate directory "
                    "(security.certs, certs: in the node config, or --certs)",
                )
            ],
        )
    from p2pfl.security.signing import MessageSecurity, tls_context

    signing = (
        MessageSecurity.from_certs(certs, node_id, cfg.node_ids, sec.max_age_s)
        if sec.sign
        else None
    )
    return signing, (tls_context(certs, node_id) if sec.tls else None)


def direct_lane(
    cfg: TopologyConfig, node_id: str, broker: BrokerAddress, certs: str | None
) -> direct.DirectLane | None:
    """The direct lane this node serves and uses (docs/wire.md, "Direct lane"), or None
    with ``transfer.direct: false``. Under TLS it needs a node certificate that may act as
    a server; one issued before the direct lane existed is logged and the node serves and
    pulls over MQTT only."""
    transfer = cfg.transfer
    if not transfer.direct:
        return None
    host = transfer.direct_host or local_address(broker.host, broker.port)
    server_tls = client_tls = None
    if cfg.security.tls:
        from p2pfl.security.certs import CertError
        from p2pfl.security.signing import direct_tls_contexts

        try:
            server_tls, client_tls = direct_tls_contexts(certs, node_id)
        except CertError as exc:
            log.warning("%s: no direct lane: %s", node_id, exc)
            return None
    return direct.DirectLane(
        bind=host,
        advertise=host,
        port=transfer.direct_port,
        server_tls=server_tls,
        client_tls=client_tls,
    )


def emulated_links(cfg: TopologyConfig, node_id: str, broker: BrokerAddress) -> LinkEmulator | None:
    """The emulated links into this node (``network:``; docs/wire.md, "Emulated links"),
    or None. Under ``network.kernel`` this node first shapes its uplink in the kernel;
    where it cannot, it says so, and its uplink's bandwidth is not emulated."""
    net = cfg.network
    own = access_links(net, cfg.seed, cfg.node_hosts).get(node_id) if net.active else None
    if net.kernel and own is not None and own.bandwidth_mbps is not None:
        why = shape_uplink(broker.host, own)
        if why is None:
            log.info("%s: uplink shaped to %g Mbit/s by the kernel", node_id, own.bandwidth_mbps)
        else:
            log.warning("%s: network.kernel: uplink not shaped (%s)", node_id, why)
    links = LinkEmulator.from_topology(cfg, node_id)
    if links is not None:
        log.info("%s: emulating the links from %d peers", node_id, len(links.links))
    return links


def build_transport(
    cfg: TopologyConfig,
    node_id: str,
    broker: BrokerAddress,
    *,
    layout: dict[str, Any] | None,
    security: tuple[Any, Any],
    certs: str | None,
    listen_to: list[str] | None,
) -> Transport:
    """Node ``node_id``'s transport (not connected yet): its presence (swarm, method,
    protocol version, model ``layout``), the size limits and timeouts of the topology,
    ``security`` (:func:`load_security`), its direct lane and emulated links, hearing the
    messages of ``listen_to`` only (None: of every node)."""
    signing, tls = security
    return Transport(
        cfg.name,
        node_id,
        broker.host,
        broker.port,
        presence={  # the node and swarm are the envelope's (`from`, `swarm`)
            "protocol": PROTOCOL_VERSION,
            # the tensor list on request (docs/wire.md, "Model layout")
            "layout": None if layout is None else compact_layout(layout),
        },
        presence_v3={"layout": layout},
        max_message_bytes=int(cfg.max_message_mb * 2**20),
        max_transfer_bytes=int(cfg.max_transfer_mb * 2**20),
        broker_timeout=cfg.timing.broker_timeout_s,
        # a broker slow to start is retried for as long as the node waits for its peers
        startup_timeout=cfg.timing.startup_timeout_s,
        # a publish waits for a lost connection within the bound of an outage (30 s at most)
        connect_timeout=min(30.0, cfg.timing.broker_timeout_s),
        security=signing,
        tls_context=tls,
        direct_lane=direct_lane(cfg, node_id, broker, certs),
        listen_to=listen_to,
        links=emulated_links(cfg, node_id, broker),
        compress=cfg.transfer.compress,
        pack_pool=PACK_POOL,
    )


async def announce(
    stack: contextlib.AsyncExitStack,
    cfg: TopologyConfig,
    node_id: str,
    broker: BrokerAddress,
    transport: Transport | None,
) -> None:
    """Announce this node by mDNS (``p2pfl discover``) for as long as ``stack`` is open,
    when it talks to a broker on the LAN, with its direct lane's port; nodes of a local
    swarm (loopback broker) do not. Discovery is a convenience: a failure is logged."""
    from p2pfl.wire.discovery import Announcer

    address = local_address(broker.host, broker.port)
    if address.startswith("127."):
        return
    served = transport.direct_address if transport is not None else None
    port = direct.parse_address(served)[1] if served else 0
    try:
        await stack.enter_async_context(
            Announcer.node(node_id, cfg.name, cfg.algorithm.name, address, port)
        )
    except (OSError, ValueError) as exc:
        log.warning("%s: not announced by mDNS: %s", node_id, exc)
