"""The ledger port: what a node says of its rounds.

- **meter**: the time, transport bytes and broker outage of a round (:class:`RoundMeter`);
- **round record**: the fields every driver shares, filled in one place
  (:meth:`Ledger.round_record`), the driver's own beside them and the method's facts under
  its ``method`` key (docs/architecture.md, "Round records"), then written with the node's
  checkpoint (:meth:`Ledger.finish_round`; docs/architecture.md, "Checkpoints and resume");
- **status**: the round a node finished, in its presence (:meth:`Ledger.report_round`), and
  live telemetry for observers (:meth:`Ledger.publish_status`; docs/wire.md, "Status
  telemetry"), fire and forget;
- **drop counts**: every dropped message counted by reason (:meth:`Ledger.drop`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from p2pfl.algorithms.base import Method
from p2pfl.background import TaskSet, stop_if_cancelled
from p2pfl.config.schema import TopologyConfig
from p2pfl.metrics import METHOD_KEY, RecordLog, node_log_path
from p2pfl.services.checkpoint import Checkpoint, checkpoint_path, save_checkpoint
from p2pfl.services.robust import Robustness
from p2pfl.services.training import TrainOutcome
from p2pfl.wire.status import phase_body, pull_body
from p2pfl.wire.transport import Transport, TransportError

if TYPE_CHECKING:  # Opacus is imported only by a node that trains under privacy.dp
    from p2pfl.services.optimizer_state import KeptOptimizer
    from p2pfl.services.privacy import NodePrivacy
    from p2pfl.services.update_privacy import NodeUpdatePrivacy

log = logging.getLogger(__name__)

# a round record (docs/architecture.md, "Round records"): the fields every driver fills
# alike through Ledger.round_record, a driver's own beside them, and everything the method
# returned under METHOD_KEY (p2pfl.metrics), where no fact of a method can replace a
# driver's field
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


class Ledger:
    """Node ``node_id``'s rounds as it tells them: records (kept in ``records`` and, with
    ``out_dir``, appended to ``nodes/<id>.jsonl`` with a checkpoint after each), presence,
    telemetry and drop counts. ``resumed_round``: the round of the checkpoint the node
    resumed from (0: none)."""

    def __init__(
        self,
        *,
        cfg: TopologyConfig,
        node_id: str,
        transport: Transport,
        robust: Robustness,
        method: Method,
        rng: np.random.Generator,
        out_dir: Path | None = None,
        records: list[dict[str, Any]] | None = None,
        privacy: NodePrivacy | NodeUpdatePrivacy | None = None,
        resumed_round: int = 0,
        optimizer: KeptOptimizer | None = None,
    ):
        self.cfg = cfg
        self.id = node_id
        self._optimizer = optimizer
        self._transport = transport
        self._robust = robust
        self._method = method
        self._rng = rng
        self._privacy = privacy
        self.out_dir = out_dir
        self.records: list[dict[str, Any]] = records if records is not None else []
        self.record_log = RecordLog(node_log_path(out_dir, node_id)) if out_dir else None
        self.resumed_round = resumed_round
        self._meter: RoundMeter | None = None  # the latest round's
        self._offline_mark = 0.0  # broker outage seconds already in a record
        # status publishes in flight: fire and forget, a failure logged at debug level
        self._status_tasks = TaskSet(
            lambda exc: log.debug("%s: status not published: %r", node_id, exc)
        )

    # ------------------------------------------------------------------ drop counts
    def drop(self, reason: str, detail: Any = "") -> None:
        """Count a dropped (malformed, stale, misdirected) message and log it, rate-limited."""
        self._transport.drop(reason, detail)

    def count(self, reason: str) -> None:
        """Count a dropped message without logging it (an expected, frequent drop)."""
        self._transport.dropped[reason] += 1

    def dropped_total(self) -> int:
        """Messages dropped so far, for every reason."""
        return sum(self._transport.dropped.values())

    # ------------------------------------------------------------------ status
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
            self._status_tasks.spawn(self._transport.publish_status(round_no, body))
        except Exception as exc:  # telemetry must never break a round
            log.debug("%s: status not published: %r", self.id, exc)

    async def aclose(self) -> None:
        """Stop the status publishes still in flight (the node is leaving)."""
        await self._status_tasks.aclose()

    async def report_round(self, round_no: int, *, joined: int | None = None) -> None:
        """Tell peers (presence) that this node finished ``round_no`` (or skipped to the
        round after it), and, with ``joined``, the first round it runs since it (re)joined.
        The last round is not reported here: the node's ``done`` presence, which follows at
        once, says it (one presence delivered to every listener instead of two)."""
        if joined is None and round_no >= self.cfg.rounds:
            return
        info: dict[str, Any] = {"round": round_no}
        if joined is not None:
            info["joined"] = joined
        try:
            await self._transport.set_status("online", **info)
        except TransportError as exc:
            log.warning("%s: could not update presence: %s", self.id, exc)

    # ------------------------------------------------------------------ records
    def meter(self) -> RoundMeter:
        """Start measuring a round (time, transport bytes, broker outage since the last
        round's record)."""
        if self._meter is not None and self._meter.offline_read is not None:
            self._offline_mark = self._meter.offline_read
        self._meter = RoundMeter(self._transport, self._offline_mark)
        return self._meter

    def round_record(
        self,
        round_no: int,
        *,
        meter: RoundMeter,
        evaluated: tuple[float, float] | tuple[float, float, Mapping[str, float] | None],
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
        (``evaluated``: accuracy, loss, and the task's other metrics, each its own
        ``test_<name>`` field after ``test_loss``; NaN is recorded as None), ``train_loss``, ``train_ce`` and ``train_s`` (``trained``; None,
        None and 0 for a node that did not train), ``comm_s``, the ``meter``'s fields,
        ``lr``, ``peers``, ``dropout``, the round's robustness facts
        (:meth:`~p2pfl.services.robust.Robustness.facts`: ``rejected``, ``capped``,
        ``distrusted``, and ``attack`` on an attacker), ``diverged`` (``trained``'s
        rollback, else None), ``dropped_total`` and ``t``. ``driver``: the driver's own
        fields (none of them may be one of the shared ones).

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
        acc, test_loss, *more = evaluated
        task_scores = more[0] if more else None  # None: the default task's accuracy and loss
        scores = {k: _finite_or_none(v) for k, v in (task_scores or {}).items()}
        record = {
            "round": round_no,
            "test_acc": acc if task_scores is None else _finite_or_none(acc),
            "test_loss": test_loss,
            **scores,
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
            **self._robust.facts(round_no, method_rejected),
            "diverged": trained.diverged if trained is not None else None,
            "dropped_total": self.dropped_total(),
            "t": time.time(),
        }
        if self._privacy is None:
            return record
        # privacy.dp: ε so far, before ``t``; a round without steps has no training loss
        stepped = result is not None and result.steps > 0
        if result is not None and not stepped:
            record["train_loss"] = record["train_ce"] = None
        t = record.pop("t")
        record.update(self._privacy.record_fields(stepped))
        record["t"] = t
        return record

    async def finish_round(self, record: dict[str, Any], summary: str) -> None:
        """Keep the round's record, append it to the node's log in the run directory (whole
        or not at all; kept in memory and retried when the disk is full), log a one-line
        ``summary`` and write the node's checkpoint (:mod:`p2pfl.services.checkpoint`; a disk
        that refuses it is logged, and the previous checkpoint stays). A node told to stop
        (its rounds' task cancelled, e.g. by SIGTERM) whose cancellation an await absorbed
        stops here, once the round is kept (:func:`~p2pfl.background.stop_if_cancelled`):
        a drained site's worker otherwise trained on to its last round."""
        self.records.append(record)
        if self.record_log is not None:
            self.record_log.append(record)
        acc = record["test_acc"]
        shown = f"acc {acc:.4f}" if isinstance(acc, float) else f"loss {record['test_loss']:.4g}"
        log.info("%s: round %d %s %s", self.id, record["round"], shown, summary)
        if self.out_dir is not None:
            await asyncio.to_thread(self.save_checkpoint, record["round"])
        stop_if_cancelled()

    def save_checkpoint(self, round_no: int) -> None:
        """Write the node's checkpoint of ``round_no`` (blocking); a disk that refuses is
        logged and the previous checkpoint stays."""
        ckpt = Checkpoint.take(self.cfg, self.id, round_no, self._method, self._rng)
        if self._privacy is not None:
            ckpt.privacy = self._privacy.state()
        if self._optimizer is not None:
            ckpt.optimizer = self._optimizer.state()
        try:
            assert self.out_dir is not None
            save_checkpoint(checkpoint_path(self.out_dir, self.id), ckpt)
        except OSError as exc:
            log.warning("%s: round %d: checkpoint not written: %s", self.id, round_no, exc)


def _finite_or_none(value: float) -> float | None:
    """A metric as a record holds it: None where the test split could not define it."""
    return None if value is None or not math.isfinite(value) else float(value)
