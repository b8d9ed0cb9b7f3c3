"""What a round driver may use of its node: the public services both drivers share.

The daemon (:mod:`p2pfl.node.daemon`) owns the lifecycle: it loads the data and the method,
connects the transport and builds one :class:`NodeServices`. It then hands the services to
the round driver the method's kind asks for — :mod:`p2pfl.rounds.gossip.decentralized` or
:mod:`p2pfl.rounds.rotation.centralized` — and routes the transport's callbacks to the driver's
:class:`RoundDriver` interface. A driver decides *what* happens in a round; the services do
the parts every round has (docs/architecture.md, "Node services"):

- the **presence view**: who is online, what round a peer reports, whether it is in step
  with a round, whether this node fell behind (docs/wire.md, "Rounds and catch-up");
- **waits**: :meth:`NodeServices.wait_for` a predicate, woken by :meth:`NodeServices.notify`
  whenever a message or a presence change arrives, bounded by a deadline;
- **transfers**: packing a state for peers on a shared thread pool, pulling several parts at
  once, refusing a pull, counting a dropped message;
- **learning**: one round of local training and one evaluation, in worker threads
  (:mod:`p2pfl.services.training`);
- **records**: the byte, time and outage meter of a round, the round's record (the fields
  both drivers share filled in one place, :meth:`NodeServices.round_record`, the method's
  own facts under its ``method`` key) and writing it with the node's checkpoint
  (docs/architecture.md, "Checkpoints and resume");
- **live status**: :meth:`NodeServices.publish_status`, the phase a round is in and each
  pull that arrived, for observers such as the dashboard (docs/wire.md, "Status telemetry").
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np
import torch

from p2pfl.algorithms.base import Method
from p2pfl.attacks import Adversary
from p2pfl.config.schema import TopologyConfig
from p2pfl.learning.admission import admit_state, cap_claims
from p2pfl.learning.data import NodeData
from p2pfl.learning.defence import Defence
from p2pfl.learning.state import State
from p2pfl.metrics import METHOD_KEY, RecordLog, node_log_path
from p2pfl.services.checkpoint import Checkpoint, checkpoint_path, save_checkpoint
from p2pfl.services.device import EmulatedDevice
from p2pfl.services.training import LocalTraining, TrainOutcome
from p2pfl.wire.codec import state_nbytes
from p2pfl.wire.compress import CompressError, decode_state, is_compressed, parse_base, parse_spec
from p2pfl.wire.envelope import Envelope
from p2pfl.wire.status import phase_body, pull_body
from p2pfl.wire.streams import ReceivedStreams, ServedStreams
from p2pfl.wire.transfers import PreparedState
from p2pfl.wire.transport import Transport, TransportError

if TYPE_CHECKING:  # Opacus is imported only by a node that trains under privacy.dp
    from p2pfl.services.privacy import NodePrivacy
    from p2pfl.services.update_privacy import NodeUpdatePrivacy

log = logging.getLogger(__name__)

# packing a state for peers must not queue behind co-hosted nodes' training jobs
PACK_POOL = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="p2pfl-pack")
# a peer this many rounds or more away from a node's round is not in step with it: the node
# does not wait on it, and a node that far behind its neighbours catches up
LAG_ROUNDS = 3
PULL_SLACK = 4  # a pulled state may be this many times the size of this node's model

# a round record (docs/architecture.md, "Round records"): the fields every driver fills
# alike through NodeServices.round_record, a driver's own beside them, and everything the
# method returned under METHOD_KEY (p2pfl.metrics), where no fact of a method can replace
# a driver's field
METER_FIELDS = (
    "round_s",
    "bytes_sent",
    "bytes_recv",
    "direct_bytes_sent",
    "direct_bytes_recv",
    "lanes",
    "broker_offline_s",
)
RECORD_FIELDS = frozenset(
    {
        "round",
        "test_acc",
        "test_loss",
        "train_loss",
        "train_ce",
        "train_s",
        "comm_s",
        *METER_FIELDS,
        "lr",
        "peers",
        "dropout",
        METHOD_KEY,
        "rejected",
        "capped",
        "distrusted",
        "defence_fallbacks",
        "attack",
        "diverged",
        "dropped_total",
        "t",
        # a node under privacy.dp only (docs/algorithms.md, "Differential privacy")
        "epsilon",
        "dp_exhausted",
    }
)


@runtime_checkable
class RoundDriver(Protocol):
    """The interface between the daemon and a round driver: the daemon calls :meth:`run`
    once, after the startup barrier, and routes the transport's callbacks here."""

    async def run(self) -> None:
        """Run every round of the swarm this node takes part in; records go through
        :meth:`NodeServices.finish_round`."""

    def on_gossip(self, env: Envelope) -> None:
        """A message on a peer's gossip topic (gossip, announcements)."""

    def on_inbox(self, env: Envelope) -> None:
        """A small message addressed to this node (e.g. a ``report``)."""

    async def serve_pull(self, env: Envelope) -> None:
        """Answer a peer's ``pull`` request: send the state or refuse."""

    def on_peer_online(self, peer: str) -> None:
        """A neighbour came online (it joined late or reconnected)."""


class RoundMeter:
    """Time and transport bytes since a round started, and the broker outage since
    ``offline_from`` (the previous round's reading: an outage between two rounds, e.g. while
    presence waits for the broker, counts in the next round's record)."""

    def __init__(self, transport: Transport, offline_from: float | None = None):
        self._transport = transport
        self.t0 = time.monotonic()
        self._sent0 = transport.stats.bytes_sent
        self._recv0 = transport.stats.bytes_recv
        self._offline0 = transport.offline_seconds() if offline_from is None else offline_from
        self.offline_read: float | None = None  # the outage total at the last fields()
        self._direct_sent0 = transport.stats.direct_bytes_sent
        self._direct_recv0 = transport.stats.direct_bytes_recv
        self._pulls0 = transport.pulls

    def fields(self) -> dict[str, Any]:
        """``round_s``, ``bytes_sent``, ``bytes_recv`` (both lanes), ``direct_bytes_sent``,
        ``direct_bytes_recv`` (the direct lane's share), ``lanes`` (the lane of each peer's
        pull: ``direct`` or ``mqtt``) and ``broker_offline_s`` (seconds without a broker) of
        the round so far."""
        stats = self._transport.stats
        self.offline_read = self._transport.offline_seconds()
        return {
            "round_s": round(time.monotonic() - self.t0, 4),
            "bytes_sent": stats.bytes_sent - self._sent0,
            "bytes_recv": stats.bytes_recv - self._recv0,
            "direct_bytes_sent": stats.direct_bytes_sent - self._direct_sent0,
            "direct_bytes_recv": stats.direct_bytes_recv - self._direct_recv0,
            "lanes": self._lanes(),
            "broker_offline_s": round(self.offline_read - self._offline0, 3),
        }

    def _lanes(self) -> dict[str, str]:
        """The lane of each pull since the round began (the last one per peer)."""
        t = self._transport
        n = min(t.pulls - self._pulls0, len(t.pull_lanes))
        return dict(list(t.pull_lanes)[len(t.pull_lanes) - n :]) if n > 0 else {}


class NodeServices:
    """The node as a driver sees it: its identity, method, data and transport, and the
    shared services listed in the module docstring."""

    def __init__(
        self,
        *,
        cfg: TopologyConfig,
        node_id: str,
        neighbours: list[str],
        method: Method,
        data: NodeData,
        transport: Transport,
        rng: np.random.Generator,
        device: torch.device,
        out_dir: Path | None = None,
        records: list[dict[str, Any]] | None = None,
        privacy: NodePrivacy | NodeUpdatePrivacy | None = None,
    ):
        self.cfg = cfg
        self.id = node_id
        self.neighbours = neighbours
        self.method = method
        self.data = data
        self.transport = transport
        self.rng = rng
        self.device = device
        self.out_dir = out_dir
        self.records: list[dict[str, Any]] = records if records is not None else []
        # ``privacy.dp``: DP-SGD's settings and accountant (level sample), or those of the
        # releases of outgoing updates (level update); None: plain training
        self.privacy = privacy
        self.record_log = RecordLog(node_log_path(out_dir, node_id)) if out_dir else None
        self.resumed_round = 0  # the round of the checkpoint this node resumed from (0: none)
        # what a peer may send for one pull: a part of a model like ours (plus masks or
        # heads), never the wire's whole transfer cap; untrusted metadata cannot claim more
        self.pull_limit = PULL_SLACK * state_nbytes(method.model.state_dict()) + (1 << 20)
        self._changed = asyncio.Event()
        self._meter: RoundMeter | None = None  # the latest round's
        self._offline_mark = 0.0  # broker outage seconds already in a record
        self._status_tasks: set[asyncio.Task] = set()  # status publishes in flight
        # neighbours refused for good reason (a model layout unlike ours), with the reason:
        # their status reads ``refused``, so no round counts them and no pull is served
        self.refused: dict[str, str] = {}
        # robustness (docs/design.md, "Robust aggregation"): the method's combination rule,
        # this round's refused states and capped claims, and the peers left out of draws
        self.defence: Defence = method.ctx.defence
        self.round_no = 0
        self.rejected: dict[str, str] = {}
        self.capped: dict[str, int] = {}
        # whose states went into the model at its latest merge or apply (the model the next
        # training starts from): named when that training diverges
        self.merged_from: list[str] = []
        self.distrusted: dict[str, int] = {}  # peer -> the first round it is drawn again
        self._strikes: dict[str, int] = {}
        # the topology's ``devices:`` entry for this node (speed, offline windows)
        self.emulated = EmulatedDevice.of(cfg, node_id)
        self.off_network = False  # inside an emulated offline window: no pull is served
        # an experiment's attack on this node (topology ``attacks:``), None when honest:
        # it wraps what the node serves and how it trains, never a method's code
        self.adversary = Adversary.for_node(cfg, node_id, data.num_classes)
        self.training = LocalTraining(
            cfg=cfg,
            node_id=node_id,
            method=method,
            data=data,
            rng=rng,
            device=device,
            privacy=privacy,
            adversary=self.adversary,
            emulated=self.emulated,
            merged_from=lambda: self.merged_from,
        )
        # ``transfer.compress: topk(rho)``: the streams this node serves, and those it pulls
        # (the transport names their bases in its pull requests); None otherwise
        self.streams: ServedStreams | None = None
        spec = parse_spec(cfg.transfer.compress)
        if spec.mode == "topk":
            assert spec.rho is not None
            self.streams = ServedStreams(spec.rho, transport.digest_name, pool=PACK_POOL)
            transport.streams = ReceivedStreams()

    # ------------------------------------------------------------------ presence view
    def status(self, peer: str) -> str:
        """``peer``'s latest presence status (``online``, ``done``, ``offline``, ``unknown``),
        or ``refused`` for a neighbour this node refuses (:attr:`refused`)."""
        if peer in self.refused:
            return "refused"
        return str(self.transport.peers.get(peer, {}).get("status", "unknown"))

    def is_online(self, peer: str) -> bool:
        """Whether ``peer`` is this node or its presence is ``online``."""
        return peer == self.id or self.status(peer) == "online"

    def online(self, peers: list[str]) -> list[str]:
        """The peers of ``peers`` whose presence is ``online`` (order kept)."""
        return [p for p in peers if self.status(p) == "online"]

    def reported_round(self, peer: str) -> int | None:
        """The round ``peer``'s presence reports having finished, None when it reports none
        (presence is untrusted: anything but an int counts as none)."""
        r = self.transport.peers.get(peer, {}).get("round")
        return r if isinstance(r, int) and not isinstance(r, bool) else None

    def joined_round(self, peer: str) -> int:
        """The first round ``peer`` ran since it (re)joined the swarm (1 when it reports
        none): a node that joined late or caught up skipped the rounds before."""
        j = self.transport.peers.get(peer, {}).get("joined")
        return j if isinstance(j, int) and not isinstance(j, bool) and j >= 1 else 1

    def in_step(self, peer: str, round_no: int) -> bool:
        """Whether ``peer`` is online and can take part in round ``round_no`` with this node
        (docs/wire.md, "Rounds and catch-up"): it is in a round less than
        :data:`LAG_ROUNDS` away (behind or ahead) and did not skip ``round_no`` by joining
        after it. A peer that is not in step is not waited on."""
        if not self.is_online(peer):
            return False
        current = (self.reported_round(peer) or 0) + 1
        return abs(current - round_no) < LAG_ROUNDS and self.joined_round(peer) <= round_no

    def swarm_round(self, peers: list[str]) -> int:
        """The latest round an online peer of ``peers`` reports having finished (0: none)."""
        rounds = [self.reported_round(p) for p in self.online(peers)]
        return max((r for r in rounds if r is not None), default=0)

    def behind(self, round_no: int, peers: list[str]) -> int | None:
        """When an online peer of ``peers`` is :data:`LAG_ROUNDS` or more rounds ahead of
        ``round_no``, the latest round such a peer reports finished (the node should catch
        up to the round after it); None when this node is in step."""
        swarm = self.swarm_round(peers)
        return swarm if swarm + 1 >= round_no + LAG_ROUNDS else None

    # ------------------------------------------------------------------ waits
    def notify(self) -> None:
        """Something a waiter may be waiting on changed: re-check every predicate."""
        self._changed.set()

    async def wait_for(self, predicate: Callable[[], bool], deadline: float) -> bool:
        """Wait until ``predicate()`` holds (True) or the monotonic ``deadline`` passes
        (False); the predicate is re-checked after every :meth:`notify`. A cancellation of
        the waiting task always ends the wait (``asyncio.wait``: ``asyncio.wait_for`` before
        Python 3.12 swallows one that lands as a notify wakes it)."""
        while not predicate():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self._changed.clear()
            changed = asyncio.ensure_future(self._changed.wait())
            try:
                await asyncio.wait({changed}, timeout=remaining)
            finally:
                changed.cancel()
        return True

    # ------------------------------------------------------------------ transfers
    async def prepare(
        self, state: State, round_no: int | None = None, what: str = "model"
    ) -> PreparedState:
        """``state`` serialized and hashed for serving, on the shared pack pool (so packing
        never queues behind co-hosted nodes' training). ``what`` (``model``: a snapshot or
        an upload; ``result``: an aggregate) and ``round_no`` tell an attack experiment what
        it may corrupt (:attr:`adversary`)."""
        if self.adversary is not None and round_no is not None:
            state = self.adversary.outgoing(state, round_no, what)
        loop = asyncio.get_running_loop()
        digest = self.transport.digest_name  # BLAKE3 when signing, else XXH3 (wire.digest)
        compress = self.cfg.transfer.compress  # the wire form is what is digested and sent
        if self.streams is not None:  # top-k is served by stream (serve_stream); this is
            compress = "none"  # a state outside its stream, which travels as it is
        return await loop.run_in_executor(
            PACK_POOL, PreparedState.from_state, state, digest, compress
        )

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
            self.drop("malformed", f"pull from {env.sender}: {exc}")
            await self.transport.send(
                env.sender,
                "pull_error",
                env.round,
                {"xfer": env.id, "reason": f"malformed base: {exc}"[:300]},
                attempt=env.attempt,
            )
            return

        def published() -> State:
            if self.adversary is None or round_no is None:
                return state
            return self.adversary.outgoing(state, round_no, what)

        prepared = await self.streams.prepared(stream, tag, published, base)
        if prepared is None:  # an old state outside the stream: as it is
            prepared = await self.prepare(state, round_no, what)
        await self.send_state(env, prepared)

    async def pull_many(
        self,
        parts: dict[str, str],
        round_no: int,
        timeout: float,
        *,
        attempt: int = 0,
        reference: Callable[[str], State] | None = None,
        rounds: dict[str, int] | None = None,
    ) -> tuple[dict[str, State], dict[str, str]]:
        """Pull ``parts[peer]`` of round ``round_no`` (of ``rounds[peer]`` when given: an
        asynchronous node asks each peer for the round it last gossiped) from every peer
        at once; returns the
        states that arrived and were admitted and, for the pulls that failed, why. With
        ``reference(part)`` (the node's own matching state), every state must pass
        admission (:func:`~p2pfl.learning.admission.admit_state`: layout, finite values,
        norm bound) before any method sees it; one that fails is left out and named in the
        round's :attr:`rejected`. A compressed state is decoded first (:meth:`decoded`);
        one that does not decode fails its pull. Each pull that arrives is told to
        observers (:meth:`publish_status`)."""

        async def one(peer: str) -> State:
            asked = round_no if rounds is None else rounds.get(peer, round_no)
            state = await self.transport.pull(
                peer, asked, parts[peer], timeout, attempt=attempt, max_bytes=self.pull_limit
            )
            state = await self.decoded(peer, state)  # before admission
            self.publish_status(round_no, pull=(peer, parts[peer], state_nbytes(state)))
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
            why = None if reference is None else self.admit(res, reference(parts[peer]))
            if why is not None:
                self.reject(peer, why, round_no)
            else:
                pulled[peer] = res
        if self.adversary is not None:
            self.adversary.remember(round_no, pulled)
        return pulled, failed

    async def decoded(self, peer: str, state: State) -> State:
        """``state`` as pulled from ``peer``, decoded when it travelled compressed (any
        codec, whatever this node's own ``transfer.compress``; docs/wire.md,
        "Compression"), at most :attr:`pull_limit` bytes decoded. One that does not decode
        is counted (``bad_transfer``) and raises :class:`TransportError`, as a corrupt
        transfer does."""
        if not is_compressed(state):
            return state
        try:
            return await asyncio.to_thread(decode_state, state, max_bytes=self.pull_limit)
        except CompressError as exc:
            self.drop("bad_transfer", f"state from {peer} rejected: {exc}")
            raise TransportError(f"state from {peer} does not decode: {exc}") from None

    # ------------------------------------------------------------------ robustness
    def admit(self, state: Any, reference: State, *, layout: bool = True) -> str | None:
        """None when a peer's ``state`` may reach the method, else why not (admission:
        :mod:`p2pfl.learning.admission`, bounded by ``defence.max_norm_ratio``)."""
        return admit_state(state, reference, self.cfg.defence.max_norm_ratio, layout=layout)

    def begin_round(self, round_no: int) -> None:
        """Round ``round_no`` starts: no state refused yet, the defence's schedule moves on."""
        self.round_no = round_no
        self.rejected = {}
        self.capped = {}
        self.defence.begin_round(round_no)
        if self.privacy is not None:  # honest peers' models carry this round's DP noise
            self.defence.noise_spread = self.privacy.noise_spread(round_no, self.cfg.training)

    def reject(self, peer: str, reason: str, round_no: int) -> None:
        """Refuse ``peer``'s state of ``round_no``: logged with the peer's id, counted
        (``rejected_state``) and kept for the round's record."""
        if peer in self.rejected:
            return
        self.rejected[peer] = reason
        self.transport.dropped["rejected_state"] += 1
        log.warning("%s: round %d: refused %s's state: %s", self.id, round_no, peer, reason)

    def trusted(self, peer: str, round_no: int) -> bool:
        """Whether ``peer`` may be drawn in ``round_no`` (reputation: a peer whose states
        were refused sits out ``defence.distrust_rounds`` rounds, doubled per refusal)."""
        return self.distrusted.get(peer, 0) <= round_no

    def cap_claims(self, claims: dict[str, int]) -> dict[str, int]:
        """Peers' claimed sample counts, capped (admission, :func:`~p2pfl.learning.admission.cap_claims`);
        the capped claims are kept for the round's record."""
        d = self.cfg.defence
        out, capped = cap_claims(len(self.data.train_y), claims, d.max_sample_ratio, d.max_samples)
        for peer, claimed in capped.items():
            self.capped[peer] = claimed
            log.warning(
                "%s: round %d: %s claims %d samples; capped at %d",
                self.id,
                self.round_no,
                peer,
                claimed,
                out[peer],
            )
        return out

    def robust_facts(
        self, round_no: int, method_rejected: dict[str, str] | None = None
    ) -> dict[str, Any]:
        """The round's robustness facts for its record, and the reputation they earn:
        ``rejected`` (peer → reason, admission's and the defence's), ``capped`` (peer → the
        count it claimed), ``distrusted`` (peer → the first round it is drawn again) and
        ``attack`` (what this node did, in an attack experiment). ``method_rejected``: the
        states the method itself left out (its ``merge`` facts' ``rejected``)."""
        rejected = dict(self.rejected)
        extra = method_rejected if isinstance(method_rejected, dict) else {}
        for peer, reason in [*self.defence.rejected.items(), *extra.items()]:
            if peer not in rejected:
                rejected[peer] = reason
                log.warning("%s: round %d: left out %s: %s", self.id, round_no, peer, reason)
        base = self.cfg.defence.distrust_rounds
        for peer in rejected:
            if base > 0:
                strikes = self._strikes[peer] = self._strikes.get(peer, 0) + 1
                self.distrusted[peer] = round_no + 1 + base * 2 ** min(strikes - 1, 10)
        facts: dict[str, Any] = {
            "rejected": rejected,
            "capped": dict(self.capped),
            "distrusted": {p: r for p, r in sorted(self.distrusted.items()) if r > round_no + 1},
        }
        if self.defence.fallbacks:
            facts["defence_fallbacks"] = self.defence.fallbacks
        if self.adversary is not None:
            facts["attack"] = self.adversary.describe(round_no)
        return facts

    async def send_state(self, env: Envelope, prepared: PreparedState) -> None:
        """Answer the pull ``env`` with ``prepared`` (after an attack's delay, if any)."""
        if self.adversary is not None:
            delay = self.adversary.serve_delay(env.round)
            if delay > 0:
                await asyncio.sleep(delay)
        await self.transport.send_state(env.sender, env.id, env.round, prepared)

    def claimed_samples(self, n: int, round_no: int) -> int:
        """The sample count this node tells peers (its own, unless an attack inflates it)."""
        return n if self.adversary is None else self.adversary.claimed_samples(n, round_no)

    async def refuse_pull(self, env: Envelope, reason: str) -> None:
        """Answer the pull ``env`` with ``pull_error`` and count it (``refused_pull``)."""
        self.transport.dropped["refused_pull"] += 1
        await self.transport.send(
            env.sender,
            "pull_error",
            env.round,
            {"xfer": env.id, "reason": reason},
            attempt=env.attempt,
        )

    def drop(self, reason: str, detail: Any = "") -> None:
        """Count a dropped (malformed, stale, misdirected) message and log it, rate-limited."""
        self.transport.drop(reason, detail)

    def dropped_total(self) -> int:
        """Messages dropped so far, for every reason."""
        return sum(self.transport.dropped.values())

    # ------------------------------------------------------------------ live status
    def publish_status(
        self,
        round_no: int,
        phase: str | None = None,
        *,
        pull: tuple[str, str, int] | None = None,
    ) -> None:
        """Tell observers (docs/wire.md, "Status telemetry") that round ``round_no`` enters
        ``phase`` (``training``, ``waiting``, ``aggregating``, ``evaluating``), or that a
        pull ``(peer, part, bytes)`` arrived. Fire and forget: the publish runs in the
        background, QoS 0, and is skipped while the broker is away; a failure is logged at
        debug level and never reaches the round."""
        try:
            if pull is not None:
                body = pull_body(*pull)
            elif phase is not None:
                body = phase_body(phase)
            else:
                return
            task = asyncio.ensure_future(self.transport.publish_status(round_no, body))
        except Exception as exc:  # telemetry must never break a round
            log.debug("%s: status not published: %r", self.id, exc)
            return
        self._status_tasks.add(task)
        task.add_done_callback(self._status_done)

    def _status_done(self, task: asyncio.Task) -> None:
        self._status_tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.debug("%s: status not published: %r", self.id, task.exception())

    # ------------------------------------------------------------------ learning
    async def train(self, round_no: int) -> TrainOutcome:
        """One round of local training (:meth:`LocalTraining.train`)."""
        return await self.training.train(round_no)

    async def evaluate(self) -> tuple[float, float]:
        """(accuracy, loss) of the method's model on this node's test split."""
        return await self.training.evaluate()

    # ------------------------------------------------------------------ records
    def meter(self) -> RoundMeter:
        """Start measuring a round (time, transport bytes, broker outage since the last
        round's record)."""
        if self._meter is not None and self._meter.offline_read is not None:
            self._offline_mark = self._meter.offline_read
        self._meter = RoundMeter(self.transport, self._offline_mark)
        return self._meter

    def round_record(
        self,
        round_no: int,
        *,
        meter: RoundMeter,
        evaluated: tuple[float, float],
        lr: float,
        trained: TrainOutcome | None,
        comm_s: float,
        peers: list[str],
        driver: Mapping[str, Any] | None = None,
        method: Iterable[Mapping[str, Any] | None] = (),
        method_rejected: Any = None,
    ) -> dict[str, Any]:
        """Round ``round_no``'s record (docs/architecture.md, "Round records"), every driver's
        alike.

        The fields both drivers share: ``round``, ``test_acc`` and ``test_loss``
        (``evaluated``), ``train_loss``, ``train_ce`` and ``train_s`` (``trained``; None,
        None and 0 for a node that did not train), ``comm_s``, the ``meter``'s fields,
        ``lr``, ``peers``, ``dropout``, the round's robustness facts (:meth:`robust_facts`:
        ``rejected``, ``capped``, ``distrusted``, and ``attack`` on an attacker),
        ``diverged`` (``trained``'s rollback, else None), ``dropped_total`` and ``t``.
        ``driver``: the driver's own fields (none of them may be one of the shared ones).

        ``method``: what the method returned this round (its plan, merge, apply or
        server-rule facts), in order, then ``trained.facts`` (``after_train``'s), merged
        into one map under the ``method`` key: a method's fact never replaces a field of the
        record, whatever its name. Two facts are read out of it: ``method_rejected`` (the
        states the method's merge left out, taken out of its facts by the driver) join the
        top-level ``rejected``; ``dropout`` (UA-PDFL's client-wise dropout, which summaries
        and the dashboard count) is copied to the top-level ``dropout``, False when the
        method says nothing."""
        own = dict(driver or {})
        clash = sorted(set(own) & RECORD_FIELDS)
        if clash:
            raise ValueError(f"a driver's record fields {clash} are shared fields")
        facts: dict[str, Any] = {}
        for part in (*method, trained.facts if trained is not None else None):
            if isinstance(part, Mapping):
                facts.update(part)
        result = trained.result if trained is not None else None
        acc, test_loss = evaluated
        record = {
            "round": round_no,
            "test_acc": acc,
            "test_loss": test_loss,
            "train_loss": result.loss if result is not None else None,
            "train_ce": result.ce_loss if result is not None else None,
            "train_s": round(result.seconds, 4) if result is not None else 0.0,
            "comm_s": round(comm_s, 4),
            **meter.fields(),
            "lr": lr,
            "peers": list(peers),
            **own,
            "dropout": facts.get("dropout") is True,
            METHOD_KEY: facts,
            **self.robust_facts(round_no, method_rejected),
            "diverged": trained.diverged if trained is not None else None,
            "dropped_total": self.dropped_total(),
            "t": time.time(),
        }
        if self.privacy is None:
            return record
        # privacy.dp: ε so far, before ``t``; a round without steps has no training loss
        stepped = result is not None and result.steps > 0
        if result is not None and not stepped:
            record["train_loss"] = record["train_ce"] = None
        t = record.pop("t")
        record.update(self.privacy.record_fields(stepped))
        record["t"] = t
        return record

    async def finish_round(self, record: dict[str, Any], summary: str) -> None:
        """Keep the round's record, append it to the node's log in the run directory (whole
        or not at all; kept in memory and retried when the disk is full), log a one-line
        ``summary`` and write the node's checkpoint (:mod:`p2pfl.services.checkpoint`; a disk
        that refuses it is logged, and the previous checkpoint stays)."""
        self.records.append(record)
        if self.record_log is not None:
            self.record_log.append(record)
        log.info("%s: round %d acc %.4f %s", self.id, record["round"], record["test_acc"], summary)
        if self.out_dir is not None:
            await asyncio.to_thread(self._save_checkpoint, record["round"])

    def _save_checkpoint(self, round_no: int) -> None:
        ckpt = Checkpoint.take(self.cfg, self.id, round_no, self.method, self.rng)
        if self.privacy is not None:
            ckpt.privacy = self.privacy.state()
        try:
            assert self.out_dir is not None
            save_checkpoint(checkpoint_path(self.out_dir, self.id), ckpt)
        except OSError as exc:
            log.warning("%s: round %d: checkpoint not written: %s", self.id, round_no, exc)

    async def sit_out_offline(self, round_no: int) -> float:
        """Inside an emulated offline window (``devices[].offline``): leave the network
        until it ends (presence ``offline``, no pull served, no round run), then come back
        ``online``; returns the seconds spent off (0: online)."""
        left = self.emulated.offline_left()
        if left <= 0:
            return 0.0
        log.info("%s: emulated device offline for %.1f s before round %d", self.id, left, round_no)
        self.off_network = True
        try:
            with contextlib.suppress(TransportError):
                await self.transport.set_status("offline")
            await asyncio.sleep(left)
        finally:
            self.off_network = False
        with contextlib.suppress(TransportError):
            await self.transport.set_status("online")
        return left

    async def report_round(self, round_no: int, *, joined: int | None = None) -> None:
        """Tell peers (presence) that this node finished ``round_no`` (or skipped to the
        round after it), and, with ``joined``, the first round it runs since it (re)joined."""
        info: dict[str, Any] = {"round": round_no}
        if joined is not None:
            info["joined"] = joined
        try:
            await self.transport.set_status("online", **info)
        except TransportError as exc:
            log.warning("%s: could not update presence: %s", self.id, exc)
