"""The receive pipeline: every message this node receives, on either lane, is checked here
before anything of the node sees it (docs/wire.md, "Receive pipeline").

Both lanes feed one :class:`ReceivePipeline`:

- the MQTT lane (:mod:`p2pfl.wire.mqtt_lane`) hands it each message raw
  (:meth:`ReceivePipeline.mqtt_message`);
- the direct lane (:mod:`p2pfl.wire.direct_lane`) hands it the ``pull`` a client sent
  (:meth:`ReceivePipeline.direct_request`) and the server's answer to a pull of ours
  (:meth:`ReceivePipeline.direct_reply`), once their frames are read.

The steps, in order: size → topic shape (MQTT) → decode → swarm → the lane's sender
checks (topic owner, TLS certificate) → signature and freshness in a signed swarm
(:mod:`p2pfl.security.signing`) → the emulated link from the sender, when the topology
emulates one (:mod:`p2pfl.wire.emulation`) → duplicate ids → dispatch to the node's handlers
(``on_presence``, ``on_gossip``, ``on_inbox``, ``on_request``) or to the transfers being
received (:class:`~p2pfl.wire.transfers.IncomingTransfers`). A message that fails a step
is dropped: counted in :attr:`ReceivePipeline.dropped` under its reason and logged (the
first ten of each reason, then every thousandth); it never raises into the node, and a
handler that raises is counted as ``handler_error``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from p2pfl.security.presence_order import parse_order
from p2pfl.wire.codec import CodecError
from p2pfl.wire.emulation import LinkEmulator
from p2pfl.wire.envelope import GOSSIP_KINDS, INBOX_KINDS, Envelope, VersionError
from p2pfl.wire.errors import TransportError
from p2pfl.wire.mqtt_lane import Topics
from p2pfl.wire.stats import TransportStats
from p2pfl.wire.transfers import IncomingTransfers
from p2pfl.wire.versions import PeerVersions

if TYPE_CHECKING:
    from p2pfl.security.signing import MessageSecurity

# every line the transport writes goes to one logger, whichever of its modules writes it
log = logging.getLogger("p2pfl.wire.transport")

SEEN_IDS = 50_000  # message ids remembered against duplicates


class ReceivePipeline:
    """The checks and the routing of what one node receives. Handlers (set by the node,
    through the transport):

    - ``on_gossip(envelope)`` for gossip, announcements and audits from other nodes,
    - ``on_request(envelope)`` (a coroutine) for ``pull`` requests addressed to this node,
    - ``on_inbox(envelope)`` for other small messages addressed to this node (``report``),
    - ``on_presence(node_id, status_dict)`` when a presence changes.

    :attr:`versions` holds the protocol each peer runs (:mod:`p2pfl.wire.versions`): an
    envelope of a version this node does not speak is dropped as ``protocol_version``.
    :attr:`peers` holds the latest presence of every node heard; :attr:`transfers` the
    pulls being received over MQTT. ``security``: verify signatures and freshness (a
    signed swarm). ``links``: hold back what each peer sends by its emulated path (None:
    dispatch at once)."""

    def __init__(
        self,
        node_id: str,
        topics: Topics,
        max_message_bytes: int,
        stats: TransportStats,
        *,
        security: MessageSecurity | None = None,
        links: LinkEmulator | None = None,
    ):
        self.node_id = node_id
        self.topics = topics
        self.swarm = topics.swarm
        self.max_message_bytes = max_message_bytes
        self.stats = stats
        self.security = security
        self.links = links
        self.dropped: Counter[str] = Counter()
        self.peers: dict[str, dict[str, Any]] = {}  # latest presence of every node seen
        self.on_gossip: Callable[[Envelope], None] | None = None
        self.on_request: Callable[[Envelope], Awaitable[None]] | None = None
        self.on_inbox: Callable[[Envelope], None] | None = None
        self.on_presence: Callable[[str, dict[str, Any]], None] | None = None
        # every presence admitted, a retained one already held included (fresh views)
        self.presence_heard: Callable[[str], None] | None = None
        # the protocol each peer runs and the one this node speaks (p2pfl.wire.versions);
        # ``speak_changed()`` is called when a presence changes the latter
        self.versions = PeerVersions(node_id)
        self.speak_changed: Callable[[], None] | None = None
        self.transfers = IncomingTransfers(
            node_id, max_message_bytes, self.drop, self.spawn, signed=security is not None
        )
        self._seen_ids: OrderedDict[str, None] = OrderedDict()
        self._tasks: set[asyncio.Task] = set()

    # ------------------------------------------------------------------ drops and tasks
    def drop(self, reason: str, detail: Any = "") -> None:
        """Count a dropped message and log it: the first ten of each reason, then every
        thousandth, so a peer that floods a node with garbage cannot flood its log too."""
        self.dropped[reason] += 1
        n = self.dropped[reason]
        if n <= 10 or n % 1000 == 0:
            more = f" [{n} so far]" if n > 10 else ""
            log.warning(
                "%s: dropped message (%s) %s%s", self.node_id, reason, str(detail)[:200], more
            )

    def spawn(self, coro: Awaitable[None]) -> None:
        """Run ``coro`` (a request being served, a transfer being finished) as a task that
        :meth:`cancel_tasks` ends; a failure is logged."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("%s: serving a request failed: %r", self.node_id, task.exception())

    def close(self) -> None:
        """Fail the transfers being received, drop what the emulated links hold, cancel
        the requests being served."""
        self.transfers.close()
        if self.links is not None:
            self.links.close()
        for t in list(self._tasks):
            t.cancel()

    async def crossed(self, peer: str, nbytes: int, now: float | None = None) -> None:
        """Return once ``nbytes`` that ``peer`` sent (and that reached this node at loop
        time ``now``, default now) have crossed its emulated link; at once without one."""
        if self.links is not None:
            await self.links.crossed(peer, nbytes, now)

    # ------------------------------------------------------------------ shared steps
    def _decode(self, payload: bytes, where: str) -> Envelope | None:
        try:
            env = Envelope.unpack(payload, self.max_message_bytes)
        except VersionError as exc:  # a peer not yet upgraded, or this node not yet
            self.drop("protocol_version", f"{where}: {exc}")
            self.versions.refused(exc.sender or where, exc.version)
            return None
        except CodecError as exc:
            self.drop("malformed", f"{where}: {exc}")
            return None
        self.versions.messages[env.v] += 1
        return env

    def _of_this_swarm(self, env: Envelope, where: str) -> bool:
        if env.swarm != self.swarm:
            self.drop("foreign_swarm", f"{where}: swarm {env.swarm!r}")
            return False
        return True

    def _first_time(self, env: Envelope, where: str) -> bool:
        """False (and dropped) for an id seen before; else the id is remembered."""
        if env.id in self._seen_ids:
            self.drop("duplicate", f"{where}: id {env.id}")
            return False
        self._seen_ids[env.id] = None
        while len(self._seen_ids) > SEEN_IDS:
            self._seen_ids.popitem(last=False)
        return True

    def authenticate(self, topic: str, env: Envelope) -> str | None:
        """Signature, then freshness, of a message in a signed swarm (p2pfl.security.signing),
        ``topic`` being where it was addressed. ``None``: accept; ``same``: a presence
        already held; otherwise the drop reason."""
        sec = self.security
        assert sec is not None
        if env.sig is None or env.header is None:
            return "unsigned"
        if env.kind == "presence":
            body = env.body if isinstance(env.body, dict) else {}
            reason = sec.verify_presence(env.sender, topic, env.header, env.sig, body.get("cert"))
            return reason or sec.presence_order(env.sender, body.get("order"), env.id, env.ts)
        reason = sec.verify(env.sender, topic, env.header, env.sig)
        return reason or sec.replay.check(env.id, env.ts)

    # ------------------------------------------------------------------ the MQTT lane
    def mqtt_message(self, topic: str, payload: Any) -> None:
        """Check and route one incoming MQTT message; never raises."""
        try:
            self._mqtt_message(topic, payload)
        except Exception as exc:  # a peer's bytes must never kill the node
            self.drop("handler_error", f"{topic}: {exc!r}")

    def _mqtt_message(self, topic: str, payload: Any) -> None:
        if not isinstance(payload, (bytes, bytearray)):
            self.drop("not_bytes", topic)
            return
        size = len(payload)
        self.stats.bytes_recv += size
        self.stats.messages_recv += 1
        if size > self.max_message_bytes:
            self.drop("oversized", f"{topic}: {size} bytes")
            return
        address = self.topics.parse(topic)
        if address is None:
            self.drop("foreign_topic", topic)
            return
        channel, owner = address
        env = self._decode(payload, topic)
        if env is None or not self._of_this_swarm(env, topic):
            return
        if channel in ("presence", "gossip") and env.sender != owner:
            self.drop("sender_mismatch", f"{topic}: from {env.sender!r}")
            return
        if env.sender == self.node_id and channel != "inbox":
            return  # our own presence or gossip, echoed back by the broker
        if self.security is not None:
            reason = self.authenticate(topic, env)
            if reason == "same":  # a retained presence we already hold, delivered again
                if self.presence_heard is not None:
                    self.presence_heard(owner)
                return
            if reason is not None:
                detail = f"{topic}: {env.kind} claiming to be from {env.sender!r}"
                if reason == "stale":  # or the two clocks disagree: say by how much
                    detail += f", sent {time.time() - env.ts:+.0f} s ago"
                elif reason == "future_session":  # a session its clock cannot have begun
                    order = parse_order(env.body.get("order"))  # parsed: it was judged
                    if order is not None:
                        detail += f", its session starts {order[0] - time.time():+.0f} s ahead"
                self.drop(reason, detail)
                return
        links = self.links
        if links is not None and links.delays(env.sender):
            later = functools.partial(self._route_later, topic, channel, owner, env)
            links.deliver(env.sender, size, later)
            return
        self._route(topic, channel, owner, env)

    def _route_later(self, topic: str, channel: str, owner: str, env: Envelope) -> None:
        """Route a message the emulated link held back; never raises."""
        try:
            self._route(topic, channel, owner, env)
        except Exception as exc:  # a peer's bytes must never kill the node
            self.drop("handler_error", f"{topic}: {exc!r}")

    def _route(self, topic: str, channel: str, owner: str, env: Envelope) -> None:
        """Hand an admitted MQTT message to its handler."""
        if channel == "presence":
            body = env.body
            info = body.get("presence") if isinstance(body, dict) else None
            if (
                env.kind != "presence"
                or not isinstance(info, dict)
                or not isinstance(info.get("status"), str)
            ):
                self.drop("malformed", f"{topic}: bad presence")
                return
            self.peers[owner] = info
            if self.versions.presence(owner, env.v, info) and self.speak_changed is not None:
                self.speak_changed()  # before the handlers, so what they send is read
            if self.presence_heard is not None:
                self.presence_heard(owner)
            if info["status"] == "offline":  # its Last Will: what it was sending never comes
                self.transfers.fail_peer(owner, f"{owner} went offline")
            if self.on_presence is not None:
                self.on_presence(owner, info)
            return
        if not self._first_time(env, topic):
            return
        if channel == "gossip":
            if env.kind not in GOSSIP_KINDS or not isinstance(env.body, dict):
                self.drop("malformed", f"{topic}: bad gossip")
                return
            if self.on_gossip is not None:
                self.on_gossip(env)
            return
        if channel != "inbox" or owner != self.node_id:
            self.drop("foreign_topic", topic)
            return
        if env.kind == "xfer_chunk":
            self.transfers.on_chunk(env)
        elif env.kind == "xfer_meta":
            self.transfers.on_meta(env)
        elif env.kind == "pull_error":
            self.transfers.on_refused(env)
        elif env.kind == "pull":
            if self.on_request is None:
                return
            self.spawn(self.on_request(env))
        elif env.kind in INBOX_KINDS:
            if self.on_inbox is not None:
                self.on_inbox(env)
        else:
            self.drop("unexpected_kind", f"{topic}: {env.kind}")

    # ------------------------------------------------------------------ the direct lane
    async def direct_request(
        self, payload: bytes, nbytes: int, *, tls: bool = False, certificate: str | None = None
    ) -> Envelope | None:
        """A pull a direct client sent (its frame of ``nbytes`` already read and within the
        size limit) passes the checks of a ``pull`` in this node's inbox: shape, swarm,
        kind, signature and freshness, then the sender's emulated link, then duplicates;
        with ``tls``, the client ``certificate``'s CN must be the sender. The envelope, or
        None (and counted) when it does not."""
        env = self._decode(payload, "direct")
        if env is None or not self._of_this_swarm(env, "direct"):
            return None
        if env.kind != "pull" or env.sender == self.node_id:
            self.drop("unexpected_kind", f"direct: {env.kind} from {env.sender!r}")
            return None
        if tls and certificate != env.sender:
            self.drop(
                "sender_mismatch", f"direct: certificate {certificate!r}, pull from {env.sender!r}"
            )
            return None
        if self.security is not None:
            reason = self.authenticate(self.topics.of("inbox", self.node_id), env)
            if reason is not None:
                self.drop(reason, f"direct: pull claiming to be from {env.sender!r}")
                return None
        await self.crossed(env.sender, nbytes)
        if not self._first_time(env, "direct"):
            return None
        return env

    def direct_reply(self, peer: str, payload: bytes) -> Envelope:
        """The answer frame of a direct pull from ``peer``, checked as an inbox message from
        ``peer``; :class:`TransportError` (and counted) when it is not one. The caller
        waits for the emulated link (:meth:`crossed`) once the whole answer is in."""
        env = self._decode(payload, f"direct reply from {peer}")
        if env is None:
            raise TransportError(f"direct pull from {peer}: malformed reply")
        if env.swarm != self.swarm or env.sender != peer:
            self.drop("sender_mismatch", f"direct reply from {peer}: {env.sender!r}")
            raise TransportError(f"direct pull from {peer}: reply from {env.sender!r}")
        if self.security is not None:
            reason = self.authenticate(self.topics.of("inbox", self.node_id), env)
            if reason is not None:
                self.drop(reason, f"direct reply claiming to be from {peer!r}")
                raise TransportError(f"direct pull from {peer}: reply refused ({reason})")
        return env
