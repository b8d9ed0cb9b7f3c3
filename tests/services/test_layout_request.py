"""A compact layout in presence, and the whole one on request (docs/wire.md, "Model layout"):
the refused-peer gate (:class:`~p2pfl.services.peers.PeerView`) asks once per neighbour and
fingerprint, takes only the answer it asked for, and names the first difference without
counting the neighbour twice; a transport announces the layout compact while it speaks
protocol 4 and whole while it speaks 3."""

from __future__ import annotations

import logging
from collections import Counter

import torch

from p2pfl.learning.layout import compact_layout, describe_layout, fingerprint_holds
from p2pfl.services.peers import PeerView
from p2pfl.wire.envelope import Envelope
from p2pfl.wire.transport import Transport

MINE = describe_layout({"w": torch.zeros(12, 64), "b": torch.zeros(12)}, (64,), 4)
THEIRS = describe_layout({"w": torch.zeros(7, 64), "b": torch.zeros(7)}, (64,), 4)


def _view() -> tuple[PeerView, dict, Counter]:
    presence: dict = {}
    dropped: Counter = Counter()
    return PeerView("a", presence, dropped), presence, dropped


def test_a_compact_layout_unlike_this_nodes_is_refused_and_its_list_asked_once(caplog):
    view, presence, dropped = _view()
    presence["b"] = {"status": "online", "layout": compact_layout(THEIRS)}
    with caplog.at_level(logging.ERROR):
        assert not view.check_layout("b", presence["b"], MINE)
        assert not view.check_layout("b", presence["b"], MINE)  # its next round's presence
    assert view.layout_asks() == ["b"] and view.layout_asks() == []
    assert "the tensors differ" in view.refusal("b") and dropped["layout_mismatch"] == 1
    assert view.layout_answer("b", {"layout": THEIRS}, MINE) is None
    assert "tensor 'w': [12, 64] float32 here, [7, 64] float32 there" in view.refusal("b")
    assert not view.check_layout("b", presence["b"], MINE)  # compact again: the list is known
    assert "[7, 64] float32 there" in view.refusal("b")
    assert dropped["layout_mismatch"] == 1  # one neighbour refused once
    assert sum("refusing neighbour b" in r.message for r in caplog.records) == 2


def test_an_equal_compact_layout_asks_nothing():
    view, presence, _ = _view()
    presence["b"] = {"status": "online", "layout": compact_layout(MINE)}
    assert view.check_layout("b", presence["b"], MINE)
    assert view.layout_asks() == []


def test_another_input_shape_is_named_without_asking():
    view, presence, _ = _view()
    other = describe_layout({"w": torch.zeros(12, 32)}, (32,), 4)
    presence["b"] = {"status": "online", "layout": compact_layout(other)}
    assert not view.check_layout("b", presence["b"], MINE)
    assert "input shape [64] here, [32] there" in view.refusal("b")


def test_a_layout_answer_not_asked_or_not_announced_is_dropped():
    view, presence, _ = _view()
    assert view.layout_answer("b", {"layout": THEIRS}, MINE) == "unexpected_layout"
    presence["b"] = {"status": "online", "layout": compact_layout(THEIRS)}
    view.check_layout("b", presence["b"], MINE)
    forged = {**THEIRS, "tensors": [["w", [1, 1], "float32"]]}  # its fp no longer holds
    assert not fingerprint_holds(forged)
    assert view.layout_answer("b", {"layout": forged}, MINE) == "malformed"
    assert view.layout_answer("b", {"layout": MINE}, MINE) == "malformed"  # another fp
    assert view.layout_answer("b", "junk", MINE) == "malformed"
    assert view.layout_answer("c", {"layout": THEIRS}, MINE) == "unexpected_layout"


def test_a_layout_request_is_answered_once_per_asker():
    view, _, _ = _view()
    assert view.serves_layout("b") and not view.serves_layout("b") and view.serves_layout("c")


def _presence_layout(t: Transport) -> object:
    env = Envelope.unpack(t._presence_payload("online"), 1 << 20)
    return env.body["presence"]["layout"]


def test_presence_carries_the_compact_layout_and_the_whole_one_to_protocol_3():
    t = Transport(
        "s",
        "a",
        "127.0.0.1",
        1,
        presence={"layout": compact_layout(MINE)},
        presence_v3={"layout": MINE},
    )
    assert _presence_layout(t) == compact_layout(MINE)
    t.inbound.versions.presence("b", 3, {"protocol": 3})  # a protocol 3 peer is heard
    assert t.speaks == 3 and _presence_layout(t) == MINE
