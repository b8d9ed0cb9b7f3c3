"""CriticalFL: FedAvg whose participant count follows the critical learning periods.

Implements docs/algorithms.md, "CriticalFL" (UA-PDFL's
communication-efficiency baseline; KDD 2023):

- each participant reports ``gradnorm = lr · (Σ over all local steps of ‖grad‖²) / epochs``,
  i.e. ``lr ·`` the mean over local epochs of ``Σ_steps ‖g‖²``;
- the aggregator appends the (unweighted) mean ``gradnorm`` of the uploads that arrived to a
  history and compares the windowed mean of the last ``window`` values with the windowed mean
  one step earlier; the round is critical when it rose by more than ``delta`` relative, and
  during the first ``initial_detections`` aggregations;
- critical: double the participants, capped at ``max(k0, ⌊max_fraction · K⌋)``; otherwise
  halve, never below the starting count ``k0 = max(1, round(initial_fraction · K))``;
- the model update itself is FedAvg over the uploads (the shared weighted mean,
  docs/algorithms.md, "Shared aggregation").

**Reading** (epochs): :class:`~p2pfl.learning.train.TrainResult` carries ``Σ_steps ‖g‖²``
over all epochs but not the epoch count, so the driver sets :attr:`CriticalFL.local_epochs` to the
swarm's epochs a round (:func:`~p2pfl.learning.train.round_epochs`) after constructing the method.

**Reading** (halving): the halved count is ``max(⌈k/2⌉, k0)`` (rounded up, so 3 → 2, not 1).

**Reading** (rounding of ``k0``): ``round`` is half-up (``⌊x + ½⌋``), not Python's banker's
rounding.

**Reading** (windows at the start): while the history is shorter than ``window + 1`` both
windowed means use the values there are (``mean(h[-window:])`` vs ``mean(h[-window-1:-1])``);
a history of fewer than two values counts as critical (nothing to compare, start of
training); a previous mean of 0 counts any rise as critical.

**Reading** (who pulls the result): a node pulls the round's global model only if it trained
this round, trains next round, or this is the last round; a node that does neither keeps its
stale model (and is evaluated on it) until it is next drawn, which is the communication this
method saves.

**Reading** (history length): the server state keeps the last
``max(window + 1, initial_detections + 1)`` values, so both the window comparison and "the
first ``initial_detections`` aggregations" can be told from the history alone.

The server state ``{"k0", "k", "K", "history"}`` (plain ints, floats, a list) comes from a
peer: it is validated defensively and, if malformed, re-derived from the roster.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from pydantic import BaseModel

from p2pfl.algorithms.base import (
    Aggregate,
    AlgorithmContext,
    Method,
    Upload,
    register,
)
from p2pfl.algorithms.cards.criticalfl import CARD
from p2pfl.algorithms.fedavg import FedAvg

_MAX_COUNT = 1_000_000  # sanity bound on counts read from a peer's server state


# ----------------------------------------------------------------------------- pure rules


def round_half_up(x: float) -> int:
    return int(math.floor(x + 0.5))


def initial_count(initial_fraction: float, K: int) -> int:
    """``k0 = max(1, round(initial_fraction · K))`` (half-up)."""
    return max(1, round_half_up(initial_fraction * K))


def count_cap(k0: int, max_fraction: float, K: int) -> int:
    """``max(k0, ⌊max_fraction · K⌋)``."""
    return max(k0, int(math.floor(max_fraction * K)))


def is_critical(history: list[float], window: int, delta: float, initial_detections: int) -> bool:
    """Whether the latest round (last value of ``history``) is critical.

    True while ``len(history) <= initial_detections`` or when there is no earlier value;
    otherwise compares ``cur = mean(history[-window:])`` with ``prev =
    mean(history[-window-1:-1])`` and is True when ``cur - prev > delta · prev`` (with
    ``prev = 0``: any rise)."""
    if len(history) <= initial_detections or len(history) < 2:
        return True
    window = max(1, int(window))
    cur_w = history[-window:]
    prev_w = history[-window - 1 : -1]
    cur = sum(x / len(cur_w) for x in cur_w)
    prev = sum(x / len(prev_w) for x in prev_w)
    if prev <= 0:
        return cur > prev
    return (cur - prev) / prev > delta


def next_count(k: int, k0: int, critical: bool, cap: int) -> int:
    """Critical: ``min(2k, cap)``; otherwise ``max(⌈k/2⌉, k0)``; never below 1."""
    if critical:
        return max(1, min(2 * k, cap))
    return max(1, (k + 1) // 2, k0)


def choose_participants(roster: list[str], count: int, rng: np.random.Generator) -> list[str]:
    """``count`` members drawn without replacement from the sorted roster, sorted. Everyone
    (without drawing) when ``count >= len(roster)``; nobody when ``count <= 0``."""
    pool = sorted(roster)
    if count <= 0 or not pool:
        return []
    if count >= len(pool):
        return pool
    picks = rng.choice(len(pool), size=count, replace=False)
    return sorted(pool[int(i)] for i in picks)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_gradnorm(v: Any) -> bool:
    """A finite non-negative int or float (not a bool)."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return False
    try:
        f = float(v)
    except OverflowError:  # an int too large for a float
        return False
    return math.isfinite(f) and f >= 0


# ----------------------------------------------------------------------------- the method


@register
class CriticalFL(FedAvg):
    name = CARD.name
    shares = CARD.shares
    Params = CARD.Params
    upload_part = "all"
    # its knobs have no server optimizer: it keeps nothing beyond the model
    extra_state = Method.extra_state
    load_extra_state = Method.load_extra_state

    def __init__(self, params: dict[str, Any], ctx: AlgorithmContext):
        super().__init__(params, ctx)
        # set by the driver to the epochs a round (see the module docstring)
        self.local_epochs: int = 1

    @classmethod
    def update_dp_problem(cls, params: BaseModel) -> tuple[str, str] | None:
        """Its report is computed from the raw local gradients, outside the update's
        noise."""
        why = (
            "criticalfl reports lr·Σ‖g‖² of its raw local training with every upload, in "
            "the clear, which update-level noise does not cover; use level: sample (its "
            "gradients are noised) or another method"
        )
        return ("privacy.dp.level", why)

    # -- client side ---------------------------------------------------------------------
    def report(self, result: Any, lr: float) -> dict[str, Any]:
        """``gradnorm = lr · grad_sq_sum / local_epochs``. A diverged run reports a non-finite
        value, which :meth:`check_report` rejects, so its upload is left out."""
        epochs = max(1, int(self.local_epochs))
        return {"gradnorm": float(lr) * float(result.grad_sq_sum) / epochs}

    @classmethod
    def check_report(cls, report: Any) -> dict[str, Any]:
        """A map with ``gradnorm``: a finite non-negative number (not a bool)."""
        if not isinstance(report, dict):
            raise ValueError("report must be a map")
        g = report.get("gradnorm")
        if not _is_gradnorm(g):
            raise ValueError("report.gradnorm must be a finite non-negative number")
        return {"gradnorm": float(g)}

    def needs_result(self, participated: bool, participates_next: bool, last_round: bool) -> bool:
        """Only nodes that trained this round, train next round, or finish now pull it."""
        return participated or participates_next or last_round

    # -- server side (pure) --------------------------------------------------------------
    def _history_len(self) -> int:
        p = self.params
        return max(p.window + 1, p.initial_detections + 1)

    def initial_server_state(self, roster: list[str]) -> dict[str, Any]:
        K = len(roster)
        k0 = initial_count(self.params.initial_fraction, K)
        return {"k0": k0, "k": k0, "K": K, "history": []}

    def _checked_state(self, server: Any, roster: list[str]) -> tuple[dict[str, Any], bool]:
        """``(state, ok)``: a clean copy of a peer's server state, or the state re-derived
        from ``roster`` (``ok`` False) when it is malformed."""
        try:
            k0, k, K, hist = server["k0"], server["k"], server["K"], server["history"]
            ok = (
                all(_is_int(v) for v in (k0, k, K))
                and 1 <= k0 <= _MAX_COUNT
                and 1 <= k <= _MAX_COUNT
                and 0 <= K <= _MAX_COUNT
                and isinstance(hist, (list, tuple))
                and all(_is_gradnorm(v) for v in hist)
            )
        except (KeyError, TypeError, IndexError):
            ok = False
        if not ok:
            return self.initial_server_state(roster), False
        hist = [float(v) for v in hist][-self._history_len() :]
        return {"k0": k0, "k": k, "K": K, "history": hist}, True

    def participants(
        self, server: dict[str, Any], roster: list[str], round_no: int, rng: np.random.Generator
    ) -> list[str]:
        """``min(k, |roster|)`` members drawn by ``rng`` from the sorted roster."""
        state, _ = self._checked_state(server, roster)
        return choose_participants(roster, min(state["k"], len(roster)), rng)

    def aggregate(
        self,
        uploads: dict[str, Upload],
        server: dict[str, Any],
        roster: list[str],
        round_no: int,
    ) -> Aggregate:
        """FedAvg over the uploads with a valid report (all of them if none has one), then
        the next participant count from their mean gradnorm. With no valid report at all the
        history and the count stay as they were. A malformed server state is re-derived from
        ``roster`` (fact ``server_state_reset``)."""
        state, state_ok = self._checked_state(server, roster)
        p = self.params
        valid = {
            peer: u
            for peer, u in uploads.items()
            if isinstance(u.report, dict) and _is_gradnorm(u.report.get("gradnorm"))
        }
        agg = super().aggregate(valid or uploads, server, roster, round_no)
        agg.results = dict.fromkeys(uploads, agg.common)
        norms = [float(valid[peer].report["gradnorm"]) for peer in sorted(valid)]
        k0, k, K = state["k0"], state["k"], state["K"]
        history = list(state["history"])
        facts: dict[str, Any] = dict(agg.facts)
        if not state_ok:
            facts["server_state_reset"] = True
        if norms:
            mean = sum(x / len(norms) for x in norms)  # no overflow on huge values
            history.append(mean)
            history = history[-self._history_len() :]
            critical = is_critical(history, p.window, p.delta, p.initial_detections)
            k_next = next_count(k, k0, critical, count_cap(k0, p.max_fraction, K))
            facts.update({"critical": critical, "k_next": k_next, "gradnorm_mean": mean})
        else:
            k_next = k
            facts.update({"critical": False, "k_next": k_next, "gradnorm_mean": None})
        agg.server = {"k0": k0, "k": k_next, "K": K, "history": history}
        agg.facts = facts
        return agg
