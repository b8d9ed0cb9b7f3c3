"""Chunked weight transfers (docs/wire.md, "Weight transfers").

A state is packed once for sending (:class:`PreparedState`: one buffer, its tensor index and
its digest) and sent as a metadata message followed by numbered chunks. The receiving side
(:class:`IncomingTransfers`) keeps one entry per pull it is waiting for: the metadata is
checked against the size limits before any memory is allocated, chunks are copied into one
preallocated buffer, the contiguous prefix is hashed in a worker thread as it fills, and
the state is decoded only after the digest matches. Anything off fails that pull with
:class:`TransferError` and is reported through the ``on_drop`` callback the owner gives
(the transport counts and logs it); nothing here touches the network.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from p2pfl.errors import P2PFLError
from p2pfl.wire.codec import CodecError, buffer_to_state, state_to_buffer
from p2pfl.wire.compress import Spec, encode_state, parse_spec
from p2pfl.wire.digest import (
    AUTHENTICATING,
    DEFAULT_DIGEST,
    HASH_POOL,
    hexdigest,
    new_hasher,
)
from p2pfl.wire.envelope import Envelope

State = dict[str, Any]
CHUNK_BYTES = 1 << 20
HASH_BATCH = 8  # chunks per hashing job: fewer GIL hand-offs to the hashing thread


class TransferError(P2PFLError, RuntimeError):
    """A transfer that failed: refused by the peer, corrupt, oversized, or abandoned."""


@dataclass
class PreparedState:
    """A state packed once for sending: one buffer, its tensor index and its digest."""

    index: list[dict]
    buf: bytearray
    digest_name: str
    hexdigest: str

    @classmethod
    def from_state(
        cls, state: State, digest: str = DEFAULT_DIGEST, compress: str | Spec = "none"
    ) -> PreparedState:
        """``state`` in its wire form under ``compress`` (``transfer.compress``, as given or
        parsed; :mod:`p2pfl.wire.compress`), packed and digested: the digest, and so a
        signature, covers the bytes that travel. ``none`` packs ``state`` itself."""
        wire = state if parse_spec(compress).mode == "none" else encode_state(state, compress)
        index, buf = state_to_buffer(wire)
        return cls(index=index, buf=buf, digest_name=digest, hexdigest=hexdigest(buf, digest))

    def nchunks(self, chunk: int) -> int:
        return -(-len(self.buf) // chunk)


@dataclass(frozen=True)
class TransferMeta:
    """A transfer's checked metadata (``xfer_meta``)."""

    total: int
    chunk: int
    nchunks: int
    index: list
    digest_name: str
    hexdigest: str


def check_meta(
    body: Any, max_bytes: int, max_message_bytes: int, *, signed: bool = False
) -> TransferMeta:
    """``body`` of an ``xfer_meta`` checked against the limits (before any memory is
    allocated for the transfer); :class:`TransferError` says what is wrong. ``signed``: the
    swarm signs, so the digest must be one that authenticates (:data:`AUTHENTICATING`)."""
    if not isinstance(body, dict):
        raise TransferError("malformed transfer metadata")
    total, chunk, nchunks = body.get("total"), body.get("chunk"), body.get("nchunks")
    index, digest, expected = body.get("index"), body.get("digest"), body.get("hexdigest")
    ints_ok = all(isinstance(v, int) and not isinstance(v, bool) for v in (total, chunk, nchunks))
    if not ints_ok or not isinstance(index, list) or not isinstance(expected, str):
        raise TransferError("malformed transfer metadata")
    try:
        new_hasher(digest if isinstance(digest, str) else "?")
    except ValueError as exc:
        raise TransferError(str(exc)) from None
    if signed and digest not in AUTHENTICATING:
        raise TransferError(
            f"digest {digest!r} cannot vouch for a transfer in a signed swarm; "
            f"expected one of {sorted(AUTHENTICATING)}"
        )
    if total < 0 or total > max_bytes:
        raise TransferError(f"transfer of {total} bytes exceeds the limit of {max_bytes}")
    if not 0 < chunk <= max_message_bytes or nchunks != -(-total // chunk):
        raise TransferError("inconsistent chunking in transfer metadata")
    return TransferMeta(total, chunk, nchunks, index, digest, expected)


@dataclass
class _Incoming:
    """A transfer being received: filled chunk by chunk into ``buf``."""

    peer: str
    future: asyncio.Future
    max_bytes: int
    buf: memoryview | None = None
    index: list[dict] | None = None
    digest: str = ""  # expected hex digest
    chunk: int = CHUNK_BYTES
    nchunks: int = 0
    seen: set[int] = field(default_factory=set)
    hasher: Any = None
    hashed: int = 0  # chunks [0, hashed) are submitted to the hashing thread, in order
    last_hash: concurrent.futures.Future | None = None


class IncomingTransfers:
    """The transfers one node is waiting for, by transfer id.

    :meth:`expect` registers a pull and returns the future its state arrives on;
    :meth:`on_meta`, :meth:`on_chunk` and :meth:`on_refused` feed it from the peer's
    messages (only from the peer the pull went to). ``on_drop(reason, detail)`` is called
    for every message dropped or transfer rejected. :meth:`close` fails what is pending.
    ``signed``: the swarm signs, so only authenticating digests are accepted."""

    def __init__(
        self,
        node_id: str,
        max_message_bytes: int,
        on_drop: Callable[[str, Any], None],
        spawn: Callable[[Awaitable[None]], None],
        *,
        signed: bool = False,
    ):
        self.node_id = node_id
        self.signed = signed
        self.max_message_bytes = max_message_bytes
        self._on_drop = on_drop
        self._spawn = spawn
        self._pending: dict[str, _Incoming] = {}

    def expect(self, xfer: str, peer: str, max_bytes: int) -> asyncio.Future:
        """Register transfer ``xfer`` from ``peer`` (at most ``max_bytes``); its state (or
        :class:`TransferError`) arrives on the returned future."""
        fut = asyncio.get_running_loop().create_future()
        self._pending[xfer] = _Incoming(peer=peer, future=fut, max_bytes=max_bytes)
        return fut

    def forget(self, xfer: str) -> None:
        """Stop waiting for ``xfer`` (done, failed or timed out)."""
        self._pending.pop(xfer, None)

    def fail_peer(self, peer: str, reason: str) -> None:
        """Fail every transfer from ``peer`` now (it went offline: nothing more will come)."""
        for inc in self._pending.values():
            if inc.peer == peer and not inc.future.done():
                inc.future.set_exception(TransferError(reason))

    def pending(self) -> list[str]:
        """The transfer ids being waited for."""
        return list(self._pending)

    def on_refused(self, env: Envelope) -> None:
        """The peer answered a pull with ``pull_error``: fail that pull."""
        body = env.body if isinstance(env.body, dict) else {}
        inc = self._pending.get(body.get("xfer"))
        if inc is not None and inc.peer == env.sender and not inc.future.done():
            inc.future.set_exception(
                TransferError(f"{env.sender} refused the pull: {body.get('reason')}")
            )

    def on_meta(self, env: Envelope) -> None:
        """A transfer's metadata: check it against the limits, allocate the buffer."""
        body = env.body
        inc = self._pending.get(body.get("xfer")) if isinstance(body, dict) else None
        if inc is None or inc.peer != env.sender or inc.buf is not None:
            self._on_drop("unexpected_xfer_meta", env)
            return
        try:
            meta = check_meta(body, inc.max_bytes, self.max_message_bytes, signed=self.signed)
        except TransferError as exc:
            self._fail(inc, str(exc))
            return
        inc.hasher = new_hasher(meta.digest_name)
        total, chunk, nchunks = meta.total, meta.chunk, meta.nchunks
        index, expected = meta.index, meta.hexdigest
        # uninitialised (no 47 MB memset): every byte is overwritten by a chunk before use
        inc.buf = memoryview(np.empty(total, dtype=np.uint8)).cast("B")
        inc.index, inc.digest, inc.chunk, inc.nchunks = index, expected, chunk, nchunks
        if nchunks == 0:
            self._spawn(self._finish(inc))

    def on_chunk(self, env: Envelope) -> None:
        """One chunk: copy it into place, hash the contiguous prefix, finish when complete."""
        body = env.body
        inc = self._pending.get(body.get("xfer")) if isinstance(body, dict) else None
        if inc is None or inc.peer != env.sender or inc.buf is None or inc.future.done():
            self._on_drop("unexpected_xfer_chunk", env)
            return
        seq, data = body.get("seq"), env.data
        if not isinstance(seq, int) or data is None or not 0 <= seq < inc.nchunks:
            self._fail(inc, "malformed chunk")
            return
        start = seq * inc.chunk
        expected = min(inc.chunk, len(inc.buf) - start)
        if len(data) != expected:
            self._fail(inc, f"chunk {seq} has {len(data)} bytes, expected {expected}")
            return
        if seq in inc.seen:
            return
        inc.buf[start : start + expected] = data
        inc.seen.add(seq)
        # hash the contiguous prefix in a worker thread (hashers release the GIL), so the
        # digest is ready almost as soon as the last chunk lands
        ready = inc.hashed
        while ready in inc.seen:
            ready += 1
        complete = len(inc.seen) == inc.nchunks
        if ready - inc.hashed >= HASH_BATCH or (complete and ready > inc.hashed):
            span = inc.buf[inc.hashed * inc.chunk : ready * inc.chunk]
            inc.last_hash = HASH_POOL.submit(inc.hasher.update, span)
            inc.hashed = ready
        if complete:
            self._spawn(self._finish(inc))

    async def _finish(self, inc: _Incoming) -> None:
        assert inc.buf is not None and inc.index is not None
        if inc.last_hash is not None:
            await asyncio.wrap_future(inc.last_hash)
        if inc.hasher.hexdigest() != inc.digest:
            self._fail(inc, "digest mismatch")
            return
        try:
            state = buffer_to_state(inc.index, inc.buf)
        except CodecError as exc:
            self._fail(inc, f"bad tensor index: {exc}")
            return
        if not inc.future.done():
            inc.future.set_result(state)

    def _fail(self, inc: _Incoming, reason: str) -> None:
        self._on_drop("bad_transfer", f"transfer from {inc.peer} rejected: {reason}")
        if not inc.future.done():
            inc.future.set_exception(TransferError(f"transfer from {inc.peer}: {reason}"))

    def close(self) -> None:
        """Fail every pending transfer."""
        for inc in self._pending.values():
            if not inc.future.done():
                inc.future.set_exception(TransferError("transport closed"))
