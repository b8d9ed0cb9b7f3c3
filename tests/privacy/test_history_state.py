"""The accountants' shared checkpoint parser (p2pfl/privacy/history_state.py)."""

from __future__ import annotations

import pytest

from p2pfl.privacy.history_state import parse_history

FIELDS = ("sigma", "q", "steps")


def test_a_well_formed_state_round_trips_as_tuples() -> None:
    state = {"mechanism": "rdp", "history": [[1.1, 0.2, 6], (0.9, 1, 3)]}
    assert parse_history(state, "n0", FIELDS, ("steps",)) == (
        "rdp",
        [(1.1, 0.2, 6), (0.9, 1, 3)],
    )


@pytest.mark.parametrize(
    ("state", "needle"),
    [
        ([], "expected a map"),
        ({"mechanism": "rdp"}, "expected a map"),
        ({"mechanism": "rdp", "history": [], "x": 1}, "expected a map"),
        ({"mechanism": "rdp", "history": "[]"}, "history is not a list"),
        ({"mechanism": "rdp", "history": [[1.0, 0.2]]}, "history[0] is not [sigma, q, steps]"),
        ({"mechanism": "rdp", "history": [[1.0, 0.2, 6.0]]}, "history[0]"),
        ({"mechanism": "rdp", "history": [[1.0, 0.2, True]]}, "history[0]"),
        ({"mechanism": "rdp", "history": [[1.0, 0.2, 6], [False, 0.2, 6]]}, "history[1]"),
        ({"mechanism": "rdp", "history": [[1.0, "0.2", 6]]}, "history[0]"),
    ],
)
def test_a_malformed_state_names_where_and_the_entry(state: object, needle: str) -> None:
    with pytest.raises(ValueError) as err:
        parse_history(state, "checkpoint n3", FIELDS, ("steps",))
    assert str(err.value).startswith("checkpoint n3: ")
    assert needle in str(err.value)
