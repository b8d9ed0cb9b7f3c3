"""Round driver for decentralized methods (:class:`~p2pfl.algorithms.base.DecentralizedAlgorithm`):
gossip, pull from chosen neighbours, merge, train (docs/architecture.md, "Round flow").

One round ``r`` of node ``i``:

1. (methods that exchange after training, e.g. DFedAvgM) train first;
2. keep a snapshot of the model for peers' pulls of round ``r`` and publish the method's
   gossip (small: sample counts, representations);
3. draw peers from the neighbours that are online (:meth:`DecentralizedAlgorithm.choose_peers`) and wait
   for their gossip of round ``r`` (``timing.round_timeout_s`` at most, counted from the
   moment this node's snapshot was taken; a peer that goes offline is not waited for);
4. ask the method which part to pull from whom (:meth:`DecentralizedAlgorithm.plan`), pull them all at
   once, and merge what arrived (:meth:`DecentralizedAlgorithm.merge`);
5. (the other methods) train; then evaluate and record (:meth:`~p2pfl.services.ledger.Ledger.round_record`:
   the method's plan, merge and ``after_train`` facts under the record's ``method`` key).

Each step is told to observers (:meth:`~p2pfl.services.ledger.Ledger.publish_status`): ``training``,
``waiting`` (gossip), ``aggregating`` (pulls and merge), ``evaluating``.

Peers serve pulls from their snapshot of the round named in the request (the last
``SNAPSHOTS_KEPT`` rounds are kept). A neighbour that comes online after this round's gossip
went out is sent it again. A node whose neighbours are already under way when it starts
joins at the round after the latest one they report (their presence carries it).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from typing import Any

from p2pfl.algorithms.base import DecentralizedAlgorithm, Method
from p2pfl.config.schema import TopologyConfig
from p2pfl.config.topology import neighbours
from p2pfl.learning.state import PARTS, State
from p2pfl.learning.train import catch_up_budget_s
from p2pfl.services.bundle import NodeServices
from p2pfl.services.exchange import PreparedState
from p2pfl.services.training import TrainOutcome
from p2pfl.wire.envelope import Envelope
from p2pfl.wire.errors import TransportError

log = logging.getLogger(__name__)


def cap_gossiped_counts(
    svc: NodeServices, gossip: dict[str, dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """The peers' gossip with each claimed sample count ``n`` capped (admission:
    :meth:`~p2pfl.services.robust.Robustness.cap_claims`); bodies without a usable count are kept as they are
    (the method decides about them)."""
    claims = {
        p: g["n"]
        for p, g in gossip.items()
        if isinstance(g, dict) and isinstance(g.get("n"), int) and not isinstance(g["n"], bool)
    }
    if not claims:
        return gossip
    capped = svc.robust.cap_claims(claims)
    return {
        p: ({**g, "n": capped[p]} if p in capped and capped[p] != g["n"] else g)
        for p, g in gossip.items()
    }


SNAPSHOTS_KEPT = 3
GOSSIP_AHEAD = 5  # rounds ahead of ours whose gossip we keep


class DecentralizedRounds:
    """Runs a :class:`DecentralizedAlgorithm` for one node: its rounds, and serving its snapshots."""

    def __init__(self, services: NodeServices):
        assert isinstance(services.method, DecentralizedAlgorithm)
        self.services = services
        self.alg: DecentralizedAlgorithm = services.method
        self.id = services.id
        self.round = 0
        self._started = False  # rounds under way: gossip is kept for a window around ours
        self._gossip: dict[int, dict[str, dict[str, Any]]] = {}
        self._last_gossip: tuple[int, dict[str, Any]] | None = None  # for late joiners
        # each neighbour's gossip of the latest round it sent, whatever our round
        self._latest: dict[str, tuple[int, dict[str, Any]]] = {}
        self._snapshots: OrderedDict[int, State] = OrderedDict()
        self._prepared: dict[tuple[int, str], PreparedState] = {}
        self._prepare_locks: dict[tuple[int, str], asyncio.Lock] = {}

    # ------------------------------------------------------------------ what it declares
    @classmethod
    def selects(cls, method: type[Method], cfg: TopologyConfig) -> bool:
        """A decentralized method in synchronous rounds."""
        return method.kind == "decentralized" and cfg.timing.mode != "async"

    @classmethod
    def peers_of(cls, cfg: TopologyConfig, node_id: str) -> list[str]:
        """The node's neighbours in the topology's graph."""
        return neighbours(cfg, node_id)

    @classmethod
    def listens_to(cls, neighbours: list[str]) -> list[str] | None:
        """A node hears its neighbours only."""
        return neighbours

    async def start(self) -> list[str]:
        """The startup barrier waits for every neighbour."""
        return self.services.neighbours

    # ------------------------------------------------------------------ incoming
    def on_gossip(self, env: Envelope) -> None:
        """Keep a neighbour's gossip of a round near ours (any round before the first)."""
        svc = self.services
        if env.kind != "gossip" or env.sender not in svc.neighbours:
            return  # gossip is for neighbours; others' traffic is not ours to keep
        # before the first round, the round we join at is not known yet: keep any round
        lo, hi = (
            (self.round - 1, self.round + GOSSIP_AHEAD) if self._started else (1, svc.cfg.rounds)
        )
        latest = self._latest.get(env.sender)
        if latest is None or env.round > latest[0]:  # what a catching-up node starts from
            self._latest[env.sender] = (env.round, env.body)
        if not lo <= env.round <= hi:
            svc.ledger.count("stale_gossip")
            return
        self._gossip.setdefault(env.round, {})[env.sender] = env.body
        svc.peers.notify()

    def on_inbox(self, env: Envelope) -> None:
        """Decentralized methods send nothing to a peer's inbox but pulls."""

    def on_peer_online(self, peer: str) -> None:
        """Publish this round's gossip again: the neighbour missed it."""
        if self._last_gossip is None:
            return
        round_no, message = self._last_gossip
        self.services.exchange.gossip_again(round_no, message)

    # ------------------------------------------------------------------ serving pulls
    async def _prepared_part(self, round_no: int, part: str) -> PreparedState | None:
        key = (round_no, part)
        if key in self._prepared:
            return self._prepared[key]
        lock = self._prepare_locks.setdefault(key, asyncio.Lock())
        async with lock:
            if key not in self._prepared:
                snap = self._snapshots.get(round_no)  # round_no is a served_round
                if snap is None:
                    return None
                state = self.alg.select(snap, part)
                self._prepared[key] = await self.services.exchange.prepare(state, round_no, "model")
        return self._prepared.get(key)

    async def serve_pull(self, env: Envelope) -> None:
        """Answer a neighbour's pull from the snapshot of the round it names."""
        svc = self.services
        body = env.body if isinstance(env.body, dict) else {}
        part = body.get("part")
        reason = None
        if env.sender not in svc.neighbours:
            reason = "not a neighbour"
        elif part not in PARTS:
            reason = f"unknown part {part!r}"
        served = self.served_round(env.round)
        if svc.exchange.streams is not None and reason is None and served is not None:
            # top-k: each part is a stream, each snapshot published into it once
            state = self.alg.select(self._snapshots[served], part)
            await svc.exchange.serve_stream(env, part, served, state, served, "model")
            return
        prepared = None if reason or served is None else await self._prepared_part(served, part)
        if reason is None and prepared is None:
            reason = f"no state for round {env.round}"
        if reason is not None or prepared is None:
            await svc.exchange.refuse_pull(env, reason or "")
            return
        await svc.exchange.send_state(env, prepared)

    def served_round(self, requested: int) -> int | None:
        """The snapshot a pull of round ``requested`` is served from (None: not kept)."""
        return requested if requested in self._snapshots else None

    def pull_round(self, peer: str, round_no: int) -> int:
        """The round to ask ``peer`` for in round ``round_no``: the same round."""
        return round_no

    def _keep_snapshot(self, round_no: int, state: State) -> None:
        self._snapshots[round_no] = state
        while len(self._snapshots) > SNAPSHOTS_KEPT:
            old, _ = self._snapshots.popitem(last=False)
            for part in PARTS:
                self._prepared.pop((old, part), None)
                self._prepare_locks.pop((old, part), None)

    # ------------------------------------------------------------------ the round
    async def _publish_gossip(self, round_no: int) -> list[str]:
        """Publish this round's gossip (if the method has any) and draw the peers to hear:
        online, in step and trusted."""
        svc = self.services
        if not await self._publish(round_no):
            return []
        # online, in step and not distrusted (reputation: docs/design.md, "Robust aggregation")
        in_step = [
            p
            for p in svc.neighbours
            if svc.peers.in_step(p, round_no) and svc.robust.trusted(p, round_no)
        ]
        return self.alg.choose_peers(in_step)

    async def _publish(self, round_no: int) -> bool:
        """Publish this round's gossip; False when the method has none."""
        message = self.alg.gossip()
        if message is None:
            return False
        svc = self.services
        message = svc.exchange.told(message, round_no)  # an experiment's inflated claim
        self._last_gossip = (round_no, message)
        try:
            await svc.exchange.gossip(round_no, message)
        except TransportError as exc:  # broker gone: peers will not hear from us
            log.warning("%s: round %d: gossip not sent: %s", self.id, round_no, exc)
        return True

    async def _merge(
        self, round_no: int, got: dict[str, dict[str, Any]], pulled: dict[str, State]
    ) -> tuple[dict[str, Any], str | None]:
        """The method's merge of what was admitted: (its facts, None), or ({}, why) when it
        failed. A merge that fails on a peer's content (a method's own check:
        ``ValueError``; torch refusing a tensor: ``RuntimeError``) leaves the node on its
        own model for the round, logged and counted: a peer's bytes never stop a node
        (docs/design.md)."""
        svc = self.services
        before = self.alg.checkpoint()
        try:
            merged = await asyncio.to_thread(self.alg.merge, got, pulled)
        except (ValueError, RuntimeError, ArithmeticError) as exc:
            self.alg.model_changed()
            self.alg.restore(before)
            svc.ledger.drop("bad_merge", f"round {round_no}: {exc}")
            log.warning("%s: round %d: merge failed, own model kept: %s", self.id, round_no, exc)
            return {}, str(exc)
        self.alg.model_changed()  # the method's own code changed its model
        merged = dict(merged) if isinstance(merged, dict) else {}
        svc.training.merged(list(merged.get("merged_from", sorted(pulled))))
        return merged, None

    async def _gather(
        self, round_no: int, t_comm: float
    ) -> tuple[list[str], dict[str, dict[str, Any]], dict[str, int] | None]:
        """Publish this round's gossip, draw the peers and hear them: (chosen, their
        admitted gossip, their staleness or None). Synchronous rounds wait for the drawn
        peers' gossip of ``round_no`` (``timing.round_timeout_s`` from ``t_comm`` at most);
        staleness is not recorded, it is 0 by construction."""
        svc = self.services
        chosen = await self._publish_gossip(round_no)
        deadline = t_comm + svc.cfg.timing.round_timeout_s

        def heard_all() -> bool:
            got = self._gossip.get(round_no, {})
            return all(p in got or not svc.peers.in_step(p, round_no) for p in chosen)

        await svc.peers.wait_for(heard_all, deadline)
        heard = self._gossip.get(round_no, {})
        return chosen, cap_gossiped_counts(svc, {p: heard[p] for p in chosen if p in heard}), None

    async def run_round(
        self, round_no: int, *, pace: tuple[int, float] | None = None
    ) -> dict[str, Any]:
        """Run round ``round_no``; return its record. ``pace``: ``(k, budget_s)`` of a
        catch-up round trained at the swarm's pace (:meth:`run`), which its record keeps
        (``catch_up_pace``) with the steps it took."""
        budget_s = pace[1] if pace is not None else None
        svc, alg = self.services, self.alg
        meter = svc.ledger.meter()
        svc.robust.begin_round(round_no)
        self.round = round_no
        for old in [r for r in self._gossip if r < round_no - 1]:
            del self._gossip[old]
        trained: TrainOutcome | None = None
        if alg.exchange_after_training:  # peers pull what this node just trained
            svc.ledger.publish_status(round_no, "training")
            trained = await svc.training.train(round_no, budget_s=budget_s)
        t_comm = time.monotonic()
        svc.ledger.publish_status(round_no, "waiting")
        self._keep_snapshot(round_no, alg.snapshot())
        chosen, got, staleness = await self._gather(round_no, t_comm)
        deadline = t_comm + svc.cfg.timing.round_timeout_s
        plan, facts = alg.plan(got)
        svc.ledger.publish_status(round_no, "aggregating")
        timeout = max(0.1, deadline - time.monotonic())
        own = self._snapshots[round_no]
        pulled, failed = await svc.exchange.pull_many(
            plan,
            round_no,
            timeout,
            reference=lambda part: alg.select(own, part),
            rounds={p: self.pull_round(p, round_no) for p in plan},
        )
        comm_s = time.monotonic() - t_comm
        merged, merge_error = await self._merge(round_no, got, pulled)
        if trained is None:
            svc.ledger.publish_status(round_no, "training")
            trained = await svc.training.train(round_no, budget_s=budget_s)
        svc.ledger.publish_status(round_no, "evaluating")
        evaluated = await svc.training.evaluate()
        fields: dict[str, Any] = {
            "chosen": chosen,
            "missing": sorted(set(chosen) - set(got)),
            "pulled": {p: plan[p] for p in sorted(pulled)},
            "pull_failed": failed,
        }
        if staleness is not None:
            fields["staleness"] = staleness
        if merge_error is not None:
            fields["merge_error"] = merge_error
        if pace is not None:
            fields["catch_up_pace"] = {
                "swarm_rounds": pace[0],
                "budget_s": round(pace[1], 3),
                "steps": trained.result.steps,
                "of": svc.training.round_steps(),
            }
        # the states the merge left out are robustness facts: they join ``rejected``
        method_rejected = merged.pop("rejected", None)
        return svc.ledger.round_record(
            round_no,
            meter=meter,
            evaluated=evaluated,
            lr=trained.lr,
            trained=trained,
            comm_s=comm_s,
            peers=sorted(got),
            driver=fields,
            method=(facts, merged),  # then after_train's (trained.facts)
            method_rejected=method_rejected,
        )

    # ------------------------------------------------------------------ lifecycle
    def _skip_to(self, round_no: int) -> None:
        """Start at ``round_no`` (joining late, resuming or catching up): keep the gossip of
        the rounds around it, starting from each neighbour's latest."""
        self.round = round_no - 1
        self._gossip = {r: g for r, g in self._gossip.items() if r >= round_no - 1}
        for peer, (r, body) in self._latest.items():
            if round_no - 1 <= r <= round_no + GOSSIP_AHEAD:
                self._gossip.setdefault(r, {})[peer] = body

    async def run(self) -> None:
        """Every round from the one this node joins at to the last: the round after the
        latest one its neighbours report (or its checkpoint holds, when resuming); a node
        that finds itself :data:`~p2pfl.services.peers.LAG_ROUNDS` behind its neighbours
        catches up to their round, or to the last round once a neighbour is done
        (:meth:`~p2pfl.services.peers.PeerView.catch_up_to`; docs/wire.md, "Rounds and
        catch-up"), and trains the round it catches up to at the swarm's pace
        (``timing.catch_up_training: paced``): for the time its previous round took
        divided by the rounds its neighbours ran meanwhile
        (:meth:`~p2pfl.services.peers.PeerView.progress`;
        :func:`~p2pfl.learning.train.catch_up_budget_s`). A method
        that does not keep in step (:attr:`DecentralizedAlgorithm.keeps_in_step` False:
        Local) does neither: it starts at round 1 (or after its checkpoint) and runs every
        round."""
        svc, rounds = self.services, self.services.cfg.rounds
        in_step = self.alg.keeps_in_step
        paced = in_step and svc.cfg.timing.catch_up_training == "paced"
        swarm = svc.peers.swarm_round(svc.neighbours) if in_step else 0
        r = max(swarm, svc.ledger.resumed_round) + 1
        skipped_from: int | None = None
        if r > 1:  # neighbours under way, or resuming from a checkpoint
            log.info("%s: joining at round %d", self.id, r)
            self._skip_to(r)
            await svc.ledger.report_round(r - 1, joined=r)
        self._started = True

        def now() -> tuple[int, float]:  # how far the neighbours are (paced only), and when
            return (svc.peers.progress(svc.neighbours, rounds) if paced else 0), time.monotonic()

        mark, began = now()  # as this node's round begins
        while r <= rounds:
            await svc.device.sit_out_offline(r)
            target = svc.peers.catch_up_to(r, svc.neighbours, rounds) if in_step else None
            pace: tuple[int, float] | None = None
            if target is not None:
                if paced:  # one of the neighbours' rounds, as this node saw them go
                    at, t = now()
                    budget_s = catch_up_budget_s(t - began, at - mark)
                    pace = None if budget_s is None else (at - mark, budget_s)
                log.warning(
                    "%s: catching up to round %d from round %d (neighbours ahead or done)%s",
                    self.id,
                    target,
                    r,
                    "" if pace is None else f", training {pace[1]:.2f} s (their pace)",
                )
                skipped_from, r = r, target
                self._skip_to(r)
                await svc.ledger.report_round(r - 1, joined=r)
            mark, began = now()
            record = await self.run_round(r, pace=pace)
            if skipped_from is not None:
                record["caught_up_from"], skipped_from = skipped_from, None
            dropout = " (dropout)" if record.get("dropout") else ""
            await svc.ledger.finish_round(record, f"peers {record['peers']}{dropout}")
            if r < rounds:  # peers see where this node is
                await svc.ledger.report_round(r)
            r += 1
