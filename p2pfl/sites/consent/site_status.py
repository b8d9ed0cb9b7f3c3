"""A site's status of a run, as it tells the federation (docs/design.md, "The site daemon"):
the body of its signed, retained ``status`` message, made here and checked here when a
peer's comes in. Pure: no broker, no ledger.

The body: ``{"status": str, "why": str, "round": int, "metrics": {name: float}}``:

- ``status``: the run's status at that site (the ledger's statuses, and ``pending`` for a
  committed run that waits for a slot);
- ``why``: why it is there (``finished``: "5 rounds"; a site that left: "drained after round
  3"), at most :data:`MAX_WHY` characters;
- ``round``: the last round its node finished;
- ``metrics``: what its node measured on its own test data in that round (the record's
  ``test_*`` fields: ``test_acc``, ``test_loss``, ``test_c_index``…), at most
  :data:`MAX_METRICS` finite numbers.

A peer's status is information, never a decision: it changes no vote, commit or worker. A
body that breaks this shape is refused whole (:class:`ValueError`: the daemon drops and
counts it)."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from p2pfl.sites.consent.ledger import STATUSES

SHOWN_STATUSES = (*STATUSES, "pending")
"""What a site may say of a run: its ledger's statuses and ``pending`` (waiting for a slot)."""
MAX_WHY = 500
MAX_METRICS = 32
MAX_ROUND = 1_000_000
METRIC_NAME = re.compile(r"^test_[a-z0-9_]{1,60}$")
"""A record's evaluation field: what a status carries of a round's record."""


def round_metrics(record: Mapping[str, Any]) -> dict[str, float]:
    """The evaluation of a node's round record: its ``test_*`` fields that are finite
    numbers (the first :data:`MAX_METRICS` by name)."""
    found = {
        k: float(v)
        for k, v in record.items()
        if isinstance(k, str)
        and METRIC_NAME.match(k)
        and isinstance(v, (int, float))
        and not isinstance(v, bool)
        and math.isfinite(v)
    }
    return dict(sorted(found.items())[:MAX_METRICS])


def status_body(status: str, why: str, round_no: int, metrics: Mapping[str, float]) -> dict:
    """This site's status message body (``why`` cut to :data:`MAX_WHY` characters)."""
    return {
        "status": status,
        "why": why[:MAX_WHY],
        "round": int(round_no),
        "metrics": dict(metrics),
    }


def read_status(body: Any) -> dict[str, Any]:
    """A peer's status body, checked: the same dict, or :class:`ValueError` naming the field
    that breaks the shape."""
    if not isinstance(body, Mapping) or set(body) != {"status", "why", "round", "metrics"}:
        raise ValueError("a status body holds status, why, round and metrics, nothing else")
    status, why, round_no, metrics = body["status"], body["why"], body["round"], body["metrics"]
    if status not in SHOWN_STATUSES:
        raise ValueError(f"status: {status!r} is not a run status")
    if not isinstance(why, str) or len(why) > MAX_WHY:
        raise ValueError(f"why: a text of at most {MAX_WHY} characters")
    if isinstance(round_no, bool) or not isinstance(round_no, int):
        raise ValueError(f"round: {round_no!r} is not a round number")
    if not 0 <= round_no <= MAX_ROUND:
        raise ValueError(f"round: {round_no} is out of range")
    if not isinstance(metrics, Mapping) or len(metrics) > MAX_METRICS:
        raise ValueError(f"metrics: a map of at most {MAX_METRICS} numbers")
    for name, value in metrics.items():
        if not isinstance(name, str) or not METRIC_NAME.match(name):
            raise ValueError(f"metrics: {name!r} is not a test_* metric name")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"metrics.{name}: {value!r} is not a number")
        if not math.isfinite(value):
            raise ValueError(f"metrics.{name}: not finite")
    return {
        "status": status,
        "why": why,
        "round": round_no,
        "metrics": {k: float(v) for k, v in metrics.items()},
    }
