"""The pure parts of secure aggregation (p2pfl/privacy/secagg): the fixed-point field
encoding, pycryptodome's Shamir on 32-byte secrets, the ChaCha20 PRG against RFC 8439's
test vector, the round context's encoding and the SecAgg+ neighbour graph."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from p2pfl.privacy.secagg import RoundContext, SecAggError, shamir
from p2pfl.privacy.secagg.fixedpoint import (
    FRAC_BITS,
    decode,
    encode,
    max_abs,
    max_int,
    tolerance,
)
from p2pfl.privacy.secagg.graph import check_threshold, neighbourhoods
from p2pfl.privacy.secagg.primitives import expand

CONTEXT = RoundContext("swarm", 1, 0)


class TestFixedPoint:
    def test_round_trip_within_half_a_step(self):
        x = np.random.default_rng(0).normal(0, 1e3, 50_000)
        x[:4] = [0.0, -0.0, 2.0**-40, -3.5]
        z = encode(x, 8)
        assert z.dtype == np.uint64
        assert np.max(np.abs(decode(z) - x)) <= 2.0 ** -(FRAC_BITS + 1)
        assert decode(encode(np.array([-3.5]), 8))[0] == -3.5  # exact on the grid
        assert encode(np.array([-1.0]), 8)[0] == np.uint64(2**64 - 2**FRAC_BITS)  # two's compl.

    def test_field_sum_decodes_to_the_sum(self):
        rng = np.random.default_rng(1)
        xs = [rng.normal(0, 10, 1000) for _ in range(5)]
        total = np.zeros(1000, dtype=np.uint64)
        for x in xs:
            total += encode(x, 5)
        assert np.max(np.abs(decode(total) - sum(xs))) <= tolerance(5) + 1e-12

    @pytest.mark.parametrize("members", [1, 3, 8, 50])
    def test_the_bound_is_tight_and_sums_at_it_do_not_wrap(self, members):
        frac = 16
        top = np.array([max_abs(members, frac)])
        assert top[0] * 2**frac <= max_int(members)
        for sign in (1, -1):
            total = np.zeros(1, dtype=np.uint64)
            for _ in range(members):
                total += encode(sign * top, members, frac)
            got = decode(total, frac)[0]
            assert np.sign(got) == sign
            assert got == pytest.approx(sign * members * top[0], rel=1e-12)
        above = np.nextafter(top, np.inf)  # the next float64: one step beyond the bound
        with pytest.raises(SecAggError, match=f"most one of {members} members may add"):
            encode(np.array([0.0, -above[0]]), members, frac)
        assert max_abs(members, frac) == pytest.approx((2**63 - 1) / members / 2**frac)

    def test_refusals(self):
        with pytest.raises(SecAggError, match="non-finite"):
            encode(np.array([1.0, np.nan]), 4)
        with pytest.raises(SecAggError, match="non-finite"):
            encode(np.array([np.inf]), 4)
        with pytest.raises(SecAggError, match="frac_bits"):
            encode(np.zeros(2), 4, 60)
        with pytest.raises(SecAggError, match="members"):
            encode(np.zeros(2), 0)
        with pytest.raises(SecAggError, match="uint64"):
            decode(np.zeros(2, dtype=np.int64))


class TestShamir:
    SECRET = bytes(range(32))

    @pytest.mark.parametrize("size", [16, 32])  # a self-mask seed, an X25519 private key
    def test_any_threshold_of_shares_rebuilds_the_secret(self, size):
        secret = self.SECRET[:size]
        shares = shamir.split(secret, 3, 5)
        assert [i for i, _ in shares] == [1, 2, 3, 4, 5]
        assert all(len(s) == size for _, s in shares)
        for subset in itertools.combinations(shares, 3):
            assert shamir.combine(list(subset), 3) == secret
        assert shamir.combine(shares, 3) == secret  # more than t: the first t are used

    def test_fewer_shares_are_refused_and_reveal_nothing_useful(self):
        shares = shamir.split(self.SECRET, 3, 5)
        with pytest.raises(SecAggError, match="2 shares, 3 needed"):
            shamir.combine(shares[:2], 3)
        assert shamir.combine(shares[:2], 2) != self.SECRET  # t − 1 shares: another secret

    def test_shares_are_fresh_and_halves_independent(self):
        a, b = shamir.split(self.SECRET, 2, 3), shamir.split(self.SECRET, 2, 3)
        assert a != b  # random polynomials every time
        assert a[0][1][:16] != a[0][1][16:]

    def test_refusals(self):
        with pytest.raises(SecAggError, match="16 or 32 bytes"):
            shamir.split(b"short", 2, 3)
        with pytest.raises(SecAggError, match="threshold"):
            shamir.split(self.SECRET, 4, 3)
        shares = shamir.split(self.SECRET, 2, 3)
        with pytest.raises(SecAggError, match="appears twice"):
            shamir.combine([shares[0], shares[0]], 2)
        with pytest.raises(SecAggError, match="malformed"):
            shamir.combine([shares[0], (2, shares[1][1][:16])], 2)


def test_prg_is_chacha20_of_rfc_8439():
    # RFC 8439 A.1, test vector #1: key 0^32, nonce 0^12, block counter 0
    keystream = bytes.fromhex(
        "76b8e0ada0f13d90405d6ae55386bd28bdd219b8a08ded1aa836efcc8b770dc7"
        "da41597c5157488d7724e03fb8d84a376a43b8f41518a11cc387b669b2ee6586"
    )
    got = expand(bytes(32), 8)
    assert got.dtype == np.uint64
    assert got.tolist() == [int.from_bytes(keystream[i : i + 8], "little") for i in range(0, 64, 8)]
    assert np.array_equal(expand(bytes(31) + b"\x01", 1000), expand(bytes(31) + b"\x01", 1000))
    assert not np.array_equal(expand(bytes(32), 8), expand(bytes(31) + b"\x01", 8))


class TestContext:
    def test_every_field_changes_the_info(self):
        infos = {
            RoundContext("s", 1, 0).info("pair", "a", "b"),
            RoundContext("s", 1, 1).info("pair", "a", "b"),
            RoundContext("s", 2, 0).info("pair", "a", "b"),
            RoundContext("t", 1, 0).info("pair", "a", "b"),
            RoundContext("s", 1, 0).info("self", "a", "b"),
            RoundContext("s", 1, 0).info("pair", "ab", ""),  # length prefixes: no collision
        }
        assert len(infos) == 6

    @pytest.mark.parametrize(
        ("swarm", "rnd", "attempt"), [("", 1, 0), ("s", -1, 0), ("s", 0, True)]
    )
    def test_refusals(self, swarm, rnd, attempt):
        with pytest.raises(SecAggError, match="context"):
            RoundContext(swarm, rnd, attempt)


class TestGraph:
    IDS = [f"m{i:02d}" for i in range(20)]

    def test_complete_by_default_and_when_k_covers_everyone(self):
        for k in (None, 19, 40):
            graph = neighbourhoods(self.IDS, CONTEXT, k)
            assert all(graph[u] == tuple(v for v in self.IDS if v != u) for u in self.IDS)

    @pytest.mark.parametrize(("k", "degree"), [(1, 2), (4, 4), (5, 6), (10, 10)])
    def test_harary_graph_is_symmetric_and_regular(self, k, degree):
        graph = neighbourhoods(self.IDS, CONTEXT, k)
        assert {len(n) for n in graph.values()} == {degree}
        for u, near in graph.items():
            assert u not in near and list(near) == sorted(near)
            assert all(u in graph[v] for v in near)

    def test_deterministic_for_a_context_and_fresh_for_another(self):
        a = neighbourhoods(self.IDS, CONTEXT, 4)
        assert a == neighbourhoods(list(reversed(self.IDS)), CONTEXT, 4)
        assert a != neighbourhoods(self.IDS, RoundContext("swarm", 1, 1), 4)

    def test_refusals(self):
        with pytest.raises(SecAggError, match="at least 2"):
            neighbourhoods(["solo"], CONTEXT)
        with pytest.raises(SecAggError, match="appears twice"):
            neighbourhoods(["a", "a", "b"], CONTEXT)
        with pytest.raises(SecAggError, match="neighbours"):
            neighbourhoods(self.IDS, CONTEXT, 0)
        check_threshold(3, 4)
        for bad in (2, 5, True):
            with pytest.raises(SecAggError, match="threshold"):
                check_threshold(bad, 4)
