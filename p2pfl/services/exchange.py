"""The exchange port: the only road from round code to the transport.

- **prepare** a state for serving, on a shared pack pool (so packing never queues behind
  co-hosted nodes' training), in the wire form of ``transfer.compress``;
- **serve** a pull (:meth:`Exchange.send_state`, a top-k stream's answer
  :meth:`Exchange.serve_stream`) or refuse one (:meth:`Exchange.refuse_pull`);
- **pull** one state or several at once, decoded when compressed and, for
  :meth:`Exchange.pull_many`, admitted (:mod:`p2pfl.services.robust`) before any method sees
  it;
- **gossip** and **send** small messages; whose presence the node hears; what the node
  knows of its peers' reachability (a probe of a direct lane, the broker's bridges).

An attack experiment (the topology's ``attacks:``) wraps what the node serves and claims
here, never in a method's code.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from p2pfl.attacks import Adversary
from p2pfl.background import TaskSet, cancel_and_wait
from p2pfl.config.schema import TopologyConfig
from p2pfl.learning.state import State
from p2pfl.services.ledger import Ledger
from p2pfl.services.robust import Robustness
from p2pfl.wire.codec import state_nbytes
from p2pfl.wire.compress import CompressError, parse_base
from p2pfl.wire.envelope import Envelope
from p2pfl.wire.errors import TransportError
from p2pfl.wire.streams import ServedStreams
from p2pfl.wire.transfers import PreparedState
from p2pfl.wire.transport import Transport
from p2pfl.wire.versions import speaks_4

log = logging.getLogger(__name__)

# packing a state for peers must not queue behind co-hosted nodes' training jobs
PACK_POOL = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="p2pfl-pack")
PULL_SLACK = 4  # a pulled state may be this many times the size of this node's model


class Exchange:
    """Node ``node_id``'s messages and transfers over ``transport``. ``model_bytes``: the
    size of its model's state, which bounds what one pull may bring (:attr:`pull_limit`)."""

    def __init__(
        self,
        *,
        cfg: TopologyConfig,
        node_id: str,
        transport: Transport,
        robust: Robustness,
        ledger: Ledger,
        model_bytes: int,
        adversary: Adversary | None = None,
    ):
        self.cfg = cfg
        self.id = node_id
        self._transport = transport
        self._robust = robust
        self._ledger = ledger
        self._adversary = adversary
        # what a peer may send for one pull: a part of a model like ours (plus masks or
        # heads), never the wire's whole transfer cap; untrusted metadata cannot claim more
        self.pull_limit = PULL_SLACK * model_bytes + (1 << 20)
        self._background = TaskSet()  # best-effort publishes in flight; failures ignored
        # ``transfer.compress: topk(rho)``: the streams this node serves (the transport's,
        # built with it; it keeps those it pulls too); None otherwise
        self.streams: ServedStreams | None = transport.served

    @property
    def transport(self) -> Transport:
        """The transport under this port, for the node's wiring and tests; round code uses
        the port's methods (tests/test_architecture.py checks that it never names this)."""
        return self._transport

    # ------------------------------------------------------------------ serving
    async def prepare(
        self, state: State, round_no: int | None = None, what: str = "model"
    ) -> PreparedState:
        """``state`` serialized and hashed for serving, on the shared pack pool. ``what``
        (``model``: a snapshot or an upload; ``result``: an aggregate) and ``round_no`` tell
        an attack experiment what it may corrupt."""
        if self._adversary is not None and round_no is not None:
            state = self._adversary.outgoing(state, round_no, what)
        loop = asyncio.get_running_loop()
        digest = self._transport.digest_name  # BLAKE3 when signing, else XXH3 (wire.digest)
        # the transport's wire form (``transfer.compress``) is what is digested and sent;
        # under top-k, a state outside its stream (serve_stream) travels as it is
        return await loop.run_in_executor(PACK_POOL, self._transport.prepare, state, digest)

    async def serve_stream(
        self,
        env: Envelope,
        stream: Any,
        tag: Any,
        state: State,
        round_no: int | None = None,
        what: str = "model",
    ) -> None:
        """Answer the pull ``env`` (``transfer.compress: topk``) with ``state``, publish
        ``tag`` of this node's top-k ``stream`` (:class:`~p2pfl.wire.streams.ServedStreams`):
        a delta from the base the request names when the stream can answer it, else the
        stream's estimate dense; uncompressed when ``tag`` is older than the stream's latest
        publish and no longer kept. A request whose ``base`` is malformed is dropped
        (``malformed``) and refused. ``round_no`` and ``what``: as for :meth:`prepare` (an
        attack's corruption, applied once, when ``tag`` is published)."""
        assert self.streams is not None
        body = env.body if isinstance(env.body, dict) else {}
        try:
            base = parse_base(body.get("base"))
        except CompressError as exc:
            self._ledger.drop("malformed", f"pull from {env.sender}: {exc}")
            await self._transport.send(
                env.sender,
                "pull_error",
                env.round,
                {"xfer": env.id, "reason": f"malformed base: {exc}"[:300]},
                attempt=env.attempt,
            )
            return

        def published() -> State:
            if self._adversary is None or round_no is None:
                return state
            return self._adversary.outgoing(state, round_no, what)

        prepared = await self.streams.prepared(stream, tag, published, base)
        if prepared is None:  # an old state outside the stream: as it is
            prepared = await self.prepare(state, round_no, what)
        await self.send_state(env, prepared)

    async def send_state(self, env: Envelope, prepared: PreparedState) -> None:
        """Answer the pull ``env`` with ``prepared`` (after an attack's delay, if any)."""
        if self._adversary is not None:
            delay = self._adversary.serve_delay(env.round)
            if delay > 0:
                await asyncio.sleep(delay)
        await self._transport.send_state(env.sender, env.id, env.round, prepared)

    async def refuse_pull(self, env: Envelope, reason: str) -> None:
        """Answer the pull ``env`` with ``pull_error`` and count it (``refused_pull``)."""
        self._ledger.count("refused_pull")
        await self._transport.send(
            env.sender,
            "pull_error",
            env.round,
            {"xfer": env.id, "reason": reason},
            attempt=env.attempt,
        )

    def claimed_samples(self, n: int, round_no: int) -> int:
        """The sample count this node tells peers (its own, unless an attack inflates it)."""
        return n if self._adversary is None else self._adversary.claimed_samples(n, round_no)

    def told(self, message: dict[str, Any], round_no: int) -> dict[str, Any]:
        """A gossip ``message`` as this node tells it: its claimed sample count ``n``
        inflated by an attack experiment, else ``message`` itself."""
        if self._adversary is None or "n" not in message:
            return message
        return {**message, "n": self.claimed_samples(message["n"], round_no)}

    @staticmethod
    def size_of(state: State) -> int:
        """Bytes of tensor data in ``state``, as the wire counts a transfer's."""
        return state_nbytes(state)

    # ------------------------------------------------------------------ pulling
    async def pull(
        self,
        peer: str,
        round_no: int,
        part: str,
        timeout: float,
        *,
        attempt: int = 0,
        decode: bool = True,
    ) -> State:
        """``part`` of ``peer``'s round-``round_no`` state (of that ``attempt``), at most
        :attr:`pull_limit` bytes, decoded when it travelled compressed (:meth:`decoded`;
        ``decode=False``: as it came). Raises :class:`TransportError` as the transport's
        pull does, and when it does not decode."""
        state = await self._transport.pull(
            peer, round_no, part, timeout, attempt=attempt, max_bytes=self.pull_limit
        )
        return await self.decoded(peer, state) if decode else state

    async def pull_many(
        self,
        parts: dict[str, str],
        round_no: int,
        timeout: float,
        *,
        attempt: int = 0,
        reference: Callable[[str], State] | None = None,
        rounds: dict[str, int] | None = None,
        abandon: Callable[[str], Awaitable[str]] | None = None,
    ) -> tuple[dict[str, State], dict[str, str]]:
        """Pull ``parts[peer]`` of round ``round_no`` (of ``rounds[peer]`` when given: an
        asynchronous node asks each peer for the round it last gossiped) from every peer
        at once; returns the states that arrived and were admitted and, for the pulls that
        failed, why. With ``reference(part)`` (the node's own matching state), every state
        must pass admission (:meth:`~p2pfl.services.robust.Robustness.admit`) before any
        method sees it; one that fails is left out and named in the round's ``rejected``.
        A compressed state is decoded first (:meth:`decoded`); one that does not decode
        fails its pull. Each pull that arrives is told to observers
        (:meth:`~p2pfl.services.ledger.Ledger.publish_status`). With ``abandon(peer)``, a
        wait that ends (with why) once the pull from ``peer`` is no longer worth waiting
        for, a pull still running then fails at once with that reason
        (:func:`unless_abandoned`)."""

        async def one(peer: str) -> State:
            asked = round_no if rounds is None else rounds.get(peer, round_no)
            pull = self.pull(peer, asked, parts[peer], timeout, attempt=attempt)
            stop = None if abandon is None else abandon(peer)
            state = await unless_abandoned(peer, pull, stop)
            self._ledger.publish_status(round_no, pull=(peer, parts[peer], state_nbytes(state)))
            return state

        peers = sorted(parts)
        results = await asyncio.gather(*(one(p) for p in peers), return_exceptions=True)
        pulled: dict[str, State] = {}
        failed: dict[str, str] = {}
        for peer, res in zip(peers, results, strict=True):
            if isinstance(res, BaseException):
                failed[peer] = str(res)
                log.warning("%s: round %d: %s", self.id, round_no, res)
                continue
            why = None if reference is None else self._robust.admit(res, reference(parts[peer]))
            if why is not None:
                self._robust.reject(peer, why, round_no)
            else:
                pulled[peer] = res
        if self._adversary is not None:
            self._adversary.remember(round_no, pulled)
        return pulled, failed

    async def decoded(self, peer: str, state: State) -> State:
        """``state`` as pulled from ``peer``, decoded when it travelled compressed (any
        codec, whatever this node's own ``transfer.compress``; docs/wire.md,
        "Compression"), at most :attr:`pull_limit` bytes decoded. One that does not decode
        is counted (``bad_transfer``) and raises :class:`TransportError`, as a corrupt
        transfer does."""
        return await self._transport.decoded(peer, state, max_bytes=self.pull_limit)

    # ------------------------------------------------------------------ messages
    async def gossip(
        self, round_no: int, body: dict[str, Any], *, kind: str = "gossip", attempt: int = 0
    ) -> None:
        """Publish a small per-round message (``gossip``, ``announce``, ``audit``, a secure
        round's keys) on this node's gossip topic. Raises :class:`TransportError`."""
        await self._transport.gossip(round_no, body, kind=kind, attempt=attempt)

    def gossip_again(self, round_no: int, body: dict[str, Any]) -> None:
        """Publish ``body`` again in the background, best effort (a neighbour that came
        online missed it); a failure is ignored."""
        self._background.spawn(self._transport.gossip(round_no, body))

    async def aclose(self) -> None:
        """Stop the best-effort publishes still in flight (the node is leaving)."""
        await self._background.aclose()

    async def send(self, to: str, kind: str, round_no: int, body: Any, *, attempt: int = 0) -> None:
        """Send one small message to ``to``'s inbox. Raises :class:`TransportError`."""
        await self._transport.send(to, kind, round_no, body, attempt=attempt)

    def send_soon(self, to: str, kind: str, body: Any) -> None:
        """Send one small message of no round to ``to``'s inbox in the background, best
        effort; a failure is ignored."""
        self._background.spawn(self._transport.send(to, kind, 0, body))

    def drop(self, reason: str, detail: Any = "") -> None:
        """Count (and log) a peer message dropped as ``reason``."""
        self._transport.drop(reason, detail)

    # ------------------------------------------------------------------ hearing and reach
    async def hear(
        self, peers: Sequence[str] | None, fresh_within: float, members: Sequence[str] = ()
    ) -> None:
        """Hear the presence of ``peers`` from now on (None: of every node) and no other's,
        waiting up to ``fresh_within`` seconds for the newly heard peers' retained presence
        (:meth:`~p2pfl.wire.transport.Transport.hear_presence`)."""
        await self._transport.hear_presence(peers, fresh_within, members=members)

    def hears(self, peer: str) -> bool:
        """Whether this node hears ``peer``'s presence now (its view of it is live)."""
        return self._transport.hears_presence(peer)

    async def probe(self, peer: str, timeout: float) -> bool | None:
        """Whether ``peer``'s direct lane accepts a connection within ``timeout``; None when
        it has none, or this node has none."""
        return await self._transport.probe(peer, timeout)

    def answered_directly(self, peer: str) -> bool:
        """Whether a pull ever reached ``peer`` on the direct lane."""
        return peer in self._transport.direct_answered

    @property
    def speaks_4(self) -> bool:
        """Whether this node may send what protocol 4 added unasked (announcements by
        difference, ``probe_req``): it speaks 4, no peer of protocol 3 is heard
        (:func:`~p2pfl.wire.versions.speaks_4`; docs/wire.md, "Protocol versions")."""
        return speaks_4(self._transport.speaks)

    def runs_4(self, peer: str) -> bool:
        """Whether ``peer`` reads what protocol 4 added: it is not heard running an older
        protocol (a peer whose presence is not heard here is taken to)."""
        runs = self._transport.runs(peer)
        return runs is None or speaks_4(runs)

    @property
    def bridge_down(self) -> bool:
        """Whether a bridge of this node's broker to another site is down now."""
        return self._transport.bridge_down

    async def follow_bridges(self, changed: Callable[[str, bool], None]) -> None:
        """Follow the state of the broker's bridges, calling ``changed(name, up)`` on each
        change. Raises :class:`TransportError` when the broker is away (the next connection
        subscribes)."""
        self._transport.on_bridge = changed
        await self._transport.follow_bridges()

    async def set_status(self, status: str, **info: Any) -> None:
        """Update this node's retained presence (``online``, ``offline``, ``done``)."""
        await self._transport.set_status(status, **info)


async def unless_abandoned(peer: str, pull: Awaitable[State], stop: Awaitable[str] | None) -> State:
    """What ``pull`` (a transfer from ``peer``) gives, unless ``stop`` ends first: the pull
    is then cancelled and :class:`TransportError` raised with the reason ``stop`` gave (a
    pull across a cut link would otherwise wait out its whole timeout: the link drops
    packets silently). Both are cancelled on the way out. Without ``stop``: ``pull``."""
    if stop is None:
        return await pull
    transfer = asyncio.ensure_future(pull)
    watch = asyncio.ensure_future(stop)
    try:
        await asyncio.wait({transfer, watch}, return_when=asyncio.FIRST_COMPLETED)
        if transfer.done():
            return transfer.result()
        raise TransportError(f"pull from {peer} abandoned: {watch.result()}")
    finally:
        for task in (transfer, watch):
            if not task.done():
                await cancel_and_wait(task)
