"""The dashboard's MQTT observer: a client of the swarm's broker that only listens.

It subscribes (QoS 0) to ``presence/+`` (retained: the broker hands over every node's latest
presence at once) and ``status/+`` (docs/wire.md, "Status telemetry") of one swarm and feeds
each message to a :class:`~p2pfl.dashboard.live.LiveState`, which checks it. It publishes
nothing, has no Last Will and takes no part in the protocol: nodes never see it. It keeps
reconnecting (backing off up to :data:`MAX_BACKOFF_S`) until cancelled, so a broker that is
not up yet, restarts or is gone (a finished run) only changes
:attr:`LiveState.connected` and :attr:`LiveState.note`.

A TLS swarm's broker takes it with the swarm's observer identity (``observer.crt`` and
``observer.key`` of a ``p2pfl certs`` directory: :func:`observer_tls_context`), which the
ACL lets read presence and status telemetry and publish nothing (docs/wire.md, "Security").
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import uuid
from pathlib import Path

import aiomqtt

from p2pfl.dashboard.live import LiveState
from p2pfl.security.certs import (
    OBSERVER_CN,
    CertError,
    SwarmCerts,
    check_not_revoked,
    common_name,
    load_certificate,
)

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 5.0
MAX_QUEUED = 10_000  # incoming messages buffered at most; a flood beyond is dropped by aiomqtt


def observer_tls_context(root: str | Path) -> ssl.SSLContext:
    """A TLS client context for the dashboard's observer: trusts only the swarm CA of the
    ``p2pfl certs`` directory ``root`` (hostname checked against the broker certificate's
    names) and presents its observer identity. Raises :class:`CertError` naming a missing
    or unusable file (a directory made before observers existed gets one when ``p2pfl
    certs`` runs on it again), or an observer identity the directory's CRL revokes."""
    paths = SwarmCerts(Path(root))
    paths.require(paths.ca_cert, paths.observer_cert, paths.observer_key)
    cn = common_name(load_certificate(paths.observer_cert))
    if cn != OBSERVER_CN:
        raise CertError(f"{paths.observer_cert}: certificate is for {cn!r}, not {OBSERVER_CN!r}")
    check_not_revoked(paths, OBSERVER_CN)
    try:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(paths.ca_cert))
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(str(paths.observer_cert), str(paths.observer_key))
    except ssl.SSLError as exc:
        raise CertError(f"{paths.observer_cert}: cannot be used for TLS: {exc}") from None
    return ctx


async def observe(
    live: LiveState,
    host: str,
    port: int,
    *,
    tls_context: ssl.SSLContext | None = None,
    connect_timeout: float = 5.0,
) -> None:
    """Feed ``live`` from the broker at ``host:port`` until cancelled."""
    backoff = 0.25
    while True:
        try:
            async with aiomqtt.Client(
                host,
                port,
                identifier=f"p2pfl-dashboard-{uuid.uuid4().hex[:8]}",
                keepalive=15,
                timeout=connect_timeout,
                max_queued_incoming_messages=MAX_QUEUED,
                tls_context=tls_context,
            ) as client:
                for topic in live.topics():
                    await client.subscribe(topic, qos=0)
                over = " over TLS (observer identity)" if tls_context is not None else ""
                live.connected, live.note = True, f"observing {host}:{port}{over}"
                backoff = 0.25
                async for message in client.messages:
                    live.handle(str(message.topic), message.payload)
        except aiomqtt.MqttError as exc:
            live.connected = False
            live.note = f"broker {host}:{port} unreachable ({exc}); showing the records"
            log.debug("dashboard observer: %s", exc)
        except (OSError, ssl.SSLError) as exc:  # a refused or reset socket, a TLS failure
            live.connected = False
            live.note = f"broker {host}:{port} unreachable ({exc}); showing the records"
        await asyncio.sleep(backoff)
        backoff = min(backoff * 2, MAX_BACKOFF_S)
