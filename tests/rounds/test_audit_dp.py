"""The DP noise allowance in an audited round: the announcement's ``noise_spread`` is
checked as untrusted input (p2pfl/rounds/rotation/plans.py), an auditor bounds it by its own
(p2pfl/rounds/rotation/audit.py::spread_problem), and the recomputation measures with it."""

from __future__ import annotations

import math

import pytest

from p2pfl.rounds.rotation.audit import SPREAD_TOLERANCE, spread_problem
from p2pfl.rounds.rotation.plans import check_announcement

MEMBERS = {"a", "b", "c"}
OK = {"roster": ["a", "b", "c"], "participants": ["a", "b", "c"], "server": {}}


def test_the_announced_spread_travels_when_valid_and_is_absent_otherwise():
    assert "noise_spread" not in check_announcement(OK, MEMBERS)
    assert check_announcement({**OK, "noise_spread": 3}, MEMBERS)["noise_spread"] == 3.0


@pytest.mark.parametrize("bad", [-0.1, math.inf, math.nan, "0.1", True, None, [0.1]])
def test_a_malformed_spread_makes_the_announcement_malformed(bad):
    with pytest.raises(ValueError, match="noise_spread"):
        check_announcement({**OK, "noise_spread": bad}, MEMBERS)


def test_the_auditor_accepts_spreads_an_honest_aggregator_could_use():
    own = 0.02
    assert spread_problem(None, 0.0) is None  # no DP anywhere
    assert spread_problem(None, own) is None  # clip not widened: only stricter
    for value in (0.0, own / 3, own, SPREAD_TOLERANCE * own):
        assert spread_problem(value, own) is None, value


@pytest.mark.parametrize(
    ("value", "own", "needle"),
    [
        (0.0801, 0.02, "outside [0, 4 x this node's 0.02]"),
        (0.01, 0.0, "outside"),  # DP allowance in a swarm this node sees without DP
        (-1.0, 0.02, "outside"),
        (math.inf, 0.02, "not a finite number"),
        ("x", 0.02, "not a finite number"),
    ],
)
def test_the_auditor_refuses_a_spread_that_widens_clip_at_will(value, own, needle):
    why = spread_problem(value, own)
    assert why is not None and needle in why
