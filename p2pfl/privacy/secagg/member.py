"""One member's side of SecAgg+ (Bonawitz et al. 2017; Bell et al. 2020), transport-free.

A :class:`SecAggMember` lives for one round context. Its steps, in order, each at most once
(a repeated call with the same input returns the same answer; with another input it is
refused, since answering two versions of a step is how a member leaks):

1. :meth:`advertise`: its public keys ``c_pk`` (share encryption) and ``s_pk`` (masking).
2. :meth:`share_keys`: given every advertisement, Shamir-shares its self-mask seed ``b_u``
   and its masking key ``s_u^SK`` ``t``-of-``|N(u)|`` and seals each neighbour's shares to
   it (AES-GCM under ``HKDF(X25519(c_u, c_v))``).
3. :meth:`receive_shares`: opens the bundles its neighbours sealed to it; those senders
   are the neighbours it masks with.
4. :meth:`mask`: ``y_u = encode(w·x) + PRG(b_u) ± pairwise masks`` (p2pfl.privacy.secagg.masks).
5. :meth:`unmask_shares`: given the aggregator's survivors and dropped, reveals its shares
   of ``b_v`` for survivors and of ``s_v^SK`` for the dropped, never both for one peer.

Threat model: honest-but-curious aggregator and members; the transport authenticates who
sent each message (p2pfl signs messages in signed swarms) so the aggregator cannot
substitute public keys. Against an aggregator that tells members different things, the
refusals here plus ``t > |N(u)|/2`` keep a member's two secrets from both being rebuilt.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from p2pfl.privacy.secagg import shamir
from p2pfl.privacy.secagg.context import RoundContext
from p2pfl.privacy.secagg.errors import SecAggError
from p2pfl.privacy.secagg.fixedpoint import FRAC_BITS, encode, max_abs
from p2pfl.privacy.secagg.graph import check_threshold, neighbourhoods, roster
from p2pfl.privacy.secagg.masks import pair_mask, pair_sign, self_mask
from p2pfl.privacy.secagg.messages import (
    id_list,
    pack_bundle,
    parse_keys,
    unpack_bundle,
)
from p2pfl.privacy.secagg.primitives import (
    SEED_BYTES,
    RandomBytes,
    agree,
    open_sealed,
    private_bytes,
    private_key,
    public_bytes,
    seal,
)


def share_key(
    context: RoundContext, mine: X25519PrivateKey, theirs: bytes, sender: str, recipient: str
) -> bytes:
    """The AES-256 key of the bundle ``sender`` → ``recipient``:
    ``HKDF(X25519(c_sender, c_recipient), context ‖ "share" ‖ sender ‖ recipient)``."""
    info = context.info("share", sender, recipient)
    return agree(mine, theirs, info, f"encryption key between {sender} and {recipient}")


def bundle_aad(context: RoundContext, sender: str, recipient: str) -> bytes:
    """The associated data of a bundle: ``context ‖ "bundle" ‖ sender ‖ recipient``."""
    return context.info("bundle", sender, recipient)


class SecAggMember:
    """One member of a secure-aggregation round (see the module's docstring).

    ``peers`` are the round's other members (the roster every member and the aggregator
    agree on); ``threshold`` is ``t`` over each neighbourhood; ``neighbours`` the SecAgg+
    degree ``k`` (``None``: everyone, p2pfl.privacy.secagg.graph); ``frac_bits`` the
    fixed point (p2pfl.privacy.secagg.fixedpoint). ``rng`` draws the key pairs, ``b_u`` and
    nonces: ``None`` (the default) is the OS's CSPRNG, which production must use; a seeded
    ``numpy.random.Generator`` makes them reproducible, for tests only (pycryptodome's
    Shamir polynomials stay random either way).
    """

    def __init__(
        self,
        node_id: str,
        peers: Iterable[str],
        threshold: int,
        context: RoundContext,
        rng: np.random.Generator | None = None,
        *,
        neighbours: int | None = None,
        frac_bits: int = FRAC_BITS,
    ) -> None:
        others = [p for p in peers if p != node_id]
        self.node_id = node_id
        self.context = context
        self.members = roster([node_id, *others])
        self.graph = neighbourhoods(self.members, context, neighbours)
        self.neighbours = self.graph[node_id]
        check_threshold(threshold, len(self.neighbours))
        self.threshold = threshold
        max_abs(len(self.members), frac_bits)  # refuses a bad frac_bits now
        self.frac_bits = frac_bits
        self._random: RandomBytes = rng.bytes if rng is not None else secrets.token_bytes
        self._c_key = private_key(self._random)
        self._s_key = private_key(self._random)
        self._b_seed = self._random(SEED_BYTES)
        self._advertised: dict[str, tuple[bytes, bytes]] | None = None
        self._bundles: dict[str, bytes] | None = None
        self._received: dict[str, bytes] | None = None
        self._held: dict[str, tuple[int, bytes, bytes]] = {}  # sender -> (index, b, sk)
        self._masked = False
        self._unmask: tuple[frozenset[str], frozenset[str]] | None = None
        self._unmask_reply: dict[str, dict[str, list[Any]]] | None = None

    # step 1
    def advertise(self) -> dict[str, bytes]:
        """``{"c_pk": 32 B, "s_pk": 32 B}``: this member's public keys for the context."""
        return {"c_pk": public_bytes(self._c_key), "s_pk": public_bytes(self._s_key)}

    # step 2
    def share_keys(self, advertised: Mapping[str, Mapping[str, bytes]]) -> dict[str, bytes]:
        """``{recipient: sealed bundle}`` for each neighbour in ``advertised`` (``{member:
        {"c_pk", "s_pk"}}`` as the aggregator forwards it, this member's own entry
        optional). Refused: a non-member, a malformed or reused key, an own entry that is
        not this member's keys, fewer than ``t`` neighbours advertised, or a second call
        with other advertisements."""
        keys = self._parse_advertised(advertised)
        if self._advertised is not None:
            if keys != self._advertised:
                raise SecAggError(f"{self.node_id}: share_keys called again with other keys")
            assert self._bundles is not None
            return dict(self._bundles)
        recipients = [v for v in self.neighbours if v in keys]
        if len(recipients) < self.threshold:
            raise SecAggError(
                f"{self.node_id}: {len(recipients)} of its neighbours advertised keys, "
                f"threshold {self.threshold} needs more"
            )
        holders = len(self.neighbours)
        b_shares = shamir.split(self._b_seed, self.threshold, holders)
        sk_shares = shamir.split(private_bytes(self._s_key), self.threshold, holders)
        bundles = {}
        for position, v in enumerate(self.neighbours):
            if v not in keys:
                continue
            (index, b_share), (_, sk_share) = b_shares[position], sk_shares[position]
            key = share_key(self.context, self._c_key, keys[v][0], self.node_id, v)
            plaintext = pack_bundle(index, b_share, sk_share)
            aad = bundle_aad(self.context, self.node_id, v)
            bundles[v] = seal(key, plaintext, aad, self._random)
        self._advertised, self._bundles = keys, bundles
        return dict(bundles)

    def _parse_advertised(
        self, advertised: Mapping[str, Mapping[str, bytes]]
    ) -> dict[str, tuple[bytes, bytes]]:
        if not isinstance(advertised, Mapping):
            raise SecAggError("advertised: expected {member: keys}")
        keys = {}
        for member, entry in advertised.items():
            if member not in self.members:
                raise SecAggError(f"advertised: {member!r} is not a member of the round")
            keys[member] = parse_keys(entry, member)
        mine = (public_bytes(self._c_key), public_bytes(self._s_key))
        if keys.pop(self.node_id, mine) != mine:
            raise SecAggError(f"advertised: the keys under {self.node_id} are not its own")
        return keys

    # step 3
    def receive_shares(self, bundles: Mapping[str, bytes]) -> None:
        """Opens ``{sender: sealed bundle}`` (the bundles sealed to this member). Refused:
        before :meth:`share_keys`, a sender that is not an advertised neighbour, a bundle
        that fails authentication or carries the wrong index, fewer than ``t`` senders (this
        member could never be unmasked), or a second call with other bundles."""
        if self._advertised is None:
            raise SecAggError(f"{self.node_id}: receive_shares before share_keys")
        if not isinstance(bundles, Mapping):
            raise SecAggError("bundles: expected {sender: bytes}")
        received = dict(bundles)
        if self._received is not None:
            if received != self._received:
                raise SecAggError(f"{self.node_id}: receive_shares called again, other bundles")
            return
        held = {}
        for sender, sealed in received.items():
            if sender not in self.neighbours or sender not in self._advertised:
                raise SecAggError(f"bundle from {sender!r}: not an advertised neighbour")
            key = share_key(
                self.context, self._c_key, self._advertised[sender][0], sender, self.node_id
            )
            plaintext = open_sealed(
                key, sealed, bundle_aad(self.context, sender, self.node_id), f"bundle of {sender}"
            )
            index, b_share, sk_share = unpack_bundle(plaintext, sender)
            if index != self.graph[sender].index(self.node_id) + 1:
                raise SecAggError(f"bundle from {sender}: share index {index} is not ours")
            held[sender] = (index, b_share, sk_share)
        if len(held) < self.threshold:
            raise SecAggError(
                f"{self.node_id}: {len(held)} neighbours shared keys, threshold "
                f"{self.threshold} needs more (this member could not be unmasked)"
            )
        self._received, self._held = received, held

    # step 4
    def mask(self, vector: np.ndarray, weight: float = 1.0) -> np.ndarray:
        """``y_u = encode(weight · vector) + PRG(b_u) + Σ_{v<u} PRG(S_uv) − Σ_{v>u} PRG(S_uv)``
        mod 2^64, over the neighbours whose bundles arrived (p2pfl.privacy.secagg.masks).
        ``vector`` is 1-D float; the fixed-point bound is for the round's member count
        (:class:`SecAggError` beyond it). Once only: two masked vectors under the same
        masks would reveal their difference."""
        if self._received is None:
            raise SecAggError(f"{self.node_id}: mask before receive_shares")
        if self._masked:
            raise SecAggError(
                f"{self.node_id}: mask called twice in one context (two inputs under the "
                f"same masks reveal their difference)"
            )
        x = np.asarray(vector, dtype=np.float64)
        if x.ndim != 1:
            raise SecAggError(f"mask: expected a 1-D vector, got shape {x.shape}")
        if not np.isfinite(weight):
            raise SecAggError(f"mask: weight must be finite, got {weight!r}")
        y = encode(float(weight) * x, len(self.members), self.frac_bits)
        self._masked = True
        y += self_mask(self._b_seed, self.context, self.node_id, x.size)
        for v in self._held:
            m = pair_mask(
                self._s_key, self._advertised[v][1], self.context, self.node_id, v, x.size
            )
            if pair_sign(self.node_id, v) > 0:
                y += m
            else:
                y -= m
        return y

    # step 5
    def unmask_shares(
        self, survivors: Sequence[str], dropped: Sequence[str]
    ) -> dict[str, dict[str, list[Any]]]:
        """``{"b": {v: [index, share of b_v]} for held v in survivors, "sk": {v: [index,
        share of s_v^SK]} for held v in dropped}``. Refused: before :meth:`receive_shares`,
        a non-member, a peer in both lists, fewer than ``t`` survivors (the sum would cover
        too few inputs to hide one), or a second call with other lists."""
        if self._received is None:
            raise SecAggError(f"{self.node_id}: unmask_shares before receive_shares")
        alive = frozenset(id_list(survivors, "survivors"))
        gone = frozenset(id_list(dropped, "dropped"))
        strangers = (alive | gone) - set(self.members)
        if strangers:
            raise SecAggError(f"unmask: {sorted(strangers)} are not members of the round")
        if alive & gone:
            raise SecAggError(
                f"unmask: {sorted(alive & gone)} listed as both survivor and dropped "
                f"(revealing both secrets of a member unmasks its input)"
            )
        if len(alive) < self.threshold:
            raise SecAggError(
                f"unmask: {len(alive)} survivors, fewer than the threshold {self.threshold}"
            )
        if self._unmask is not None:
            if self._unmask != (alive, gone):
                raise SecAggError(
                    f"{self.node_id}: unmask asked again with other survivors/dropped "
                    f"(an inconsistent aggregator)"
                )
            assert self._unmask_reply is not None
            return {kind: dict(shares) for kind, shares in self._unmask_reply.items()}
        reply: dict[str, dict[str, list[Any]]] = {
            "b": {v: [i, b] for v, (i, b, _) in self._held.items() if v in alive},
            "sk": {v: [i, sk] for v, (i, _, sk) in self._held.items() if v in gone},
        }
        self._unmask, self._unmask_reply = (alive, gone), reply
        return {kind: dict(shares) for kind, shares in reply.items()}
