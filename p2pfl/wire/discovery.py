"""mDNS / DNS-SD discovery of brokers and nodes (python-zeroconf, asyncio API).

Every p2pfl service is announced under one service type, ``_p2pfl._tcp.local.``, with TXT
properties that say what it is:

* a **broker**: ``role=broker``, ``swarm`` (or ``*`` for any swarm), ``proto``; the service's
  address and port are the MQTT broker's;
* a **node**: ``role=node``, ``node``, ``swarm``, ``algorithm``, ``proto``; nodes listen on
  no port of their own, so their service port is 0 unless a transfer lane is advertised.

Lifecycles follow aiomqtt's: :class:`Announcer` and :class:`Browser` are async context
managers (``async with Announcer.broker(...)``: announced inside, withdrawn on exit).
:func:`discover` browses for a while and returns what it saw (``p2pfl discover``).

``$P2PFL_MDNS_INTERFACES`` (comma-separated interface addresses) limits every announcer and
browser to those interfaces (tests use ``127.0.0.1``); by default zeroconf uses them all.
A node configured with ``broker: mdns`` calls :func:`find_broker` before it connects.

Announcements come from anyone on the LAN: every property is length-limited and checked, and
a malformed service is skipped (counted in :attr:`Browser.skipped`), never raised.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from zeroconf import IPVersion, ServiceStateChange, Zeroconf
from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo, AsyncZeroconf

from p2pfl import MIN_PROTOCOL_VERSION, PROTOCOL_VERSION
from p2pfl.wire.direct import local_address  # noqa: F401  (part of this module's API)

log = logging.getLogger(__name__)

SERVICE_TYPE = "_p2pfl._tcp.local."
ANY_SWARM = "*"
MAX_PROPERTY = 64  # bytes per TXT value we accept
_NAME_OK = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-*")

Role = Literal["broker", "node"]


@dataclass(frozen=True)
class Service:
    """One announced p2pfl service, as a browser saw it."""

    role: Role
    name: str  # the DNS-SD instance name
    swarm: str
    host: str  # first IPv4 address
    port: int
    protocol: int
    node: str | None = None
    algorithm: str | None = None

    def serves(self, swarm: str) -> bool:
        """Whether a broker announced for ``swarm`` (or for any swarm)."""
        return self.role == "broker" and self.swarm in (swarm, ANY_SWARM)


def _token(value: Any, what: str) -> str:
    """A short identifier property (swarm, node, algorithm); ``ValueError`` otherwise."""
    if isinstance(value, bytes):
        try:
            value = value.decode("ascii")
        except UnicodeDecodeError:
            raise ValueError(f"{what} is not ASCII") from None
    if not isinstance(value, str) or not 0 < len(value) <= MAX_PROPERTY:
        raise ValueError(f"{what} is missing or longer than {MAX_PROPERTY} bytes")
    if not set(value) <= _NAME_OK:
        raise ValueError(f"{what} {value!r} has characters outside [A-Za-z0-9_.-*]")
    return value


def parse_service(
    name: str, properties: dict[bytes, bytes | None], addresses: list[str], port: int
) -> Service:
    """Validate an untrusted announcement; raises ``ValueError`` naming what is wrong."""
    props = {k: v for k, v in properties.items() if isinstance(k, bytes)}
    role = _token(props.get(b"role"), "role")
    if role not in ("broker", "node"):
        raise ValueError(f"unknown role {role!r}")
    try:
        protocol = int(_token(props.get(b"proto"), "proto"))
    except ValueError as exc:
        raise ValueError(f"bad protocol version: {exc}") from None
    v4 = [a for a in addresses if a.count(".") == 3]
    if not v4:
        raise ValueError("no IPv4 address")
    if not isinstance(port, int) or not 0 <= port <= 65535 or (role == "broker" and port == 0):
        raise ValueError(f"bad port {port!r}")
    swarm = _token(props.get(b"swarm"), "swarm")
    node = algorithm = None
    if role == "node":
        node = _token(props.get(b"node"), "node")
        algorithm = _token(props.get(b"algorithm"), "algorithm")
    return Service(role, name, swarm, v4[0], port, protocol, node, algorithm)  # type: ignore[arg-type]


def protocol_note(service: Service) -> str | None:
    """What to say of an announced node of another protocol than this release's (README.md,
    "Rolling upgrades"), or None (the same protocol, or a broker: MQTT relays any). An older
    node this release speaks is spoken to in its protocol, a newer one speaks this one; a
    node of a protocol this release does not speak has its messages refused."""
    theirs, ours = service.protocol, PROTOCOL_VERSION
    if theirs == ours or service.role != "node":
        return None
    who = f"node {service.node!r}"
    if MIN_PROTOCOL_VERSION <= theirs < ours:
        return (
            f"{who} runs protocol {theirs}, this release {ours}: spoken to in {theirs}; "
            "upgrade it to finish the rolling upgrade"
        )
    if theirs > ours:
        return (
            f"{who} runs protocol {theirs}, this release {ours}: upgrade this device "
            "(a release that runs it speaks at least its previous protocol)"
        )
    return (
        f"{who} runs protocol {theirs}, this release {ours} speaks {MIN_PROTOCOL_VERSION}"
        f"–{ours}: its nodes' messages are refused; upgrade it"
    )


def default_interfaces() -> list[str] | None:
    """``$P2PFL_MDNS_INTERFACES`` (comma-separated interface addresses), else None: all."""
    raw = os.environ.get("P2PFL_MDNS_INTERFACES", "").strip()
    return [x.strip() for x in raw.split(",") if x.strip()] or None


def _zeroconf(interfaces: list[str] | None) -> AsyncZeroconf:
    interfaces = interfaces or default_interfaces()
    if interfaces:
        return AsyncZeroconf(interfaces=interfaces, ip_version=IPVersion.V4Only)
    return AsyncZeroconf(ip_version=IPVersion.V4Only)


class Announcer:
    """Announces one service while inside ``async with``. Build with :meth:`broker` or
    :meth:`node`."""

    def __init__(
        self,
        instance: str,
        properties: dict[str, str],
        address: str,
        port: int,
        interfaces: list[str] | None = None,
    ):
        self.info = AsyncServiceInfo(
            SERVICE_TYPE,
            f"{instance}.{SERVICE_TYPE}",
            addresses=[socket.inet_aton(address)],
            port=port,
            properties=properties,
            server=f"p2pfl-{uuid.uuid4().hex[:12]}.local.",
        )
        self._interfaces = interfaces
        self._zc: AsyncZeroconf | None = None

    @classmethod
    def broker(
        cls, swarm: str, address: str, port: int, interfaces: list[str] | None = None
    ) -> Announcer:
        """A broker at ``address:port`` for ``swarm`` (``*``: any swarm)."""
        _token(swarm, "swarm")
        props = {"role": "broker", "swarm": swarm, "proto": str(PROTOCOL_VERSION)}
        return cls(
            f"p2pfl-broker-{swarm.strip('*') or 'any'}-{uuid.uuid4().hex[:6]}",
            props,
            address,
            port,
            interfaces,
        )

    @classmethod
    def node(
        cls,
        node_id: str,
        swarm: str,
        algorithm: str,
        address: str,
        port: int = 0,
        interfaces: list[str] | None = None,
    ) -> Announcer:
        """Node ``node_id`` of ``swarm`` running ``algorithm``, reachable at ``address``."""
        for value, what in ((node_id, "node"), (swarm, "swarm"), (algorithm, "algorithm")):
            _token(value, what)
        props = {
            "role": "node",
            "node": node_id,
            "swarm": swarm,
            "algorithm": algorithm,
            "proto": str(PROTOCOL_VERSION),
        }
        return cls(f"p2pfl-{swarm}-{node_id}", props, address, port, interfaces)

    async def __aenter__(self) -> Announcer:
        self._zc = _zeroconf(self._interfaces)
        # zeroconf's async_* calls return a task that finishes once the packets are sent
        await (await self._zc.async_register_service(self.info, allow_name_change=True))
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._zc is not None:
            try:
                await (await self._zc.async_unregister_service(self.info))  # goodbye
            finally:
                await self._zc.async_close()
                self._zc = None


@dataclass
class Browser:
    """Keeps :attr:`services` (by instance name) up to date while inside ``async with``;
    ``on_change(service, present)`` is called for every valid arrival and departure."""

    interfaces: list[str] | None = None
    on_change: Any = None
    services: dict[str, Service] = field(default_factory=dict)
    skipped: int = 0
    _zc: AsyncZeroconf | None = None
    _browser: AsyncServiceBrowser | None = None
    _tasks: set[asyncio.Task] = field(default_factory=set)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)
    _told: set[str] = field(default_factory=set)  # services whose protocol was remarked on

    async def __aenter__(self) -> Browser:
        self._zc = _zeroconf(self.interfaces)
        self._browser = AsyncServiceBrowser(
            self._zc.zeroconf, [SERVICE_TYPE], handlers=[self._on_state_change]
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._browser is not None:
            await self._browser.async_cancel()
        if self._zc is not None:
            await self._zc.async_close()
        self._browser = self._zc = None

    def _on_state_change(
        self,
        zeroconf: Zeroconf,
        service_type: str,
        name: str,
        state_change: ServiceStateChange,
    ) -> None:
        if state_change is ServiceStateChange.Removed:
            gone = self.services.pop(name, None)
            if gone is not None:
                self._notify(gone, False)
            return
        task = asyncio.ensure_future(self._resolve(zeroconf, name))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _resolve(self, zeroconf: Zeroconf, name: str) -> None:
        info = AsyncServiceInfo(SERVICE_TYPE, name)
        if not await info.async_request(zeroconf, 3000):
            return
        try:
            service = parse_service(name, dict(info.properties), info.parsed_addresses(), info.port)
        except ValueError as exc:
            self.skipped += 1
            log.warning("discovery: ignored %s: %s", name, exc)
            return
        self.services[name] = service
        note = protocol_note(service)
        if note is not None and name not in self._told:
            self._told.add(name)
            log.warning("discovery: %s", note)
        self._notify(service, True)

    def _notify(self, service: Service, present: bool) -> None:
        self._changed.set()
        if self.on_change is not None:
            self.on_change(service, present)

    async def wait_for_broker(self, swarm: str, timeout: float, probe: bool = True) -> Service:
        """A broker that serves ``swarm``, the most recently announced first; with
        ``probe``, only one that accepts a TCP connection (a broker that died without its
        mDNS goodbye is still announced for a while). ``TimeoutError`` after ``timeout`` s."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        unreachable: set[str] = set()
        while True:
            brokers = [s for s in self.services.values() if s.serves(swarm)][::-1]
            for candidate in brokers:
                if not probe or await _accepts(candidate.host, candidate.port):
                    return candidate
                if candidate.name not in unreachable:
                    unreachable.add(candidate.name)
                    log.warning(
                        "discovery: broker %s:%d announced but not reachable",
                        candidate.host,
                        candidate.port,
                    )
            remaining = deadline - loop.time()
            if remaining <= 0:
                seen = f" ({len(unreachable)} announced but unreachable)" if unreachable else ""
                raise TimeoutError(
                    f"no broker for swarm {swarm!r} found by mDNS in {timeout:g} s{seen}"
                )
            self._changed.clear()
            try:  # a new announcement, or a while before probing the known ones again
                await asyncio.wait_for(
                    self._changed.wait(), min(remaining, 2.0 if brokers else remaining)
                )
            except asyncio.TimeoutError:
                pass


async def _accepts(host: str, port: int, timeout: float = 2.0) -> bool:
    """Whether ``host:port`` accepts a TCP connection (closed straight away)."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except (OSError, asyncio.TimeoutError):
        return False
    writer.close()
    try:
        await writer.wait_closed()
    except OSError:
        pass
    return True


async def discover(seconds: float = 3.0, interfaces: list[str] | None = None) -> list[Service]:
    """Everything announced within ``seconds`` of browsing, brokers first."""
    async with Browser(interfaces=interfaces) as browser:
        await asyncio.sleep(seconds)
        found = list(browser.services.values())
    return sorted(found, key=lambda s: (s.role != "broker", s.swarm, s.node or "", s.name))


async def find_broker(swarm: str, timeout: float, interfaces: list[str] | None = None):
    """The ``host:port`` (a :class:`~p2pfl.config.schema.BrokerAddress`) of a broker announced for
    ``swarm`` or for any swarm; ``TimeoutError`` naming the swarm after ``timeout`` s."""
    from p2pfl.config.schema import BrokerAddress

    async with Browser(interfaces=interfaces) as browser:
        found = await browser.wait_for_broker(swarm, timeout)
    return BrokerAddress(host=found.host, port=found.port)
