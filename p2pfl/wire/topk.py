"""Top-k with error feedback, the ``topk(rho)`` mode of ``transfer.compress`` (docs/wire.md,
"Compression"): one stream per served state, :class:`TopKSender` at the node that serves
it and :class:`TopKReceiver` at each node that pulls it. Pure: no transport, no event loop;
the daemon keeps them per stream and a pull names the base it holds
(:mod:`p2pfl.wire.streams`, :func:`parse_base`).

The sender keeps a *published estimate* ``P_t`` of its state ``x_t`` and sends, of each
floating tensor, the positions of the ``⌈rho·n⌉`` largest ``|x_t - P_{t-1}|`` with their
new values: ``P_t = P_{t-1} + M_t ⊙ (x_t - P_{t-1})``. With ``e_t = x_t - P_t`` the
residual not sent, ``x_t - P_{t-1} = Δ_t + e_{t-1}`` (the change plus the previous
residual), and ``e_t = (1 - M_t) ⊙ (Δ_t + e_{t-1})``. A receiver that holds ``P_b`` (same
stream epoch, ``b`` within the sender's window) gets the union of the positions changed
since ``b`` with ``P_t``'s values there and rebuilds ``P_t`` bit for bit (values are
replaced, never computed); any other receiver gets ``P_t`` dense (raw, after which it holds
``P_t``; or int8, after which it holds no base). A non-floating, empty or non-finite tensor
is sent whole. Messages are in the wire form of :mod:`p2pfl.wire.compress_format` (codec
``topk``, with a ``stream`` entry); a malformed one, or a delta against a base the receiver
does not hold, raises :class:`~p2pfl.wire.compress_format.CompressError`.
"""

from __future__ import annotations

import math
import secrets
from collections import deque
from collections.abc import Mapping
from typing import Any

import torch

from p2pfl.wire.compress_format import (
    IDX_SUFFIX,
    MAX_EPOCH_CHARS,
    MAX_SEQ,
    CompressError,
    checked_tensor,
    decode_entries,
    int8_or_raw,
    is_int,
    pack,
    read_header,
    tensor_entry,
)

__all__ = ["TopKReceiver", "TopKSender", "parse_base", "topk_positions"]

State = dict[str, torch.Tensor]
_INT32_MAX = (1 << 31) - 1


def parse_base(value: Any) -> tuple[str, int] | None:
    """The base a pull request names (its body's optional ``base``: ``[epoch, seq]`` of the
    sender's published estimate the puller holds, docs/wire.md, "Compression"), None when
    it names none. Untrusted: anything but a list of a string of 1 to 64 characters and an
    int in ``[0, 2**63)`` raises :class:`CompressError`."""
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        raise CompressError(f"base must be [epoch, seq], got {type(value).__name__}")
    epoch, seq = value
    if not isinstance(epoch, str) or not 0 < len(epoch) <= MAX_EPOCH_CHARS:
        raise CompressError(f"base epoch must be a string of 1 to {MAX_EPOCH_CHARS} characters")
    if not is_int(seq) or not 0 <= seq <= MAX_SEQ:
        raise CompressError("base seq must be an int in [0, 2**63)")
    return epoch, seq


def topk_positions(change: torch.Tensor, rho: float) -> torch.Tensor:
    """Flat positions (int64, increasing) of the ``⌈rho·n⌉`` largest ``|change|`` values
    of ``change`` (ties: any of them), leaving out those that are exactly 0 (sending them
    changes nothing)."""
    flat = change.reshape(-1)
    n = flat.numel()
    if n == 0:
        return torch.empty(0, dtype=torch.int64)
    mag = flat.abs()
    k = min(n, max(1, math.ceil(rho * n)))
    pos = torch.arange(n) if k == n else torch.topk(mag, k, sorted=False).indices
    pos = pos[mag[pos] > 0]
    return pos.sort().values


def _layout(state: Mapping[str, torch.Tensor]) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    return [(k, v.dtype, tuple(v.shape)) for k, v in state.items()]


class TopKSender:
    """The sending end of one top-k stream: one state a node serves round after round (one
    part of its model), with error feedback through the published estimate (module
    docstring: ``P_t = P_{t-1} + M_t ⊙ (x_t - P_{t-1})``).

    :meth:`publish` takes the state of each round (once per round, whether or not anybody
    pulls); :meth:`message` answers a receiver that holds ``base``. The sender keeps the
    positions sent in its last ``window`` publishes, so a receiver up to ``window`` rounds
    behind still gets a delta. ``epoch`` names the stream (random by default): a sender
    that restarts, or whose layout changes, starts a new epoch, and every base of the old
    one gets a dense state."""

    def __init__(self, rho: float, *, window: int = 4, epoch: str | None = None):
        if not 0 < rho <= 1:
            raise CompressError(f"topk rho must be in (0, 1], got {rho}")
        if window < 1:
            raise CompressError(f"topk window must be at least 1, got {window}")
        self.rho = rho
        self.window = window
        self.epoch = epoch or secrets.token_hex(8)
        self.seq = 0
        self.estimate: State | None = None
        # per publish: seq and, per tensor, the positions sent (None: the whole tensor)
        self._sent: deque[tuple[int, dict[str, torch.Tensor | None]]] = deque(maxlen=window)

    def error(self, state: Mapping[str, torch.Tensor]) -> State:
        """``e = x - P``: what of ``state`` (the one last published) the published estimate
        has not carried yet, the residual the next publish adds to its change."""
        if self.estimate is None:
            raise CompressError("nothing published yet")
        return {k: state[k].detach().cpu() - v for k, v in self.estimate.items()}

    def publish(self, state: Mapping[str, torch.Tensor]) -> int:
        """Move the estimate to ``state`` (this round's) and return its sequence number. The
        first state, or one of another layout (a new epoch), is published whole."""
        x = {name: checked_tensor(name, v).cpu() for name, v in state.items()}
        prev = self.estimate
        if prev is not None and _layout(prev) != _layout(x):
            self.epoch = secrets.token_hex(8)
            self._sent.clear()
            prev = None
        sent: dict[str, torch.Tensor | None] = {}
        estimate: State = {}
        for name, xt in x.items():
            if prev is None:
                estimate[name], sent[name] = xt.clone(), None
                continue
            p = prev[name]
            exact = not xt.is_floating_point() or not xt.numel()
            if exact or not bool(torch.isfinite(xt).all()) or not bool(torch.isfinite(p).all()):
                # non-floating, empty or non-finite: sent whole (the receiver sees it as is)
                estimate[name], sent[name] = xt.clone(), None
                continue
            wide = torch.promote_types(xt.dtype, torch.float32)
            pos = topk_positions(xt.to(wide) - p.to(wide), self.rho)
            new = p.clone()
            new.view(-1)[pos] = xt.reshape(-1)[pos]
            estimate[name], sent[name] = new, pos
        self.estimate = estimate
        self.seq += 1
        self._sent.append((self.seq, sent))
        return self.seq

    def message(self, base: tuple[str, int] | None, *, dense: str = "raw") -> State:
        """The wire state that brings a receiver holding ``base`` (``(epoch, seq)`` of the
        estimate it holds, None: none) to the current estimate: a delta when ``base`` is of
        this epoch and at most ``window`` publishes old, else the estimate dense (``raw``:
        exact, the receiver then holds it; ``int8``: a quarter of the bytes, the receiver
        then holds no base)."""
        if self.estimate is None:
            raise CompressError("nothing published yet")
        if dense not in ("raw", "int8"):
            raise CompressError(f"dense form {dense!r}: raw or int8")
        if self.answers(base) is None:
            return self._dense(dense)
        assert base is not None
        entries: list[dict] = []
        tensors: State = {}
        for name, p in self.estimate.items():
            changed = [sent[name] for seq, sent in self._sent if seq > base[1]]
            if any(c is None for c in changed):
                entries.append(tensor_entry(name, p, "raw"))
                tensors[name] = p
                continue
            pos = torch.unique(torch.cat(changed)) if changed else torch.empty(0, dtype=torch.int64)
            idx_dtype = torch.int32 if p.numel() <= _INT32_MAX else torch.int64
            sparse = pos.numel() * (p.element_size() + (4 if idx_dtype == torch.int32 else 8))
            if sparse >= p.numel() * p.element_size():  # dense is no larger
                entries.append(tensor_entry(name, p, "raw"))
                tensors[name] = p
                continue
            entries.append(tensor_entry(name, p, "topk"))
            tensors[name] = p.reshape(-1)[pos].clone()
            tensors[name + IDX_SUFFIX] = pos.to(idx_dtype)
        stream = {"epoch": self.epoch, "seq": self.seq, "base": base[1]}
        return pack("topk", entries, tensors, stream)

    def answers(self, base: tuple[str, int] | None) -> int | None:
        """The sequence number :meth:`message` answers ``base`` with a delta from (``base``'s
        own), None when it answers with a dense state (no base, another epoch, outside the
        window, nothing published)."""
        if self.estimate is None or base is None or base[0] != self.epoch:
            return None
        # the oldest base a delta can start from; never 0 (no receiver holds what came
        # before the first publish)
        oldest = max(self._sent[0][0] - 1, 1)
        return base[1] if oldest <= base[1] <= self.seq else None

    def view(self) -> TopKSender:
        """This sender as it stands (its current publish): a copy that later publishes
        leave as it is, whose :meth:`message` answers from this publish's estimate (shared,
        never modified: a publish makes a new one)."""
        frozen = TopKSender(self.rho, window=self.window, epoch=self.epoch)
        frozen.seq, frozen.estimate = self.seq, self.estimate
        frozen._sent = deque(self._sent, maxlen=self.window)
        return frozen

    def _dense(self, form: str) -> State:
        assert self.estimate is not None
        entries: list[dict] = []
        tensors: State = {}
        for name, p in self.estimate.items():
            if form == "int8":
                entry, data = int8_or_raw(name, p)
            else:
                entry, data = tensor_entry(name, p, "raw"), p
            entries.append(entry)
            tensors[name] = data
        stream = {"epoch": self.epoch, "seq": self.seq, "base": None}
        return pack("topk", entries, tensors, stream)


class TopKReceiver:
    """The receiving end of one top-k stream (one sender's state, one part): it holds the
    sender's estimate it last rebuilt exactly, and :attr:`base` names it for the next pull
    request."""

    def __init__(self) -> None:
        self.base: tuple[str, int] | None = None
        self.estimate: State | None = None

    def apply(self, wire: Mapping[str, torch.Tensor], *, max_bytes: int) -> State:
        """The state ``wire`` (a top-k message of this stream) carries, at most
        ``max_bytes`` decoded; :class:`CompressError` when it is malformed, not top-k, or
        a delta against a base this receiver does not hold. An exact message (no int8
        tensor) becomes the held base; a lossy dense one leaves none."""
        header = read_header(wire)
        if header.codec != "topk" or header.stream is None:
            raise CompressError(f"expected a topk message, got codec {header.codec!r}")
        epoch, seq, base = header.stream
        held = None
        if base is not None:
            if self.base != (epoch, base) or self.estimate is None:
                raise CompressError(
                    f"a delta against base {(epoch, base)} but this receiver holds {self.base}"
                )
            held = self.estimate
        state = decode_entries(header, wire, max_bytes, held)
        if any(e["form"] == "int8" for e in header.entries):
            self.base, self.estimate = None, None
        else:
            self.base = (epoch, seq)
            self.estimate = {k: v.clone() for k, v in state.items()}
        return state
