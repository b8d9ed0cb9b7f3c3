"""A site daemon's link to its federation's broker: one MQTT connection, subscribed to the
federation's site messages, kept up with a back-off; this site's messages published signed
and retained (docs/design.md, "The site daemon").

:meth:`BrokerLink.run` connects and hands every message to ``on_message`` until cancelled;
:meth:`BrokerLink.publish` waits for the connection and retries until the broker takes
the message. A site's own message is applied as it comes back from the broker, as every
other site's is.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

import aiomqtt

from p2pfl.sites.consent import messages as M

log = logging.getLogger("p2pfl.sites.daemon")


class BrokerLink:
    """Site ``site`` of ``swarm`` on ``broker`` (host:port), TLS with ``certs`` when given,
    its messages signed by ``identity`` (None: unsigned)."""

    def __init__(
        self,
        swarm: str,
        site: str,
        broker: str,
        certs: str | None,
        identity: M.SiteIdentity | None,
    ):
        self.swarm = swarm
        self.site = site
        self.broker = broker
        self.certs = certs
        self.identity = identity
        self.connected = asyncio.Event()
        self.retained_at = time.monotonic()
        """When the last message the broker sent as retained came (monotonic), or the link
        last subscribed: what the broker held for this subscription came before a message
        heard live after that."""
        self.retained = False
        """Whether the message being handed to ``on_message`` now came as retained (held by
        the broker for this subscription), not published live."""
        self._client: aiomqtt.Client | None = None

    async def run(self, on_message: Callable[[str, bytes], None]) -> None:
        """Stay connected (a back-off from 0.5 s to 5 s between tries) and hand each message
        (topic, payload) to ``on_message``, until cancelled."""
        host, _, port = self.broker.rpartition(":")
        tls = None
        if self.certs is not None:
            from p2pfl.security.signing import tls_context

            tls = tls_context(self.certs, self.site)
        backoff = 0.5
        while True:
            try:
                async with aiomqtt.Client(
                    host,
                    int(port),
                    identifier=f"p2pfl-site-{self.swarm}-{self.site}-{uuid.uuid4().hex[:6]}",
                    keepalive=30,
                    tls_context=tls,
                    max_queued_outgoing_messages=1000,
                ) as client:
                    self.retained_at = time.monotonic()
                    await client.subscribe(M.subscription(self.swarm), qos=1)
                    self._client = client
                    self.connected.set()
                    backoff = 0.5
                    async for message in client.messages:
                        self.retained = bool(message.retain)
                        if self.retained:  # sent for the subscription, not published now
                            self.retained_at = time.monotonic()
                        payload = message.payload
                        if not isinstance(payload, (bytes, bytearray)):
                            payload = b"" if payload is None else str(payload).encode()
                        on_message(str(message.topic), bytes(payload))
            except aiomqtt.MqttError as exc:
                if self.connected.is_set():
                    log.warning(
                        "%s: broker %s lost (%s); reconnecting", self.site, self.broker, exc
                    )
                else:
                    log.debug("%s: broker %s: %s", self.site, self.broker, exc)
            self._client = None
            self.connected.clear()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)

    async def publish(self, kind: str, run: str, body: dict[str, Any]) -> None:
        """Publish this site's signed, retained ``kind`` message on ``run``; retried until
        the broker takes it."""
        topic, payload = M.encode(self.swarm, kind, run, self.site, body, self.identity)
        while True:
            await self.connected.wait()
            client = self._client
            if client is None:
                await asyncio.sleep(0.1)
                continue
            try:
                await client.publish(topic, payload, qos=1, retain=True)
            except aiomqtt.MqttError as exc:
                log.warning("%s: %s of run %s not published yet: %s", self.site, kind, run, exc)
                await asyncio.sleep(0.5)
                continue
            break
