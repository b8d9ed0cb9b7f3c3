"""The aggregator's side of SecAgg+, transport-free: it relays keys and sealed shares,
sums masked inputs, and removes the masks once a threshold of survivors revealed shares.

Steps (p2pfl.privacy.secagg.messages has the payloads); each step is closed by the call that
hands its outcome on, and a late message of a closed step is refused:

1. :meth:`receive_keys` from each member; :meth:`advertised` closes it (``U1``: those that
   advertised) and is what every member of ``U1`` gets.
2. :meth:`receive_bundles` from each member of ``U1``; :meth:`shared` (or the first
   :meth:`bundles_for`) closes it (``U2``: those whose bundles arrived), and
   :meth:`bundles_for` gives each member of ``U2`` the bundles sealed to it.
3. :meth:`receive_masked` from members of ``U2``: each masked vector is added to a running
   field sum at once and not kept.
4. :meth:`unmask_request` closes it (``U3``: those whose vector arrived, at least ``t``)
   and is what every member of ``U3`` gets; :meth:`receive_unmask` takes their answers.
5. :meth:`result_field` / :meth:`result`: the sum over ``U3``.

What the aggregator holds, ever: public keys, sealed bundles it cannot open, the set of
members per step, the running sum of masked vectors (``Σ_{U3} y_u``), and the revealed
shares (of ``b_v`` for survivors, of ``s_d^SK`` for the dropped). It never holds an
individual member's unmasked (or even masked) vector: the only vector it keeps is the sum.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from p2pfl.privacy.secagg import shamir
from p2pfl.privacy.secagg.context import RoundContext
from p2pfl.privacy.secagg.errors import SecAggError
from p2pfl.privacy.secagg.fixedpoint import FRAC_BITS, decode, max_abs
from p2pfl.privacy.secagg.graph import check_threshold, neighbourhoods, roster
from p2pfl.privacy.secagg.masks import pair_mask, pair_sign, self_mask
from p2pfl.privacy.secagg.messages import parse_keys, parse_unmask
from p2pfl.privacy.secagg.primitives import load_private, public_bytes


class SecAggServer:
    """The aggregator of one secure-aggregation round (see the module's docstring).

    ``members`` is the round's roster, ``threshold``, ``neighbours`` and ``frac_bits`` as
    every :class:`~p2pfl.privacy.secagg.member.SecAggMember` of the round has them, and
    ``length`` the number of coordinates every masked vector has.
    """

    def __init__(
        self,
        members: Iterable[str],
        threshold: int,
        context: RoundContext,
        length: int,
        *,
        neighbours: int | None = None,
        frac_bits: int = FRAC_BITS,
    ) -> None:
        self.members = roster(members)
        self.context = context
        self.graph = neighbourhoods(self.members, context, neighbours)
        for u in self.members:
            check_threshold(threshold, len(self.graph[u]))
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise SecAggError(f"length must be a positive int, got {length!r}")
        self.threshold = threshold
        self.length = length
        max_abs(len(self.members), frac_bits)  # refuses a bad frac_bits now
        self.frac_bits = frac_bits
        self._keys: dict[str, tuple[bytes, bytes]] = {}
        self._u1: frozenset[str] | None = None
        self._bundles: dict[str, dict[str, bytes]] = {}
        self._u2: frozenset[str] | None = None
        self._masked_sum = np.zeros(length, dtype=np.uint64)
        self._u3: set[str] = set()
        self._request: dict[str, list[str]] | None = None
        self._unmasks: dict[str, dict[str, dict[str, tuple[int, bytes]]]] = {}

    def _member(self, member: str, step: str) -> None:
        if member not in self.members:
            raise SecAggError(f"{step}: {member!r} is not a member of the round")

    # step 1
    def receive_keys(self, member: str, keys: Mapping[str, bytes]) -> None:
        """Takes ``member``'s ``{"c_pk", "s_pk"}``; refused after :meth:`advertised` or twice."""
        self._member(member, "keys")
        if self._u1 is not None:
            raise SecAggError(f"keys of {member}: the advertising step is closed")
        if member in self._keys:
            raise SecAggError(f"keys of {member}: already received")
        self._keys[member] = parse_keys(keys, member)

    def advertised(self) -> dict[str, dict[str, bytes]]:
        """``{member: {"c_pk", "s_pk"}}`` of ``U1``, for every member of ``U1``; closes step 1."""
        if self._u1 is None:
            self._u1 = frozenset(self._keys)
        return {u: {"c_pk": c, "s_pk": s} for u, (c, s) in sorted(self._keys.items())}

    # step 2
    def receive_bundles(self, member: str, bundles: Mapping[str, bytes]) -> None:
        """Takes ``member``'s ``{recipient: sealed bundle}``: exactly one per neighbour of
        ``member`` in ``U1``. Refused before :meth:`advertised`, after :meth:`bundles_for`,
        twice, or from outside ``U1``."""
        self._member(member, "bundles")
        if self._u1 is None:
            raise SecAggError(f"bundles of {member}: before the keys were forwarded")
        if self._u2 is not None:
            raise SecAggError(f"bundles of {member}: the key-sharing step is closed")
        if member not in self._u1:
            raise SecAggError(f"bundles of {member}: it did not advertise keys")
        if member in self._bundles:
            raise SecAggError(f"bundles of {member}: already received")
        if not isinstance(bundles, Mapping):
            raise SecAggError(f"bundles of {member}: expected {{recipient: bytes}}")
        expected = {v for v in self.graph[member] if v in self._u1}
        if set(bundles) != expected or not all(isinstance(b, bytes) for b in bundles.values()):
            raise SecAggError(
                f"bundles of {member}: expected one sealed bundle (bytes) for each of "
                f"{sorted(expected)}"
            )
        self._bundles[member] = dict(bundles)

    def bundles_for(self, recipient: str) -> dict[str, bytes]:
        """``{sender: sealed bundle}`` sealed to ``recipient`` (a member of ``U2``); the first
        call closes step 2."""
        self._member(recipient, "bundles_for")
        if recipient not in self.shared():
            raise SecAggError(f"bundles_for: {recipient} did not share keys")
        return {
            sender: bundles[recipient]
            for sender, bundles in sorted(self._bundles.items())
            if recipient in bundles
        }

    def shared(self) -> list[str]:
        """``U2`` (sorted): the members whose bundles arrived, to each of which
        :meth:`bundles_for` is forwarded and from which masked vectors are taken; closes
        step 2 (as does the first :meth:`bundles_for`)."""
        if self._u1 is None:
            raise SecAggError("shared: before the keys were forwarded")
        if self._u2 is None:
            self._u2 = frozenset(self._bundles)
        return sorted(self._u2)

    # step 3
    def receive_masked(self, member: str, masked: np.ndarray) -> None:
        """Adds ``member``'s masked vector (``uint64``, shape ``(length,)``) to the running
        sum; the vector itself is not kept. Refused from outside ``U2``, twice, after
        :meth:`unmask_request`, or with another dtype or shape."""
        self._member(member, "masked input")
        if self._u2 is None or member not in self._u2:
            raise SecAggError(f"masked input of {member}: it did not share keys")
        if self._request is not None:
            raise SecAggError(f"masked input of {member}: the masking step is closed")
        if member in self._u3:
            raise SecAggError(f"masked input of {member}: already received")
        if not isinstance(masked, np.ndarray) or masked.dtype != np.uint64:
            raise SecAggError(f"masked input of {member}: expected a uint64 array")
        if masked.shape != (self.length,):
            raise SecAggError(
                f"masked input of {member}: shape {masked.shape}, expected ({self.length},)"
            )
        self._masked_sum += masked  # mod 2^64
        self._u3.add(member)

    # step 4
    def unmask_request(self) -> dict[str, list[str]]:
        """``{"survivors": U3, "dropped": U2 − U3}`` (sorted), for every member of ``U3``;
        closes step 3. Refused with fewer than ``t`` survivors."""
        if self._request is None:
            if self._u2 is None:
                raise SecAggError("unmask_request: before the key-sharing step")
            if len(self._u3) < self.threshold:
                raise SecAggError(
                    f"unmask_request: {len(self._u3)} masked inputs arrived, fewer than the "
                    f"threshold {self.threshold}"
                )
            self._request = {
                "survivors": sorted(self._u3),
                "dropped": sorted(self._u2 - self._u3),
            }
        return {k: list(v) for k, v in self._request.items()}

    def receive_unmask(self, member: str, response: Mapping[str, Any]) -> None:
        """Takes a survivor's ``{"b": {v: [index, share]}, "sk": {...}}``: ``b`` only for
        survivors, ``sk`` only for the dropped, each at the index the sender holds for that
        peer. Refused before :meth:`unmask_request`, from a non-survivor, or twice."""
        self._member(member, "unmask")
        if self._request is None:
            raise SecAggError(f"unmask of {member}: before the unmask request")
        if member not in self._u3:
            raise SecAggError(f"unmask of {member}: not a survivor")
        if member in self._unmasks:
            raise SecAggError(f"unmask of {member}: already received")
        parsed = parse_unmask(response, member)
        allowed = {"b": set(self._request["survivors"]), "sk": set(self._request["dropped"])}
        for kind, shares in parsed.items():
            for peer, (index, _) in shares.items():
                if peer not in allowed[kind] or member not in self.graph[peer]:
                    raise SecAggError(f"unmask of {member}: no {kind!r} share of {peer} due")
                if index != self.graph[peer].index(member) + 1:
                    raise SecAggError(f"unmask of {member}: wrong index for {peer}")
        self._unmasks[member] = parsed

    # step 5
    def _shares(self, kind: str, peer: str) -> list[tuple[int, bytes]]:
        return [r[kind][peer] for r in self._unmasks.values() if peer in r[kind]]

    def result_field(self) -> np.ndarray:
        """``Σ_{u ∈ U3} encode(w_u · x_u)`` mod 2^64, exactly: the masked sum less each
        survivor's ``PRG(b_v)`` (``b_v`` rebuilt from ``t`` shares) and less each survivor's
        pairwise masks with each dropped ``d`` (``s_d^SK`` rebuilt from ``t`` shares and
        checked against ``d``'s advertised ``s_pk``). :class:`SecAggError` naming every peer
        with fewer than ``t`` shares."""
        if self._request is None:
            raise SecAggError("result: before the unmask request")
        survivors, dropped = self._request["survivors"], self._request["dropped"]
        short = [
            f"{peer} ({len(self._shares(kind, peer))} of {self.threshold} shares of "
            f"{'b' if kind == 'b' else 's^SK'})"
            for kind, peers in (("b", survivors), ("sk", dropped))
            for peer in peers
            if len(self._shares(kind, peer)) < self.threshold
        ]
        if short:
            raise SecAggError(
                f"result: too few unmask responses ({len(self._unmasks)} arrived) to remove "
                f"the masks of " + ", ".join(short)
            )
        total = self._masked_sum.copy()
        for v in survivors:
            total -= self_mask(
                shamir.combine(self._shares("b", v), self.threshold), self.context, v, self.length
            )
        for d in dropped:
            secret = load_private(shamir.combine(self._shares("sk", d), self.threshold))
            if public_bytes(secret) != self._keys[d][1]:
                raise SecAggError(f"result: the shares of {d}'s masking key are inconsistent")
            for v in survivors:
                if v not in self.graph[d]:
                    continue
                m = pair_mask(secret, self._keys[v][1], self.context, d, v, self.length)
                if pair_sign(v, d) > 0:  # y_v holds +PRG(S_vd)
                    total -= m
                else:
                    total += m
        return total

    def result(self) -> np.ndarray:
        """:meth:`result_field` decoded to float64: ``Σ_{u ∈ U3} w_u x_u`` to within
        ``|U3| · 2^-(f+1)`` (p2pfl.privacy.secagg.fixedpoint)."""
        return decode(self.result_field(), self.frac_bits)
