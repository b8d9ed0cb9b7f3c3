"""A member's own steps in a centralized round (docs/design.md, "Rotating aggregator"; the
messages: docs/wire.md, "Rotating aggregator"): train and keep its upload, report to an
attempt's aggregator (and offer an upload late, quorum rounds), pull the result it
receives, and apply it. Which attempt and which aggregator is the succession's
(:mod:`p2pfl.rounds.rotation.succession`); the round's record is the driver's
(:mod:`p2pfl.rounds.rotation.centralized`).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from p2pfl.learning.state import State
from p2pfl.rounds.rotation.aggregator import AggregatorRole
from p2pfl.rounds.rotation.late import LateOffer, LateOffers
from p2pfl.rounds.rotation.lineage import Lineage
from p2pfl.rounds.rotation.plans import RoundPlan
from p2pfl.rounds.rotation.role import RotationRole
from p2pfl.services.bundle import NodeServices
from p2pfl.services.training import TrainOutcome
from p2pfl.wire.errors import TransportError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Pulled:
    """The result of a pull of an aggregator's result: the state (admitted), or why not."""

    state: State | None
    error: str | None


@dataclass(frozen=True)
class Applied:
    """What applying a round's result gave: the method's ``apply`` facts, and why it was
    refused (None: applied, or nothing to apply)."""

    facts: dict[str, Any]
    error: str | None


class Member(RotationRole):
    """One node's steps as a member of each round. ``role`` keeps its uploads (and serves
    them); ``lineage`` is the model lineage it follows; ``late`` its late offers."""

    def __init__(
        self, services: NodeServices, role: AggregatorRole, lineage: Lineage, late: LateOffers
    ) -> None:
        super().__init__(services)
        self.role = role
        self.lineage = lineage
        self.late = late

    async def train(self, plan: RoundPlan, lr: float) -> tuple[TrainOutcome, dict[str, Any]]:
        """Train for ``plan``'s round, keep the upload for the aggregators' pulls and return
        the training's outcome and this node's report (``{n, report, lineage}``)."""
        svc, r = self.services, plan.round
        svc.ledger.publish_status(r, "training")
        trained = await svc.training.train(r)
        self.role.keep_upload(r, await asyncio.to_thread(self.alg.upload))
        n = svc.exchange.claimed_samples(len(svc.data.train_y), r)
        own = {
            "n": n,
            "report": self.alg.report(trained.result, lr),
            "lineage": self.lineage.name,
        }
        return trained, own

    async def report(
        self, aggregator: str, round_no: int, attempt: int, own: dict[str, Any] | None
    ) -> None:
        """Report to ``aggregator`` for ``(round_no, attempt)``: this node's report when it
        trained, and its late offer to the round again at a later attempt (attempt 0 had it
        when it was made). A send that fails is logged: the attempt's deadline decides."""
        if own is not None:
            try:
                await self.services.exchange.send(
                    aggregator, "report", round_no, own, attempt=attempt
                )
            except TransportError as exc:
                log.warning(
                    "%s: round %d: report to %s failed: %s", self.id, round_no, aggregator, exc
                )
        if attempt > 0 and round_no in self.late.offers:
            await self.late.send(aggregator, round_no, self.late.offers[round_no], attempt)

    async def offer_late(
        self, trained: int, body: dict[str, Any], own: dict[str, Any]
    ) -> LateOffer | None:
        """The round ``trained`` closed without this node (``body``: its announcement):
        offer the upload on (:meth:`LateOffers.offer`), served and counted by this node's
        role as part ``late``; None when it goes nowhere."""
        offer = self.late.offer(trained, body, own)
        if offer is None:
            return None
        self.role.offer_late(offer.round, trained, offer.report)
        if offer.aggregator != self.id:
            await self.late.send(offer.aggregator, offer.round, offer.report, 0)
        log.info(
            "%s: round %d's upload was late: offered to round %d", self.id, trained, offer.round
        )
        return offer

    async def pull_result(self, aggregator: str, round_no: int, attempt: int) -> Pulled:
        """Pull what ``aggregator``'s result of ``(round_no, attempt)`` gives this node; the
        aggregator is a peer: its result passes admission like any state (finite, norm
        bound; the method's apply checks the layout), or the round fails over."""
        try:
            # decoded when compressed: docs/wire.md, "Compression"
            state = await self.services.exchange.pull(
                aggregator,
                round_no,
                "result",
                max(1.0, self.cfg.timing.round_timeout_s),
                attempt=attempt,
            )
        except TransportError as exc:
            return Pulled(None, str(exc))
        self.services.ledger.publish_status(
            round_no, pull=(aggregator, "result", self.services.exchange.size_of(state))
        )
        why = self.services.robust.admit(state, self.alg.model_state(), layout=False)
        if why is not None:
            self.services.robust.reject(aggregator, f"result: {why}", round_no)
            return Pulled(None, f"result refused: {why}")
        return Pulled(state, None)

    async def apply(
        self,
        round_no: int,
        aggregator: str | None,
        received: State | None,
        announcement: dict[str, Any] | None,
    ) -> Applied:
        """Apply ``received`` (nothing when None) from ``aggregator``'s ``announcement`` of
        ``round_no``, and follow the announcement's lineage unless the result was refused.
        The aggregator's bytes are untrusted: a result the method's ``apply`` refuses is
        dropped (``bad_result``) and the model restored."""
        svc, alg = self.services, self.alg
        facts: dict[str, Any] = {}
        error: str | None = None
        if received is not None:
            before = alg.checkpoint()
            try:
                facts = await asyncio.to_thread(alg.apply, received, announcement)
            except (ValueError, RuntimeError) as exc:
                alg.restore(before)
                svc.ledger.drop("bad_result", f"round {round_no} from {aggregator}: {exc}")
                error = str(exc)
            else:
                body = announcement or {}
                svc.training.merged(sorted({aggregator, *body.get("aggregated", [])}))
        if announcement is not None and error is None:
            self.lineage.adopt(announcement)  # its model is the one now held
        return Applied(facts, error)
