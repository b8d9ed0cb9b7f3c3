"""The embedded broker: amqtt (a pure-Python MQTT 3.1.1 broker) with the fixes p2pfl needs.

Run as a child process by :class:`p2pfl.launch.broker.EmbeddedBroker`
(``python -m p2pfl.launch.amqtt_broker --host H --port P --max-packet-mb M``); it prints
``READY <port>`` once it accepts connections and stops cleanly on SIGTERM / SIGINT. A child
keeps the broker's CPU work off the launcher's event loop, and lets the broker-loss drills
kill it like a Mosquitto process.

amqtt 0.12.1 as released breaks four things the daemon relies on (docs/wire.md, "Brokers");
:func:`apply_fixes` patches them, process-wide and idempotently:

1. **Keep-alive is never enforced**: the read timeout's handler is a no-op, so a frozen
   (SIGSTOPped) client is never dropped and its Last Will never fires. Fixed as MQTT
   3.1.2-24 says: a client silent for 1.5 x its keep-alive is disconnected abnormally
   (its Will is published).
2. **Retained messages leak on CONNECT**: a connecting client is sent the retained messages
   of *every* client's filters, and the loop iterates a dict that changes across awaits
   (``dictionary changed size during iteration`` leaves a zombie session). Fixed: only the
   connecting session's own filters.
3. **Client-id takeover leaves the old connection open** (deaf, its Will never fires).
   Fixed as Mosquitto does: the old connection is closed abnormally first.
4. **A failed write fires the Will at once**, even when the client's DISCONNECT is already
   in the receive buffer (spurious ``offline`` after a clean ``done``). Fixed: the reader
   loop decides (it reads the DISCONNECT, or meets EOF itself).

amqtt has no maximum packet size; :func:`apply_fixes` adds one, checked on the fixed header
before the body is read (a larger packet closes the connection, as Mosquitto's
``max_packet_size`` does). No TLS, no ACL: :class:`~p2pfl.launch.broker.EmbeddedBroker`
refuses a TLS swarm before it starts.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import signal
from typing import Any

log = logging.getLogger("p2pfl.broker.amqtt")

KEEPALIVE_GRACE = 1.5  # MQTT 3.1.2-24: drop a client silent for 1.5 x its keep-alive
_applied = False


def apply_fixes(max_packet: int = 0) -> None:
    """Patch amqtt's broker classes (see the module docstring); ``max_packet`` > 0 bounds
    the remaining length of any packet. Idempotent; the first call's ``max_packet`` holds."""
    global _applied
    if _applied:
        return
    _applied = True
    _enforce_keepalive()
    _retained_for_own_filters_only()
    _close_taken_over_connection()
    _let_reader_decide_on_write_error()
    if max_packet > 0:
        _limit_packet_size(max_packet)


def _enforce_keepalive() -> None:
    from amqtt.mqtt.protocol.broker_handler import BrokerProtocolHandler

    original = BrokerProtocolHandler.init_from_connect.__func__

    async def init_from_connect(cls, reader, writer, plugins_manager, loop=None):
        handler, session = await original(cls, reader, writer, plugins_manager, loop)
        if session.keep_alive > 0:  # the reader's timeout: 1.5 x keep-alive
            session.keep_alive = math.ceil(session.keep_alive * KEEPALIVE_GRACE)
        return handler, session

    def handle_read_timeout(self) -> None:
        asyncio.ensure_future(self.handle_connection_closed())  # abnormal: the Will fires

    BrokerProtocolHandler.init_from_connect = classmethod(init_from_connect)
    BrokerProtocolHandler.handle_read_timeout = handle_read_timeout


def _retained_for_own_filters_only() -> None:
    from amqtt.broker import Broker

    original = Broker._publish_retained_messages_for_subscription

    async def publish_retained(self, subscription, session):
        subscribers = list(self._subscriptions.get(subscription[0], []))
        if any(sub.client_id == session.client_id for sub, _ in subscribers):
            await original(self, subscription, session)

    Broker._publish_retained_messages_for_subscription = publish_retained


def _close_taken_over_connection() -> None:
    from amqtt.broker import Broker

    original = Broker._delete_session

    async def delete_session(self, client_id):
        entry = self._sessions.get(client_id)
        if entry and entry[1] is not None and entry[0].transitions.is_connected():
            old_session, old_handler = entry
            await old_handler.handle_connection_closed()  # its Will fires, its socket closes
            for _ in range(400):  # at most 2 s for its message loop to finish
                if not old_session.transitions.is_connected():
                    break
                await asyncio.sleep(0.005)
        await original(self, client_id)

    Broker._delete_session = delete_session


def _let_reader_decide_on_write_error() -> None:
    from amqtt.errors import ProtocolHandlerError
    from amqtt.events import MQTTEvents
    from amqtt.mqtt.protocol.broker_handler import BrokerProtocolHandler

    async def send_packet(self, packet) -> None:
        try:
            if self.writer:
                async with self._write_lock:
                    await packet.to_stream(self.writer)
            if self._keepalive_task:
                self._keepalive_task.cancel()
                if self.keepalive_timeout is not None:
                    self._keepalive_task = self._loop.call_later(
                        self.keepalive_timeout, self.handle_write_timeout
                    )
            await self.plugins_manager.fire_event(
                MQTTEvents.PACKET_SENT, packet=packet, session=self.session
            )
        except (ConnectionResetError, BrokenPipeError):
            if self._reader_task is None or self._reader_task.done():
                await self.handle_connection_closed()
        except asyncio.CancelledError as e:
            raise ProtocolHandlerError("Packet handling was cancelled") from e

    BrokerProtocolHandler._send_packet = send_packet


def _limit_packet_size(max_packet: int) -> None:
    from amqtt.mqtt import packet as mqtt_packet

    original = mqtt_packet.MQTTFixedHeader.from_stream.__func__

    async def from_stream(cls, reader):
        header = await original(cls, reader)
        if header is not None and header.remaining_length > max_packet:
            # any exception in the reader loop ends the connection
            raise ValueError(f"packet of {header.remaining_length} B over the {max_packet} B limit")
        return header

    mqtt_packet.MQTTFixedHeader.from_stream = classmethod(from_stream)


def broker_config(host: str, port: int) -> dict[str, Any]:
    """amqtt's configuration: one plain TCP listener, anonymous clients, and no ``$SYS`` or
    packet-logger plugins (amqtt adds them when ``plugins`` is left out)."""
    return {
        "listeners": {"default": {"type": "tcp", "bind": f"{host}:{port}"}},
        "plugins": {"amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}},
    }


async def serve(host: str, port: int, max_packet: int) -> None:
    """Run the broker until SIGTERM / SIGINT; print ``READY <port>`` once it listens."""
    from amqtt.broker import Broker

    apply_fixes(max_packet)
    broker = Broker(broker_config(host, port))
    await broker.start()
    bound = broker._servers["default"].instance.sockets[0].getsockname()[1]
    print(f"READY {bound}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    # stop listening first: amqtt closes its listeners last, after ending every session, and
    # a client that reconnects meanwhile is accepted by a broker about to exit (it then takes
    # itself for connected while its peers' Wills say they are gone)
    for server in broker._servers.values():
        if server.instance is not None:
            server.instance.close()
    try:
        await asyncio.wait_for(broker.shutdown(), 10)
    except (asyncio.TimeoutError, Exception) as e:  # exiting anyway
        log.warning("amqtt shutdown: %s", e)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m p2pfl.launch.amqtt_broker")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--max-packet-mb", type=float, default=8.0)
    args = ap.parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    logging.getLogger("transitions").setLevel(logging.ERROR)
    logging.getLogger("amqtt").setLevel(logging.ERROR)  # a dropped client is not an error here
    asyncio.run(serve(args.host, args.port, int(args.max_packet_mb * 2**20)))


if __name__ == "__main__":
    main()
