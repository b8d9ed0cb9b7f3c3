"""Bridges between site brokers: ``p2pfl broker --bridge HOST:PORT`` (docs/wire.md, "Bridged
brokers and clustered brokers").

Nodes at each site talk to their own broker; one standard Mosquitto bridge per ``--bridge``
joins this broker to another site's. :func:`bridge_config` writes the bridge sections of the
generated Mosquitto config (:func:`p2pfl.launch.broker.mosquitto_config` appends them):

- ``--bridge HOST:PORT``: the swarm's whole topic tree, ``p2pfl/<swarm>/#`` (``p2pfl/#``
  for a broker of any swarm), both ways at QoS 1: presence (retained; a Will fired at one
  site is an ordinary retained publish there, and crosses like any other), gossip and every
  inbox; ``--bridge HOST:PORT=ID,...`` (with the roster from ``--topology``): per node, only
  what a node on the other side sent or is addressed (:func:`bridge_topics`), which also
  keeps a healed partition from bringing back stale presence;
- ``try_private true`` (the remote broker knows it is a bridge: it keeps the retain flag on
  what it forwards, so retained presence is stored at both sites, and never echoes a message
  back), ``bridge_protocol_version mqttv311``;
- ``cleansession true``: nothing is queued for a bridge that is down (round traffic is stale
  by the time it would arrive, and a queue of weight chunks has no useful bound); the state
  that matters, retained presence, is sent again both ways on every (re)connect;
- ``keepalive_interval 15`` (the nodes' keep-alive) and ``restart_timeout 1 10``;
- ``bridge_max_packet_size`` = the broker's ``max_packet_size``: a message the other side
  would refuse is dropped here instead of disconnecting the bridge;
- ``notifications true``: the bridge's state, ``1`` or ``0``, retained on
  ``$SYS/broker/connection/<id>/state`` at both brokers, with a Will that sets ``0`` at the
  remote one when the bridge dies. :func:`watch_bridges` follows it for ``p2pfl broker``.

With certificates (a ``p2pfl certs`` directory) the bridge speaks TLS: it trusts only the
swarm CA, checks the remote broker's host name against ``broker.crt``'s SANs, and presents
``bridge.crt`` (CN :data:`~p2pfl.security.certs.BRIDGE_CN`), which the swarm ACL lets read
and write the swarm's topics (:func:`p2pfl.security.certs.mosquitto_acl`).

Bridges must form a tree (no cycles): Mosquitto stops a message from going back over the
bridge it came in on, not from going round a loop of three brokers.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ipaddress
import logging
import re
import socket
import ssl
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from p2pfl.background import background
from p2pfl.config.schema import ID_PATTERN
from p2pfl.errors import P2PFLError
from p2pfl.security.certs import BRIDGE_CN, SwarmCerts, check_not_revoked

log = logging.getLogger("p2pfl.broker")

FLAG = "--bridge"
KEEPALIVE_S = 15  # as the nodes' (p2pfl/wire/transport.py)
STATE_TOPIC = "$SYS/broker/connection/{}/state"  # Mosquitto's notification topic


def _say(line: str) -> None:
    print(line, flush=True)


class BridgeError(P2PFLError, ValueError):
    """A malformed or impossible ``--bridge``; the message names the flag."""


NODE_ID = re.compile(ID_PATTERN)  # as a topology's node ids


@dataclass(frozen=True)
class BridgeTarget:
    """The broker at another site that a bridge connects to, and the nodes reached through
    it (empty: not said; the bridge then carries the swarm's whole topic tree)."""

    host: str
    port: int
    nodes: tuple[str, ...] = ()

    @classmethod
    def parse(cls, text: str) -> BridgeTarget:
        """``HOST:PORT`` (an IPv6 address in brackets: ``[::1]:1883``), optionally followed
        by ``=ID,ID,...``, the nodes at that site; :class:`BridgeError` naming ``--bridge``
        otherwise."""
        value, eq, ids = text.strip().partition("=")
        host, sep, port = value.rpartition(":")
        bracketed = host.startswith("[") and host.endswith("]")
        if bracketed:
            host = host[1:-1]
        nodes = tuple(i.strip() for i in ids.split(",")) if eq else ()
        bad = (
            not sep
            or not host
            or any(c.isspace() or c in "[]/#+" for c in host)
            or not port.isdigit()
            or not 1 <= int(port) <= 65535
            or (":" in host) != bracketed  # an IPv6 address, and only one, in brackets
        )
        if not bad and bracketed:
            try:
                ipaddress.IPv6Address(host)
            except ValueError:
                bad = True
        if bad:
            raise BridgeError(
                f"{FLAG} {text!r}: expected HOST:PORT of another site's broker, optionally "
                "=ID,ID... (the nodes at that site), e.g. 10.0.1.5:1883 or "
                "[fd00::5]:1883=n0,n1"
            )
        wrong = [i for i in nodes if not NODE_ID.match(i)]
        if wrong or (eq and not nodes):
            raise BridgeError(f"{FLAG} {text!r}: not node ids: {wrong or [ids]}")
        if len(set(nodes)) != len(nodes):
            raise BridgeError(f"{FLAG} {text!r}: a node listed twice")
        return cls(host, int(port), nodes)

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def __str__(self) -> str:
        return self.address


@dataclass(frozen=True)
class Bridges:
    """This broker's bridges: one connection to each of ``targets``, relaying the topics of
    ``swarm`` (None: every swarm). ``roster`` is the swarm's node ids, needed when a target
    names the nodes behind it: that bridge then carries, per node, only what must cross
    (:func:`bridge_topics`)."""

    targets: tuple[BridgeTarget, ...]
    swarm: str | None = None
    roster: tuple[str, ...] = ()

    @classmethod
    def parse(
        cls,
        values: Sequence[str],
        swarm: str | None = None,
        roster: Sequence[str] | None = None,
        topology: str = "--topology",
    ) -> Bridges:
        """From the ``--bridge`` values, checked: no target twice; node lists only with the
        swarm's ``roster`` (read from ``topology``), naming its members, no node behind two
        bridges, and some node on this side of each bridge. :class:`BridgeError` otherwise."""
        targets = tuple(BridgeTarget.parse(v) for v in values)
        seen: set[tuple[str, int]] = set()
        behind: dict[str, BridgeTarget] = {}
        members = tuple(roster or ())
        for t in targets:
            if (t.host, t.port) in seen:
                raise BridgeError(f"{FLAG} {t} given twice")
            seen.add((t.host, t.port))
            if not t.nodes:
                continue
            if not members:
                raise BridgeError(
                    f"{FLAG} {t}={','.join(t.nodes)}: naming the nodes at that site needs "
                    f"the swarm's topology ({topology} FILE)"
                )
            unknown = [n for n in t.nodes if n not in members]
            if unknown:
                raise BridgeError(f"{FLAG} {t}: no node {unknown} in the swarm {swarm!r}")
            for n in t.nodes:
                if n in behind:
                    raise BridgeError(f"{FLAG} {t}: {n} is already behind {behind[n]}")
                behind[n] = t
            if set(t.nodes) == set(members):
                raise BridgeError(f"{FLAG} {t}: every node of the swarm is behind it")
        if any(t.nodes for t in targets) and not swarm:
            raise BridgeError(f"{FLAG}: naming the nodes at a site needs the swarm's name")
        return cls(targets, swarm, members)


def bridges_from_flags(
    values: Sequence[str] | None, swarm: str | None, topology: str | None = None
) -> Bridges | None:
    """``p2pfl broker``'s bridges: the ``--bridge`` values, with the roster and the swarm's
    name from ``--topology`` when given (it must be the ``--swarm`` served, if one is).
    None without ``--bridge``; :class:`BridgeError` (or the topology's
    :class:`~p2pfl.errors.ConfigError`) on bad input."""
    if not values:
        if topology:
            raise BridgeError("--topology is only used with --bridge")
        return None
    roster: tuple[str, ...] = ()
    if topology:
        from p2pfl.check.checked import load_checked  # pydantic and the method registry

        cfg = load_checked(Path(topology), inputs=False).cfg  # a broker's host has no data
        if swarm is not None and swarm != cfg.name:
            raise BridgeError(
                f"--topology {topology} is swarm {cfg.name!r}, but --swarm is {swarm!r}"
            )
        swarm, roster = cfg.name, tuple(cfg.node_ids)
    return Bridges.parse(values, swarm, roster)


def bridge_topics(bridges: Bridges, target: BridgeTarget) -> list[str]:
    """The ``topic`` lines of the bridge to ``target``.

    Without a node list: the swarm's whole tree, ``p2pfl/<swarm>/# both 1`` (``p2pfl/#``
    for any swarm). Simple, but everything published at either site crosses, transfers
    between two nodes of the same site included, and after a partition each broker sends
    the other its copies of the other site's retained presence too, which may be stale
    (docs/wire.md, "Bridged brokers and clustered brokers").

    With the nodes behind the bridge (``R``; this side, ``L``, is the rest of the roster):
    ``presence/<l>``, ``gossip/<l>`` and ``status/<l>`` (telemetry, QoS 0: a dashboard at
    either site sees every node) go out and ``inbox/<l>`` comes in for each ``l`` in ``L``;
    ``presence/<r>``, ``gossip/<r>`` and ``status/<r>`` come in and ``inbox/<r>`` goes out
    for each ``r`` in ``R``. Each broker then only ever sends the presence of the nodes on its own
    side, and a message crosses only when it is addressed to, or published by, a node on
    the other side."""
    if not target.nodes:
        tree = f"p2pfl/{bridges.swarm}/#" if bridges.swarm else "p2pfl/#"
        return [f"topic {tree} both 1"]
    prefix = f"p2pfl/{bridges.swarm}"
    here = [n for n in bridges.roster if n not in target.nodes]
    lines = []
    for n in here:
        lines += [
            f"topic {prefix}/presence/{n} out 1",
            f"topic {prefix}/gossip/{n} out 1",
            f"topic {prefix}/inbox/{n} in 1",
            f"topic {prefix}/status/{n} out 0",
        ]
    for n in target.nodes:
        lines += [
            f"topic {prefix}/presence/{n} in 1",
            f"topic {prefix}/gossip/{n} in 1",
            f"topic {prefix}/inbox/{n} out 1",
            f"topic {prefix}/status/{n} in 0",
        ]
    return lines


def bridge_id(local_host: str, local_port: int, target: BridgeTarget, swarm: str | None) -> str:
    """The bridge's connection name and client id at the remote broker: the same for every
    start of this broker (the remote can tell a restart from a newcomer), and distinct for
    each (machine, listener, target), so two sites bridging into one hub never take over
    each other's connection."""
    where = f"{socket.gethostname()}|{local_host}|{local_port}|{target}|{swarm or '*'}"
    tag = hashlib.sha256(where.encode()).hexdigest()[:12]
    return f"p2pfl-bridge-{(swarm or 'any')[:32]}-{tag}"


def bridge_config(
    bridges: Bridges,
    local_host: str,
    local_port: int,
    max_packet_bytes: int,
    tls_dir: Path | None = None,
) -> list[str]:
    """The config lines of every bridge in ``bridges`` (appended after the broker's general
    options). ``tls_dir`` holds the staged ``ca.crt``, ``bridge.crt`` and ``bridge.key``:
    the bridges then speak TLS. A target that is this broker's own listener is refused."""
    lines: list[str] = []
    for target in bridges.targets:
        if (target.host, target.port) == (local_host, local_port):
            raise BridgeError(f"{FLAG} {target}: that is this broker's own listener")
        name = bridge_id(local_host, local_port, target, bridges.swarm)
        what = f"nodes {', '.join(target.nodes)} there" if target.nodes else "whole tree"
        lines += [
            "",
            f"# bridge to {target} ({what}): the swarm's topics, both ways, QoS 1",
            f"connection {name}",
            f"address {target.host}:{target.port}",  # IPv6 too: no brackets for Mosquitto
            f"remote_clientid {name}",
            *bridge_topics(bridges, target),
            "bridge_protocol_version mqttv311",
            "try_private true",
            "cleansession true",
            "start_type automatic",
            f"keepalive_interval {KEEPALIVE_S}",
            "restart_timeout 1 10",
            "notifications true",
            f"bridge_max_packet_size {max_packet_bytes}",
        ]
        if tls_dir is not None:
            lines += [
                f"bridge_cafile {tls_dir / 'ca.crt'}",
                f"bridge_certfile {tls_dir / 'bridge.crt'}",
                f"bridge_keyfile {tls_dir / 'bridge.key'}",
                "bridge_tls_version tlsv1.2",
            ]
    return lines


def bridge_tls_files(certs: Path) -> dict[str, Path]:
    """The files a TLS bridge needs from a ``p2pfl certs`` directory, by staged name; a
    missing one is a :class:`~p2pfl.security.certs.CertError` naming it (a directory made
    before bridges existed gets ``bridge.crt`` when ``p2pfl certs`` runs on it again), and
    so is a bridge identity the directory's CRL revokes."""
    src = SwarmCerts(Path(certs))
    src.require(src.ca_cert, src.bridge_cert, src.bridge_key)
    check_not_revoked(src, BRIDGE_CN)
    return {"ca.crt": src.ca_cert, "bridge.crt": src.bridge_cert, "bridge.key": src.bridge_key}


# ----------------------------------------------------------------------------- watching


def _watch_tls(certs: Path) -> ssl.SSLContext:
    files = bridge_tls_files(certs)
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(files["ca.crt"]))
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(str(files["bridge.crt"]), str(files["bridge.key"]))
    return ctx


async def _follow(
    host: str,
    port: int,
    names: dict[str, BridgeTarget],
    tls: ssl.SSLContext | None,
    say: Callable[[str], None],
    log_path: Path | None,
    patience_s: float,
) -> None:
    import aiomqtt  # only a bridging broker needs a client

    up: dict[str, bool] = {}
    t0 = time.monotonic()
    hinted = False
    backoff = 0.5
    while True:
        try:
            async with aiomqtt.Client(
                host,
                port,
                identifier=f"p2pfl-bridge-watch-{uuid.uuid4().hex[:8]}",
                tls_context=tls,
                keepalive=30,
            ) as client:
                await client.subscribe(STATE_TOPIC.format("+"), qos=1)
                backoff = 0.5
                while True:
                    try:
                        msg = await asyncio.wait_for(anext(client.messages), 1.0)
                    except asyncio.TimeoutError:
                        msg = None
                    if msg is not None:
                        name = str(msg.topic).split("/")[3]
                        state = bytes(msg.payload) == b"1"
                        if name in names and up.get(name) != state:
                            if state or name in up:  # no "down" before the first "up"
                                say(
                                    f"bridge to {names[name]} "
                                    + ("connected" if state else "down (reconnecting)")
                                )
                            up[name] = state
                    late = [str(t) for n, t in names.items() if n not in up]
                    if late and not hinted and time.monotonic() - t0 > patience_s:
                        hinted = True
                        where = f": see {log_path}" if log_path else ""
                        say(f"bridge to {', '.join(late)} not connected yet{where}")
        except aiomqtt.MqttError as exc:
            log.warning("following the bridges' state: %s; retrying", exc)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 10.0)


@contextlib.asynccontextmanager
async def watch_bridges(
    bridges: Bridges | None,
    host: str,
    port: int,
    certs: Path | None = None,
    say: Callable[[str], None] = _say,
    log_path: Path | None = None,
    patience_s: float = 15.0,
) -> AsyncIterator[None]:
    """While inside, follow the state of this broker's bridges (Mosquitto's notifications,
    read from the broker at ``host:port``; as the bridge identity when ``certs`` is given)
    and ``say`` ``bridge to HOST:PORT connected`` or ``... down (reconnecting)`` on each
    change, and once that a bridge is ``not connected yet`` after ``patience_s``. Does
    nothing without bridges."""
    if bridges is None or not bridges.targets:
        yield
        return
    names = {bridge_id(host, port, t, bridges.swarm): t for t in bridges.targets}
    # a listener on every address is reached on loopback (in every broker certificate)
    reach = "127.0.0.1" if host in ("0.0.0.0", "", "::") else host
    tls = _watch_tls(certs) if certs is not None else None
    async with background(_follow(reach, port, names, tls, say, log_path, patience_s)):
        yield
