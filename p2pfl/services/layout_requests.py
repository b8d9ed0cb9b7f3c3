"""A neighbour's whole model layout, asked when its presence announced a compact one unlike
this node's (docs/wire.md, "Model layout"): ``layout_req`` ``{}`` and its answer ``layout``
``{layout}``, both on the inbox. The refused-peer gate
(:class:`~p2pfl.services.peers.PeerView`) decides whom to ask, whom to answer and which
answer to take; this module moves the messages."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from p2pfl.services.bundle import NodeServices
from p2pfl.wire.envelope import Envelope

KINDS = ("layout_req", "layout")


def ask_layouts(services: NodeServices) -> None:
    """Send ``layout_req`` to each neighbour the gate wants the tensor list of (best effort)."""
    for peer in services.peers.layout_asks():
        services.exchange.send_soon(peer, "layout_req", {})


def on_layout_message(
    services: NodeServices, env: Envelope, own: dict[str, Any] | None, neighbours: Collection[str]
) -> bool:
    """Handle ``env`` when it is a ``layout_req`` or a ``layout`` (and return True): answer a
    neighbour's request with ``own`` once, take an answer asked for; anything else is
    dropped and counted. False: ``env`` is another kind, for the round driver."""
    kind = env.kind
    if kind not in KINDS:
        return False
    exchange, peers = services.exchange, services.peers
    if own is None or env.sender not in neighbours:
        exchange.drop("unexpected_layout", f"{kind} from {env.sender!r}")
    elif kind == "layout":
        why = peers.layout_answer(env.sender, env.body, own)
        if why is not None:
            exchange.drop(why, f"layout from {env.sender!r}")
    elif env.body != {}:
        exchange.drop("malformed", f"layout_req from {env.sender!r}: not an empty map")
    elif peers.serves_layout(env.sender):
        exchange.send_soon(env.sender, "layout", {"layout": own})
    return True
