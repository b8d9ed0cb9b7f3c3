"""The next roster by difference (docs/wire.md, "Roster by difference"): the pure rules
(:mod:`p2pfl.rounds.rotation.roster`) and the driver's side on its handlers (a real,
unconnected transport and a real FedAvg): a member holding the base rebuilds the roster, one
lacking it asks the aggregator for it whole, and a forged answer is refused."""

from __future__ import annotations

import asyncio

import pytest
from test_partition_driver import _driver, _env

from p2pfl.rounds.rotation.roster import (
    MissingBase,
    by_difference,
    on_the_wire,
    resolve,
    roster_digest,
)
from p2pfl.wire.codec import encode

MEMBERS = {f"n{i}" for i in range(1000)}


def test_a_thousand_member_roster_travels_as_its_change():
    base = sorted(MEMBERS)
    nxt = sorted(MEMBERS - {"n7", "n99"})
    wire = by_difference(base, nxt)
    assert wire["roster_add"] == [] and wire["roster_drop"] == ["n7", "n99"]
    assert len(encode(wire)) < 150 < 4000 < len(encode({"roster": nxt}))
    assert resolve(wire, base, MEMBERS)["roster"] == nxt
    assert roster_digest(reversed(nxt)) == wire["roster_digest"]  # order does not matter


def test_a_roster_that_changed_more_than_it_stayed_travels_whole():
    assert by_difference(["a", "b", "c"], ["d"]) == {"roster": ["d"]}
    ann = {"roster": ["d"], "participants": ["d"]}
    assert on_the_wire(ann, None, MEMBERS) is ann  # no base: whole


def test_a_member_without_the_base_gets_missing_base():
    wire = by_difference(["a", "b", "c", "d"], ["a", "b", "c"])
    with pytest.raises(MissingBase):
        resolve(wire, None, {"a", "b", "c", "d"})
    with pytest.raises(MissingBase):
        resolve(wire, ["a", "b"], {"a", "b", "c", "d"})  # another roster than the one named


@pytest.mark.parametrize(
    "change, error",
    [
        ({"roster_add": ["zz"]}, "unknown"),
        ({"roster_add": "a"}, "list of node ids"),
        ({"roster_digest": "ab"}, "digest"),
        ({"roster_digest": "0" * 32}, "does not give its digest"),
        ({"roster_base": None}, "digest"),
        ({"roster_drop": [1]}, "list of node ids"),
    ],
)
def test_a_malformed_change_is_refused(change, error):
    members = {"a", "b", "c", "d"}
    wire = by_difference(["a", "b", "c", "d"], ["a", "b", "c"])
    with pytest.raises(ValueError, match=error):
        resolve({**wire, **change}, ["a", "b", "c", "d"], members)
    partial = {k: v for k, v in wire.items() if k != "roster_add"}
    with pytest.raises(ValueError, match="needs"):
        resolve(partial, ["a", "b", "c", "d"], members)


BASE = ["a", "b", "c"]
NEXT = ["a", "b"]
ANN = {"participants": ["a", "b"], "server": {}, **by_difference(BASE, NEXT)}


def test_a_member_that_holds_the_base_rebuilds_the_roster():
    d = _driver("b")
    d.rosters[3] = BASE  # attempt 0 of round 3 → its aggregator
    d.current, d.applied = (3, 0), 2
    agg = d.rotation.aggregator(3, 0)
    d.on_gossip(_env(agg, "announce", 3, 0, ANN))
    assert d.rotation.announced[3][0].body["roster"] == NEXT


async def test_a_member_without_the_base_asks_for_the_roster_whole():
    d = _driver("b")
    sent = []

    async def send(to, kind, round_no, body, attempt=0):
        sent.append((to, kind, round_no, attempt, body))

    d.services.exchange.transport.send = send
    d.current, d.applied = (3, 0), 2  # it does not know round 3's roster (an observer)
    d.on_gossip(_env("c", "announce", 3, 1, ANN))
    await asyncio.sleep(0.01)
    assert 3 not in d.rotation.announced and sent == [("c", "roster_req", 3, 1, {})]
    # a forged answer (another roster, or from another peer) is refused
    d.on_inbox(_env("c", "roster", 3, 1, {"roster": ["a", "c"]}))
    d.on_inbox(_env("a", "roster", 3, 1, {"roster": NEXT}))
    dropped = d.services.exchange.transport.dropped
    assert dropped["malformed"] == 1 and dropped["unexpected_roster"] == 1
    assert 3 not in d.rotation.announced
    d.on_inbox(_env("c", "roster", 3, 1, {"roster": NEXT}, mid="ok"))
    assert d.rotation.announced[3][1].body["roster"] == NEXT
    await d.rosters_asked.tasks.aclose()


async def test_an_aggregator_answers_a_roster_request_once():
    d = _driver("b")
    sent = []

    async def send(to, kind, round_no, body, attempt=0):
        sent.append((to, kind, round_no, attempt, body))

    d.services.exchange.transport.send = send
    d.rosters[3] = BASE
    d.current, d.applied = (3, 0), 2
    d.role._announcements[(3, 0)] = {**ANN, "roster": NEXT}
    d.on_inbox(_env("a", "roster_req", 3, 0, {}))
    d.on_inbox(_env("a", "roster_req", 3, 0, {}, mid="again"))  # answered already
    d.on_inbox(_env("c", "roster_req", 3, 2, {}))  # no such announcement
    await asyncio.sleep(0.01)
    assert sent == [("a", "roster", 3, 0, {"roster": NEXT})]
    await d.rosters_asked.tasks.aclose()


def test_an_announcement_on_the_wire_gives_back_the_whole_one():
    """What a member derives itself (participants, aggregated, empty reports) is left out
    on the wire, and the check gives the very announcement the aggregator kept."""
    d = _driver("b")
    d.rosters[3] = BASE
    whole = {
        "roster": NEXT,
        "participants": NEXT,  # FedAvg at fraction 1: the whole roster, as draw_plan gives
        "server": {},
        "receivers": ["a", "c"],
        "common": True,
        "aggregated": ["a", "c"],
        "claims": {"a": 5, "c": 7},
        "reports": {"a": {}, "c": {"loss": 0.5}},
        "lineage": "0",
    }
    wire = on_the_wire(whole, BASE, d.services.cfg.node_ids)
    assert not {"roster", "participants", "aggregated", "claims", "receivers"} & set(wire)
    assert wire["reports"] == {"c": {"loss": 0.5}}
    assert d.rotation.check(3, wire) == d.rotation.check(3, whole)


def _thousand_member_announcement() -> dict:
    ids = sorted(MEMBERS)
    drawn = ids[::10]  # fraction 0.1
    return {
        "roster": ids,
        "participants": drawn,
        "server": {},
        "receivers": drawn,  # FedAvg: each uploader gets a result
        "common": True,
        "aggregated": drawn,
        "claims": {p: 60 + i for i, p in enumerate(drawn)},
        "reports": {p: {} for p in drawn},
        "lineage": "0",
    }


def test_a_thousand_member_announcement_is_under_500_bytes():
    whole = _thousand_member_announcement()
    ids = whole["roster"]
    wire = on_the_wire(whole, ids, MEMBERS)
    assert len(encode(whole)) > 7000
    assert len(encode(wire)) < 500
    back = resolve(wire, ids, MEMBERS)
    assert back["claims"] == whole["claims"] and back["receivers"] == whole["receivers"]
    assert back["aggregated"] == whole["aggregated"] and back["reports"] == whole["reports"]


def test_receivers_other_than_the_aggregated_travel_as_they_are():
    whole = {**_thousand_member_announcement(), "receivers": []}
    ids = whole["roster"]
    wire = on_the_wire(whole, ids, MEMBERS)
    assert wire["receivers"] == [] and resolve(wire, ids, MEMBERS)["receivers"] == []


@pytest.mark.parametrize(
    "change, error",
    [
        ({"claims_of": b"\x01"}, "bitmap of 125 bytes"),
        ({"claims_of": "1" * 125}, "bitmap of 125 bytes"),
        ({"claims_n": [1, 2]}, "one count per member"),
        ({"claims_n": None}, "one count per member"),
        ({"claims": {"n0": 3}}, "exclusive"),
    ],
)
def test_malformed_compact_claims_are_refused(change, error):
    whole = _thousand_member_announcement()
    ids = whole["roster"]
    wire = {**on_the_wire(whole, ids, MEMBERS), **change}
    with pytest.raises(ValueError, match=error):
        resolve(wire, ids, MEMBERS)


def test_a_claims_bitmap_past_the_members_is_refused():
    members = {f"m{i}" for i in range(5)}  # 5 bits of one byte
    whole = {"roster": sorted(members), "participants": ["m0"], "server": {}, "claims": {"m0": 1}}
    wire = on_the_wire(whole, sorted(members), members)
    assert wire["claims_of"] == b"\x01"
    with pytest.raises(ValueError, match="past the members"):
        resolve({**wire, "claims_of": b"\x21"}, sorted(members), members)


async def test_a_far_announcement_by_difference_is_kept_once_its_roster_comes():
    """A member behind the swarm keeps the newest far announcement for its catch-up, as
    with a whole roster: it asks for the roster first."""
    d = _driver("b")
    sent = []

    async def send(to, kind, round_no, body, attempt=0):
        sent.append((to, kind, round_no, attempt))

    d.services.exchange.transport.send = send
    d.current, d.applied = (4, 0), 3
    far = 9
    d.services.exchange.transport.peers["a"] = {"status": "online", "round": far - 1}
    d.on_gossip(_env("a", "announce", far, 0, ANN))
    await asyncio.sleep(0.01)
    assert d.observer.newest is None and sent == [("a", "roster_req", far, 0)]
    d.on_inbox(_env("a", "roster", far, 0, {"roster": NEXT}))
    newest = d.observer.newest
    assert newest is not None and (newest.round, newest.body["roster"]) == (far, NEXT)
    await d.rosters_asked.tasks.aclose()
