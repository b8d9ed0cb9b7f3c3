"""Secure aggregation on the rotating aggregator (``privacy.secagg``; docs/design.md,
"Secure aggregation"; the messages: docs/wire.md, "Secure aggregation").

The maths is :mod:`p2pfl.privacy.secagg` (SecAgg+: pairwise masks from X25519 key agreement,
Shamir shares of each member's secrets); this module carries its messages between the
members of attempt ``(r, a)`` and the attempt's aggregator ``A``. The members are the
plan's participants ``P`` (every member agrees on them); the context is ``(swarm, r, a)``,
so a failover's attempt starts from fresh keys and masks.

1. each participant ``u`` that trained makes a :class:`SecAggMember` and gossips its public
   keys (``sa_keys``) on its own gossip topic (signed by it in a signed swarm, so ``A``
   cannot substitute them); it reports to ``A`` as without secure aggregation;
2. ``A`` waits for the reports as usual; ``U1`` = the reporters whose keys it heard; it
   sends each of them ``sa_step`` ``{members: U1}``;
3. each ``u ∈ U1`` takes the keys of ``U1`` from the gossip *it* heard (a member that lacks
   one leaves the round), and sends ``A`` its sealed share bundles (``sa_shares``);
4. ``A``: ``U2`` = the senders of bundles; it sends each ``v ∈ U2`` the bundles sealed to it
   (``sa_bundles`` ``{bundles, members: U2}``);
5. ``v`` opens them, masks its upload part (the floating tensors in sorted key order,
   float64, with a coordinate 1 appended, times its sample count ``n_v``: so ``Σ n`` is
   summed securely too) and serves the masked vector as part ``masked`` to ``A`` only;
   it tells ``A`` it is ready (``sa_ready``);
6. ``A`` pulls the ready members' masked vectors (one int64 tensor of the agreed length:
   the field ``Z_2^64`` viewed as int64; nothing else is checked, they are uniformly
   random) into the server's running sum; ``U3`` = those pulled; it sends ``sa_unmask``
   ``{survivors: U3, dropped: U2 − U3}`` to ``U3``, each answers ``sa_reveal`` with its
   shares, and the server removes the masks: ``Σ n_u x_u`` and ``Σ n_u`` over ``U3``. The
   method's :meth:`~p2pfl.algorithms.base.CentralizedAlgorithm.aggregate_sum` makes the
   round's :class:`~p2pfl.algorithms.base.Aggregate` of them; the announcement names ``U3``
   as ``aggregated``.

Every step is bounded (:attr:`SecureRounds.step_s`, half of ``round_timeout_s``, at least
1 s; a member waits for ``A`` until the driver settles the attempt); a member missing a step
is left out (after masking, the survivors' shares remove its masks). Fewer than ``t``
members at any step, or an unmask that cannot finish, fails the attempt cleanly: its
announcement counts no upload and carries ``aggregate_error``, and every member keeps its
model for the round. ``A`` never holds an individual member's unmasked vector: each pulled
masked vector goes into the server's sum and is dropped.

A message of another round or attempt (the driver's ``stale_round`` / ``stale_attempt``),
from a non-member (``not_member``), from anyone but the attempt's aggregator where it must
send it (``not_aggregator``), to a node that does not aggregate the attempt
(``misdirected_report``), repeated (``duplicate``) or malformed (``malformed``) is dropped,
logged and counted.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from p2pfl.algorithms.base import Aggregate, Upload
from p2pfl.learning.state import State
from p2pfl.privacy.secagg import RoundContext, SecAggError, SecAggMember, SecAggServer
from p2pfl.privacy.secagg.messages import id_list, parse_keys
from p2pfl.rounds.rotation.plans import RoundPlan, waits_on
from p2pfl.rounds.rotation.role import RotationRole
from p2pfl.services.bundle import NodeServices
from p2pfl.wire.envelope import Envelope
from p2pfl.wire.errors import TransportError

log = logging.getLogger(__name__)

KEYS = "sa_keys"  # gossip: a member's public keys of (r, a)
TO_MEMBER = ("sa_step", "sa_bundles", "sa_unmask")  # inbox: aggregator → member
TO_AGGREGATOR = ("sa_shares", "sa_ready", "sa_reveal")  # inbox: member → aggregator
KINDS = (KEYS, *TO_MEMBER, *TO_AGGREGATOR)
PART = "masked"  # the pull part a member serves its masked vector under

Key = tuple[int, int]  # (round, attempt)


# ----------------------------------------------------------------------------- pure helpers
def threshold_for(members: int, neighbours: int | None, fraction: float) -> tuple[int, int]:
    """``(t, k)`` of a round of ``members`` members: ``k`` the degree of the SecAgg+ graph
    (:func:`~p2pfl.privacy.secagg.graph.neighbourhoods`: every other member, or ``2⌈k/2⌉``),
    ``t = ⌈fraction · k⌉`` clamped into ``⌊k/2⌋ < t ≤ k``."""
    half = members if neighbours is None else -(-neighbours // 2)
    degree = members - 1 if 2 * half >= members - 1 else 2 * half
    t = math.ceil(fraction * degree - 1e-9)
    return min(degree, max(degree // 2 + 1, t)), degree


def _floating(state: State) -> list[str]:
    return sorted(k for k, v in state.items() if torch.is_floating_point(v))


def vector_length(state: State) -> int:
    """How many coordinates :func:`flatten` gives for a state of ``state``'s layout."""
    return sum(state[k].numel() for k in _floating(state)) + 1


def flatten(state: State) -> np.ndarray:
    """The floating tensors of ``state`` in sorted key order, as one float64 vector, with a
    last coordinate 1 (times the member's weight: the weight's own sum)."""
    parts = [
        state[k].detach().cpu().reshape(-1).to(torch.float64).numpy() for k in _floating(state)
    ]
    return np.concatenate([*parts, np.ones(1)])


def unflatten(vector: np.ndarray, template: State) -> State:
    """The floating tensors of ``template``'s layout (float64) from ``vector`` without its
    last coordinate."""
    out: State = {}
    at = 0
    for key in _floating(template):
        size = template[key].numel()
        out[key] = torch.from_numpy(vector[at : at + size].copy()).reshape(template[key].shape)
        at += size
    return out


def masked_of(state: Any, length: int) -> np.ndarray | None:
    """The ``uint64`` field vector of a pulled ``masked`` part, or None unless it is exactly
    ``{"masked": int64 tensor of shape (length,)}``."""
    if not isinstance(state, dict) or set(state) != {PART}:
        return None
    tensor = state[PART]
    if not isinstance(tensor, torch.Tensor) or tensor.dtype != torch.int64:
        return None
    if tuple(tensor.shape) != (length,):
        return None
    return tensor.detach().cpu().numpy().view(np.uint64)


# ----------------------------------------------------------------------------- the node's side
class SecureRounds(RotationRole):
    """Secure aggregation for one node of a centralized method: the messages it heard (by
    attempt), its member's side (:meth:`start_member`, a task the driver runs while it waits
    for the attempt's announcement) and the aggregator's (:meth:`aggregate`, in place of
    pulling individual uploads). ``aggregator_of(r, a)`` is the driver's answer to who
    aggregates an attempt (None while the round's roster is unknown)."""

    def __init__(
        self, services: NodeServices, aggregator_of: Callable[[int, int], str | None]
    ) -> None:
        super().__init__(services)
        privacy = services.cfg.privacy
        assert privacy is not None and privacy.secagg
        self.aggregator_of = aggregator_of
        self.neighbours = privacy.secagg_neighbours
        self.fraction = privacy.secagg_threshold
        self.step_s = max(1.0, services.cfg.timing.round_timeout_s / 2)
        self.keys: dict[Key, dict[str, dict[str, bytes]]] = {}
        self.inbox: dict[Key, dict[tuple[str, str], dict[str, Any]]] = {}
        self.masked: dict[Key, State] = {}  # this member's masked vector, for A's pull
        self._task: asyncio.Task | None = None
        self._facts: dict[int, dict[str, Any]] = {}  # round -> this member's part

    # ------------------------------------------------------------------ incoming
    def on_message(self, env: Envelope) -> None:
        """Keep one ``sa_*`` message (the driver dropped those of a dead round or attempt):
        keys by sender, inbox messages by kind and sender, the first of each only."""
        svc, key, who = self.services, (env.round, env.attempt), env.sender
        what = f"{env.kind} {env.round}/{env.attempt} from {who}"
        if who not in self.members:
            svc.ledger.drop("not_member", what)
            return
        if not isinstance(env.body, dict) or env.attempt >= len(self.members):
            svc.ledger.drop("malformed", what)
            return
        agg = self.aggregator_of(*key)
        if env.kind == KEYS:
            try:
                c_pk, s_pk = parse_keys(env.body.get("keys"), who)
            except SecAggError as exc:
                svc.ledger.drop("malformed", f"{what}: {exc}")
                return
            heard = self.keys.setdefault(key, {})
            if who in heard:
                svc.ledger.drop("duplicate", what)
                return
            heard[who] = {"c_pk": c_pk, "s_pk": s_pk}
        elif env.kind in TO_MEMBER or env.kind in TO_AGGREGATOR:
            if env.kind in TO_MEMBER and agg is not None and agg != who:
                svc.ledger.drop("not_aggregator", what)
                return
            if env.kind in TO_AGGREGATOR and agg is not None and agg != self.id:
                svc.ledger.drop("misdirected_report", what)
                return
            box = self.inbox.setdefault(key, {})
            if (env.kind, who) in box:
                svc.ledger.drop("duplicate", what)
                return
            box[(env.kind, who)] = env.body
        else:
            svc.ledger.drop("unexpected_kind", what)
            return
        svc.peers.notify()

    def masked_for(self, env: Envelope) -> tuple[State | None, str | None]:
        """This member's masked vector of the attempt a pull of part ``masked`` names, for its
        rightful aggregator only: ``(state, None)`` or ``(None, why not)``."""
        if env.sender != self.aggregator_of(env.round, env.attempt):
            return None, f"not the aggregator of {env.round}/{env.attempt}"
        state = self.masked.get((env.round, env.attempt))
        if state is None:
            return None, f"no masked input for {env.round}/{env.attempt}"
        return state, None

    def forget(self, floor: int) -> None:
        """Drop what was kept of round ``floor`` and before."""
        for d in (self.keys, self.inbox, self.masked):
            for k in [k for k in d if k[0] <= floor]:
                del d[k]
        for r in [r for r in self._facts if r <= floor]:
            del self._facts[r]

    async def _deliver(self, to: str, kind: str, round_no: int, body: dict, attempt: int) -> None:
        """Send ``kind`` to ``to``'s inbox; to this node itself (the aggregator is also a
        member), straight into its own mailbox."""
        if to == self.id:
            self.inbox.setdefault((round_no, attempt), {}).setdefault((kind, self.id), body)
            self.services.peers.notify()
            return
        try:
            await self.services.exchange.send(to, kind, round_no, body, attempt=attempt)
        except TransportError as exc:
            log.warning("%s: round %d: %s to %s failed: %s", self.id, round_no, kind, to, exc)

    def _got(self, key: Key, kind: str, who: str) -> dict[str, Any] | None:
        return self.inbox.get(key, {}).get((kind, who))

    def _context(self, plan: RoundPlan, attempt: int) -> tuple[RoundContext, list[str], int, int]:
        members = sorted(plan.participants)
        t, k = threshold_for(len(members), self.neighbours, self.fraction)
        return RoundContext(self.cfg.name, plan.round, attempt), members, t, k

    # ------------------------------------------------------------------ member side
    def start_member(
        self, plan: RoundPlan, attempt: int, aggregator: str, n: int | None, upload: State | None
    ) -> None:
        """Run this node's member side of attempt ``attempt`` (aggregated by ``aggregator``)
        as a task, ending the one of an earlier attempt; nothing when it did not train
        (``upload`` None) or is not a participant."""
        self.stop_member()
        if upload is None or n is None or self.id not in plan.participants:
            return
        facts: dict[str, Any] = {"attempt": attempt, "step": "started"}
        self._facts[plan.round] = facts
        self._task = asyncio.create_task(self._member(plan, attempt, aggregator, n, upload, facts))

    def stop_member(self) -> None:
        """End the member side's task (its attempt settled or failed over)."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
        self._task = None

    def member_facts(self, round_no: int) -> dict[str, Any] | None:
        """This member's part in round ``round_no``'s secure aggregation, for its record:
        ``{attempt, step}`` (the last step it finished: ``advertised``, ``shared``,
        ``masked``, ``revealed``), with ``left`` (why) when it left; None when it had none."""
        return self._facts.get(round_no)

    async def _member(
        self,
        plan: RoundPlan,
        attempt: int,
        agg: str,
        n: int,
        upload: State,
        facts: dict[str, Any],
    ) -> None:
        try:
            await self._member_steps(plan, attempt, agg, n, upload, facts)
        except (SecAggError, ValueError, TypeError, TransportError) as exc:  # untrusted input
            facts["left"] = str(exc)
            log.warning("%s: round %d: left secure aggregation: %s", self.id, plan.round, exc)

    async def _member_steps(
        self,
        plan: RoundPlan,
        attempt: int,
        agg: str,
        n: int,
        upload: State,
        facts: dict[str, Any],
    ) -> None:
        svc, r, key = self.services, plan.round, (plan.round, attempt)
        ctx, members, t, k = self._context(plan, attempt)
        member = SecAggMember(self.id, members, t, ctx, neighbours=self.neighbours)
        mine = member.advertise()
        self.keys.setdefault(key, {})[self.id] = mine
        await svc.exchange.gossip(r, {"keys": mine}, kind=KEYS, attempt=attempt)
        facts["step"] = "advertised"
        deadline = time.monotonic() + self.cfg.timing.aggregator_timeout  # the driver ends sooner

        async def from_aggregator(kind: str) -> dict[str, Any]:
            if not await svc.peers.wait_for(
                lambda: self._got(key, kind, agg) is not None, deadline
            ):
                raise SecAggError(f"no {kind} from {agg}")
            return self._got(key, kind, agg) or {}

        step = await from_aggregator("sa_step")
        u1 = id_list(step.get("members"), "members")
        if self.id not in u1:
            raise SecAggError("left out of the members by the aggregator")
        heard = self.keys.setdefault(key, {})
        await svc.peers.wait_for(
            lambda: all(u in heard for u in u1), time.monotonic() + self.step_s
        )
        missing = sorted(u for u in u1 if u not in heard)
        if missing:
            raise SecAggError(f"keys of {missing} not heard")
        bundles = await asyncio.to_thread(member.share_keys, {u: heard[u] for u in u1})
        await self._deliver(agg, "sa_shares", r, {"bundles": bundles}, attempt)
        facts["step"] = "shared"
        got = await from_aggregator("sa_bundles")
        sealed = got.get("bundles")
        if not isinstance(sealed, dict):
            raise SecAggError("sa_bundles: expected {sender: bundle}")
        await asyncio.to_thread(member.receive_shares, sealed)
        vector = await asyncio.to_thread(member.mask, flatten(upload), float(n))
        self.masked[key] = {PART: torch.from_numpy(vector.view(np.int64).copy())}
        await self._deliver(agg, "sa_ready", r, {}, attempt)
        facts["step"] = "masked"
        request = await from_aggregator("sa_unmask")
        reply = member.unmask_shares(request.get("survivors"), request.get("dropped"))
        await self._deliver(agg, "sa_reveal", r, reply, attempt)
        facts["step"] = "revealed"

    # ------------------------------------------------------------------ aggregator side
    def _live(self, peer: str, round_no: int) -> bool:
        return peer == self.id or waits_on(self.services, peer, round_no)

    async def _wait_all(
        self, key: Key, kind: str, peers: list[str], superseded: Callable[[], bool]
    ) -> list[str]:
        """Wait (:attr:`step_s` at most) for ``kind`` from every live one of ``peers``;
        returns those it came from."""
        r = key[0]
        await self.services.peers.wait_for(
            lambda: (
                superseded()
                or all(self._got(key, kind, p) is not None or not self._live(p, r) for p in peers)
            ),
            time.monotonic() + self.step_s,
        )
        return [p for p in peers if self._got(key, kind, p) is not None]

    async def _pull_masked(
        self, key: Key, peers: list[str], server: SecAggServer, length: int
    ) -> None:
        """Each of ``peers``'s masked vector into ``server``'s sum (this node's own from its
        member side); a pull that fails or a vector that is not one is left out."""
        r, attempt = key
        svc = self.services

        async def one(peer: str) -> State:
            if peer == self.id:
                return self.masked[key]
            return await svc.exchange.pull(
                peer, r, PART, self.step_s, attempt=attempt, decode=False
            )

        pulled = await asyncio.gather(*(one(p) for p in peers), return_exceptions=True)
        for peer, state in zip(peers, pulled, strict=True):
            if isinstance(state, BaseException):
                log.warning("%s: round %d: masked input of %s: %s", self.id, r, peer, state)
                continue
            field = masked_of(state, length)
            if field is None:
                svc.ledger.drop(
                    "malformed", f"masked input of {peer}: not one int64 vector of {length}"
                )
                continue
            server.receive_masked(peer, field)  # added to the sum; the vector is not kept

    async def aggregate(
        self,
        plan: RoundPlan,
        attempt: int,
        reports: dict[str, dict[str, Any]],
        own: dict[str, Any] | None,
        template: State,
        superseded: Callable[[], bool],
    ) -> tuple[dict[str, Upload], Aggregate, str | None, dict[str, Any]] | None:
        """Attempt ``attempt`` of ``plan``'s round as its aggregator, over the reporters
        (``reports``; this node too when ``own`` is its report): ``(uploads, result, error,
        facts)`` — ``uploads`` names each member counted (``U3``) with its claimed weight and
        report and no state; ``result`` the method's :meth:`aggregate_sum` (or, with
        ``error``, no result: nothing is counted); ``facts`` ``{members, shared, masked,
        dropped, t, k, secagg_s}`` (and ``weight_mismatch`` when ``Σ n`` summed differs from
        the reported counts). None as soon as ``superseded()``."""
        svc, r, key = self.services, plan.round, (plan.round, attempt)
        t0 = time.monotonic()
        ctx, members, t, k = self._context(plan, attempt)
        claimed = {p: rep for p, rep in reports.items() if p in members}
        if own is not None and self.id in members:
            claimed[self.id] = own
        facts: dict[str, Any] = {"members": [], "shared": [], "masked": [], "dropped": []}
        facts.update(t=t, k=k)
        empty = Aggregate({}, None, server=plan.server)

        def failed(why: str) -> tuple[dict[str, Upload], Aggregate, str, dict[str, Any]]:
            log.error(
                "%s: round %d attempt %d: secure aggregation failed: %s", self.id, r, attempt, why
            )
            facts["secagg_s"] = round(time.monotonic() - t0, 4)
            return {}, empty, f"secagg: {why}", facts

        length = vector_length(template)
        server = SecAggServer(members, t, ctx, length, neighbours=self.neighbours)
        heard = await self._keys_of(key, sorted(claimed), superseded)
        if superseded():
            return None
        for p in heard:
            server.receive_keys(p, self.keys[key][p])
        u1 = sorted(server.advertised())
        facts["members"] = u1
        if len(u1) < t + 1:  # each member shares with at least t of the others
            return failed(f"{len(u1)} members advertised keys, threshold {t}")
        await asyncio.gather(
            *(self._deliver(u, "sa_step", r, {"members": u1}, attempt) for u in u1)
        )
        for u in await self._wait_all(key, "sa_shares", u1, superseded):
            try:
                server.receive_bundles(u, self._got(key, "sa_shares", u).get("bundles"))  # type: ignore[union-attr]
            except SecAggError as exc:
                svc.ledger.drop("malformed", f"sa_shares from {u}: {exc}")
        if superseded():
            return None
        u2 = server.shared()
        facts["shared"] = u2
        if len(u2) < t:
            return failed(f"{len(u2)} members shared keys, threshold {t}")
        await asyncio.gather(
            *(
                self._deliver(
                    v, "sa_bundles", r, {"bundles": server.bundles_for(v), "members": u2}, attempt
                )
                for v in u2
            )
        )
        ready = await self._wait_all(key, "sa_ready", u2, superseded)
        if superseded():
            return None
        await self._pull_masked(key, ready, server, length)
        try:
            request = server.unmask_request()
        except SecAggError as exc:
            return failed(str(exc))
        u3 = request["survivors"]
        facts["masked"], facts["dropped"] = u3, request["dropped"]
        await asyncio.gather(*(self._deliver(u, "sa_unmask", r, request, attempt) for u in u3))
        for u in await self._wait_all(key, "sa_reveal", u3, superseded):
            try:
                server.receive_unmask(u, self._got(key, "sa_reveal", u))  # type: ignore[arg-type]
            except SecAggError as exc:
                svc.ledger.drop("malformed", f"sa_reveal from {u}: {exc}")
        if superseded():
            return None
        try:
            total = await asyncio.to_thread(server.result)
        except SecAggError as exc:
            return failed(str(exc))
        weight = float(total[-1])
        reported = sum(int(claimed[u]["n"]) for u in u3)
        if abs(weight - reported) > 0.5:  # a member masked another weight than it reported
            facts["weight_mismatch"] = {"summed": weight, "reported": reported}
        summed = unflatten(total, template)
        try:
            result = await asyncio.to_thread(
                self.alg.aggregate_sum, summed, weight, template, u3, plan.server, plan.roster, r
            )
        except (ValueError, ArithmeticError, RuntimeError) as exc:
            return failed(f"server rule: {exc}")
        uploads = {u: Upload(claimed[u]["n"], {}, claimed[u]["report"]) for u in u3}
        facts["secagg_s"] = round(time.monotonic() - t0, 4)
        return uploads, result, None, facts

    async def _keys_of(
        self, key: Key, reporters: list[str], superseded: Callable[[], bool]
    ) -> list[str]:
        """The reporters whose keys this node heard, after waiting (:attr:`step_s` at most)
        for those of every live one."""
        r = key[0]
        await self.services.peers.wait_for(
            lambda: (
                superseded()
                or all(p in self.keys.get(key, {}) or not self._live(p, r) for p in reporters)
            ),
            time.monotonic() + self.step_s,
        )
        return [p for p in reporters if p in self.keys.get(key, {})]
