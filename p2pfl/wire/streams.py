"""Top-k streams between nodes (docs/wire.md, "Compression"): ``transfer.compress: topk(rho)``
wired into the pull protocol, on either lane.

The pure codec is :class:`~p2pfl.wire.topk.TopKSender` /
:class:`~p2pfl.wire.topk.TopKReceiver`; this module keeps them per stream:

- **Serving** (:class:`ServedStreams`): a *stream* is what peers pull from this node round
  after round under one key (a decentralized node's part ``g``, ``h`` or ``all``; a
  member's uploads; an aggregator's common result, or its result for one member). Each
  served state (a snapshot, an upload, a result: its *tag*, e.g. the round) is published
  into its stream once, on its first pull, so the error feedback is the sender's, whoever
  pulls. Every pull is answered from that publish: a delta when the request names a base
  of the stream the sender can answer from (same epoch, within its window), else the
  estimate dense (raw: the puller then holds it). Each answer is packed and digested once
  per (tag, base) (:class:`~p2pfl.wire.transfers.PreparedState`: the digest, and a
  signature, cover the bytes that travel). A tag older than the stream's latest publish
  that was never published, or is no longer kept, cannot be answered from the stream: the
  caller serves it uncompressed, which leaves the puller's base as it was.
- **Pulling** (:class:`ReceivedStreams`, held by the transport): one receiver per (peer,
  part); :meth:`ReceivedStreams.base` is what the next pull request of that part names
  (``base: [epoch, seq]`` in its body), and :meth:`ReceivedStreams.decode` decodes a
  top-k answer with that receiver. A delta against a base the receiver does not hold, or
  any malformed answer, raises :class:`~p2pfl.wire.compress.CompressError` and leaves the
  held base as it was; anything that is not a top-k message is handed back as it came.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from p2pfl.wire.compress import codec_of
from p2pfl.wire.topk import TopKReceiver, TopKSender
from p2pfl.wire.transfers import PreparedState

__all__ = ["TAGS_KEPT", "ReceivedStreams", "ServedStreams"]

State = Mapping[str, torch.Tensor]
TAGS_KEPT = 3  # publishes of a stream a pull can still be answered from (SNAPSHOTS_KEPT)


@dataclass
class _Served:
    """One served stream: its sender, the publishes still answerable (tag → the sender as
    it stood then) and their packed answers ((tag, base seq or None) → prepared)."""

    sender: TopKSender
    views: OrderedDict[Any, TopKSender] = field(default_factory=OrderedDict)
    last: Any = None  # the latest tag published
    prepared: dict[tuple[Any, int | None], PreparedState] = field(default_factory=dict)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


class ServedStreams:
    """The top-k streams one node serves (module docstring). ``rho``: the fraction of each
    tensor's values a publish sends; ``window``: how many publishes old a base may be and
    still get a delta; ``digest``: the transfer digest of what is served;
    ``pool``: where publishing and packing run (None: the loop's default executor)."""

    def __init__(
        self,
        rho: float,
        digest: str,
        *,
        window: int = 4,
        keep: int = TAGS_KEPT,
        pool: concurrent.futures.Executor | None = None,
    ):
        TopKSender(rho, window=window)  # checks the arguments
        self.rho, self.window, self.keep = rho, window, keep
        self.digest = digest
        self.pool = pool
        self._streams: dict[Hashable, _Served] = {}

    def sender(self, stream: Hashable) -> TopKSender | None:
        """The sender of ``stream`` (None: nothing published into it yet)."""
        s = self._streams.get(stream)
        return None if s is None else s.sender

    async def prepared(
        self,
        stream: Hashable,
        tag: Any,
        state: Callable[[], State],
        base: tuple[str, int] | None,
    ) -> PreparedState | None:
        """The packed answer of ``stream``'s publish ``tag`` to a pull holding ``base``:
        publishes ``state()`` first when ``tag`` is newer than the stream's latest publish
        (tags of one stream must be ordered: rounds, or (round, attempt)). None when
        ``tag`` is older and not kept (the caller serves it uncompressed)."""
        s = self._streams.get(stream)
        if s is None:
            s = self._streams[stream] = _Served(TopKSender(self.rho, window=self.window))
        loop = asyncio.get_running_loop()
        async with s.lock:
            view = s.views.get(tag)
            if view is None:
                if s.last is not None and not tag > s.last:
                    return None
                view = await loop.run_in_executor(self.pool, _publish, s.sender, state())
                s.views[tag], s.last = view, tag
                while len(s.views) > self.keep:
                    old, _ = s.views.popitem(last=False)
                    for key in [k for k in s.prepared if k[0] == old]:
                        del s.prepared[key]
            key = (tag, view.answers(base))
            if key not in s.prepared:
                s.prepared[key] = await loop.run_in_executor(
                    self.pool, _pack, view, base, self.digest
                )
            return s.prepared[key]


def _publish(sender: TopKSender, state: State) -> TopKSender:
    sender.publish(state)
    return sender.view()


def _pack(view: TopKSender, base: tuple[str, int] | None, digest: str) -> PreparedState:
    return PreparedState.from_state(view.message(base), digest)  # the wire form, digested


class ReceivedStreams:
    """The top-k streams one node pulls: a receiver per (peer, part) (module docstring)."""

    def __init__(self) -> None:
        self._receivers: dict[tuple[str, str], TopKReceiver] = {}

    def base(self, peer: str, part: str) -> tuple[str, int] | None:
        """The base to name in the next pull of ``part`` from ``peer`` (None: none held)."""
        rx = self._receivers.get((peer, part))
        return None if rx is None else rx.base

    def decode(self, peer: str, part: str, wire: State, *, max_bytes: int) -> State:
        """``wire`` (``part`` as pulled from ``peer``) decoded with that stream's receiver
        when it is a top-k message, at most ``max_bytes`` decoded; anything else as it came.
        :class:`~p2pfl.wire.compress.CompressError` for a malformed message or a delta
        against a base not held (the held base is kept)."""
        if codec_of(wire) != "topk":
            return wire
        rx = self._receivers.get((peer, part))
        if rx is None:
            rx = self._receivers[(peer, part)] = TopKReceiver()
        return rx.apply(wire, max_bytes=max_bytes)

    def forget(self, peer: str) -> None:
        """Drop what is held of ``peer``'s streams."""
        for key in [k for k in self._receivers if k[0] == peer]:
            del self._receivers[key]
