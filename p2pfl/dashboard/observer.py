"""The dashboard's MQTT observer: a client of the swarm's broker that only listens.

It subscribes (QoS 0) to ``presence/+`` (retained: the broker hands over every node's latest
presence at once) and ``status/+`` (docs/wire.md, "Status telemetry") of one swarm and feeds
each message to a :class:`~p2pfl.dashboard.live.LiveState`, which checks it. It publishes
nothing, has no Last Will and takes no part in the protocol: nodes never see it. It keeps
reconnecting (backing off up to :data:`MAX_BACKOFF_S`) until cancelled, so a broker that is
not up yet, restarts or is gone (a finished run) only changes
:attr:`LiveState.connected` and :attr:`LiveState.note`.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import uuid

import aiomqtt

from p2pfl.dashboard.live import LiveState

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 5.0
MAX_QUEUED = 10_000  # incoming messages buffered at most; a flood beyond is dropped by aiomqtt


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
                live.connected, live.note = True, f"observing {host}:{port}"
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
