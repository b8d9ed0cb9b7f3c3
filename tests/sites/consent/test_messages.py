"""Site messages (:mod:`p2pfl.sites.consent.messages`): what a site signs comes back as it was sent,
and every message that is malformed, misaddressed, unsigned where the federation signs,
forged, or signed with a certificate the swarm does not trust is refused with its reason."""

from __future__ import annotations

import math
import re
import shutil
import time

import msgpack
import pytest

from p2pfl.errors import P2PFLError
from p2pfl.security.certs import CertError, SwarmCerts, make_swarm_certs, revoke
from p2pfl.sites.consent import messages as M
from p2pfl.sites.consent.messages import (
    MAX_SITE_MESSAGE_BYTES,
    MessageRefused,
    SiteIdentity,
    SiteVerifier,
    canonical_bytes,
    decode,
    encode,
    parse_topic,
    subscription,
    topic,
)

SWARM = "fed"
RUN = "0123456789abcdef"
BODY = {"vote": "accept", "reasons": [], "policy": "ab" * 16, "n": 3, "x": 0.5, "ok": None}


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> SwarmCerts:
    return make_swarm_certs(tmp_path_factory.mktemp("certs"), SWARM, ["s1", "s2"])


@pytest.fixture(scope="module")
def s1(certs) -> SiteIdentity:
    return SiteIdentity.from_certs(certs.root, "s1")


@pytest.fixture(scope="module")
def s2(certs) -> SiteIdentity:
    return SiteIdentity.from_certs(certs.root, "s2")


@pytest.fixture
def verifier(certs) -> SiteVerifier:
    return SiteVerifier.from_certs(certs.root)


def refused(reason: str, where: str, payload: bytes, verifier: SiteVerifier | None) -> str:
    with pytest.raises(MessageRefused) as info:
        decode(SWARM, where, payload, verifier)
    assert info.value.reason == reason, str(info.value)
    return str(info.value)


def raw(**fields) -> bytes:
    """A payload of a vote by s1 on RUN, unsigned, with ``fields`` changed (None: left out)."""
    base = {"v": 1, "kind": "vote", "run_id": RUN, "site": "s1", "ts": 1.5, "body": {}}
    base.update(fields)
    return msgpack.packb({k: v for k, v in base.items() if v is not None}, use_bin_type=True)


def resigned(payload: bytes, **changes) -> bytes:
    """``payload`` with fields changed and its signature and certificate kept."""
    obj = msgpack.unpackb(payload, raw=False)
    obj.update(changes)
    return msgpack.packb(obj, use_bin_type=True)


VOTE_S1 = topic(SWARM, "vote", RUN, "s1")


# ----------------------------------------------------------------------------- round trips


def test_a_signed_message_comes_back_as_it_was_sent(s1, verifier):
    where, payload = encode(SWARM, "vote", RUN, "s1", BODY, s1, ts=1234.5)
    assert where == f"p2pfl/{SWARM}/sites/vote/{RUN}/s1"
    msg = decode(SWARM, where, payload, verifier)
    assert msg == M.SiteMessage("vote", RUN, "s1", BODY, 1234.5, signed=True)
    # a verifier of the same CA loaded elsewhere takes it as well: the certificate travels
    assert decode(SWARM, where, payload, SiteVerifier(verifier.ca)).signed


def test_an_unsigned_message_comes_back_unsigned(s1):
    where, payload = encode(SWARM, "spec", RUN, "s1", {"spec": {"rounds": 2}}, None)
    msg = decode(SWARM, where, payload, None)
    assert msg is not None and msg.kind == "spec" and msg.body == {"spec": {"rounds": 2}}
    assert not msg.signed and abs(msg.ts - time.time()) < 60
    # without a verifier a signature is not read: a signed message reads unsigned too
    where, payload = encode(SWARM, "spec", RUN, "s1", {"spec": {}}, s1)
    assert decode(SWARM, where, payload, None).signed is False


def test_a_tuple_travels_as_a_list_and_still_verifies(s1, verifier):
    where, payload = encode(SWARM, "commit", RUN, "s1", {"members": ("s1", "s2")}, s1)
    assert decode(SWARM, where, payload, verifier).body == {"members": ["s1", "s2"]}


def test_an_empty_payload_is_a_cleared_message(verifier):
    assert decode(SWARM, VOTE_S1, b"", None) is None
    assert decode(SWARM, VOTE_S1, b"", verifier) is None
    assert refused("topic", "p2pfl/other/sites/vote/x/s1", b"", None)


# ----------------------------------------------------------------------------- canonical form


def test_the_encoding_does_not_depend_on_the_order_of_keys(s1):
    a = {"b": 1, "a": {"d": [{"y": 1, "x": 2}], "c": 3}}
    b = {"a": {"c": 3, "d": [{"x": 2, "y": 1}]}, "b": 1}
    assert list(a) != list(b) and canonical_bytes(a) == canonical_bytes(b)
    assert canonical_bytes(a) != canonical_bytes({"a": {"c": 3, "d": [{"x": 2, "y": 2}]}, "b": 1})
    # Ed25519 signs deterministically, so the whole payload is the same
    assert encode(SWARM, "vote", RUN, "s1", a, s1, ts=1.0) == encode(
        SWARM, "vote", RUN, "s1", b, s1, ts=1.0
    )


@pytest.mark.parametrize(
    "body, match",
    [
        ({"data": b"bytes"}, "cannot hold a bytes"),
        ({"s": {1, 2}}, "cannot hold a set"),
        ({"m": {1: "int key"}}, "is not a str"),
        ({"x": math.nan}, "not a finite"),
        ({"x": math.inf}, "not a finite"),
        ({"n": 1 << 70}, "cannot encode"),
        ({"deep": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}, "deeper"),
        ({"big": "x" * MAX_SITE_MESSAGE_BYTES}, "over the limit"),
    ],
)
def test_encode_refuses_what_a_body_may_not_hold(body, match):
    with pytest.raises(ValueError, match=match):
        encode(SWARM, "vote", RUN, "s1", body, None)


def test_encode_refuses_a_bad_address_or_another_sites_identity(s1):
    with pytest.raises(ValueError, match="cannot sign for 's2'"):
        encode(SWARM, "vote", RUN, "s2", {}, s1)
    with pytest.raises(ValueError, match="unknown site message kind"):
        encode(SWARM, "ballot", RUN, "s1", {}, s1)
    with pytest.raises(ValueError, match="16 lowercase hex"):
        encode(SWARM, "vote", RUN.upper(), "s1", {}, s1)
    with pytest.raises(ValueError, match="not a name"):
        encode(SWARM, "vote", RUN, "s/1", {}, None)
    with pytest.raises(ValueError, match="not finite"):
        encode(SWARM, "vote", RUN, "s1", {}, None, ts=math.inf)
    with pytest.raises(ValueError, match="a body is a map"):
        encode(SWARM, "vote", RUN, "s1", ["accept"], None)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- topics


@pytest.mark.parametrize(
    "name, expected",
    [
        (f"p2pfl/{SWARM}/sites/vote/{RUN}/s1", ("vote", RUN, "s1")),
        (f"p2pfl/{SWARM}/sites/cancel/{RUN}/site.A-2_b", ("cancel", RUN, "site.A-2_b")),
        (f"p2pfl/other/sites/vote/{RUN}/s1", None),  # another swarm
        (f"p2pfl/{SWARM}/sites/ballot/{RUN}/s1", None),  # unknown kind
        (f"p2pfl/{SWARM}/sites/vote/{RUN.upper()}/s1", None),  # run id not lowercase
        (f"p2pfl/{SWARM}/sites/vote/{RUN[:-1]}/s1", None),  # 15 digits
        (f"p2pfl/{SWARM}/sites/vote/{RUN}/s 1", None),  # site not an id
        (f"p2pfl/{SWARM}/sites/vote/{RUN}/s1\n", None),  # a trailing newline
        (f"p2pfl/{SWARM}/sites/vote/{RUN}/", None),  # no site
        (f"p2pfl/{SWARM}/sites/vote/{RUN}/s1/extra", None),  # a level more
        (f"p2pfl/{SWARM}/sites/vote/{RUN}", None),  # a level less
        (f"p2pfl/{SWARM}/presence/vote/{RUN}/s1", None),
        (f"x/{SWARM}/sites/vote/{RUN}/s1", None),
    ],
)
def test_parse_topic(name, expected):
    assert parse_topic(SWARM, name) == expected


def test_topic_and_subscription():
    assert topic(SWARM, "spec", RUN, "s1") == f"p2pfl/{SWARM}/sites/spec/{RUN}/s1"
    assert subscription(SWARM) == f"p2pfl/{SWARM}/sites/#"
    for kind in M.KINDS:
        assert parse_topic(SWARM, topic(SWARM, kind, RUN, "s2")) == (kind, RUN, "s2")
    with pytest.raises(ValueError):
        subscription("a/b")


# ----------------------------------------------------------------------------- refusals


def test_every_refusal_is_a_p2pfl_error_with_a_known_reason():
    assert issubclass(MessageRefused, P2PFLError) and issubclass(MessageRefused, ValueError)
    assert set(M.REFUSAL_REASONS) >= {"oversize", "malformed", "topic", "mismatch"}
    with pytest.raises(AssertionError):
        MessageRefused("whatever")


def test_an_oversized_payload_is_refused_before_it_is_decoded(verifier):
    assert refused("oversize", VOTE_S1, b"\xc1" * (MAX_SITE_MESSAGE_BYTES + 1), verifier)
    assert refused("oversize", "not/a/topic", b"\x00" * (MAX_SITE_MESSAGE_BYTES + 1), None)


@pytest.mark.parametrize(
    "payload, match",
    [
        (b"\xc1", "not msgpack"),  # a reserved type byte
        (raw()[:-3], "not msgpack"),  # truncated
        (raw() + b"\x00", "bytes after"),
        (msgpack.packb(["vote", RUN]), "not a map"),
        (msgpack.packb({1: 2}), "not msgpack"),  # an int key: refused by strict_map_key
        (msgpack.packb(msgpack.ExtType(5, b"x")), "not msgpack|ext"),
        (raw(v=2), "version"),
        (raw(v=True), "version"),
        (raw(v=None), "missing"),
        (raw(extra=1), "unexpected"),
        (raw(kind=3), "kind is not a str"),
        (raw(site=b"s1"), "site is not a str"),
        (raw(ts="now"), "finite float"),
        (raw(ts=12), "finite float"),
        (raw(ts=math.nan), "finite float"),
        (raw(body=["accept"]), "body is not a map"),
        (raw(body={"b": b"bytes"}), "body holds a bytes"),
        (raw(body={"x": math.inf}), "body holds inf"),
        (raw(body={"b": {b"k": 1}}), "is not a str"),
        (raw(sig=b"\x00" * 64), "without its certificate"),
        (raw(sig=b"\x00" * 3, cert=b"pem"), "not 64 bytes"),
        (raw(sig=b"\x00" * 64, cert="pem"), "cert is not bytes"),
    ],
)
def test_a_malformed_payload_is_refused(payload, match, verifier):
    for v in (None, verifier):
        detail = refused("malformed", VOTE_S1, payload, v)
        assert re.search(match, detail), detail


def test_a_payload_deeper_than_the_limit_is_malformed():
    body: dict = {}
    inner = body
    for _ in range(M.MAX_DEPTH):
        inner["d"] = {}
        inner = inner["d"]
    assert "deeper" in refused("malformed", VOTE_S1, raw(body=body), None)


@pytest.mark.parametrize(
    "name",
    [
        f"p2pfl/other/sites/vote/{RUN}/s1",  # another swarm
        f"p2pfl/{SWARM}/sites/ballot/{RUN}/s1",  # unknown kind
        f"p2pfl/{SWARM}/sites/vote/{RUN}/s1/x",  # a level more
    ],
)
def test_a_message_off_the_site_topics_is_refused(name, s1, verifier):
    _, payload = encode(SWARM, "vote", RUN, "s1", BODY, s1)
    assert refused("topic", name, payload, verifier)


def test_a_payload_that_names_another_kind_run_or_site_than_its_topic_is_refused(s1, verifier):
    _, payload = encode(SWARM, "vote", RUN, "s1", BODY, s1)
    for where in (
        topic(SWARM, "commit", RUN, "s1"),
        topic(SWARM, "vote", "f" * 16, "s1"),
        topic(SWARM, "vote", RUN, "s2"),
    ):
        assert refused("mismatch", where, payload, verifier)
        assert refused("mismatch", where, payload, None)


def test_an_unsigned_message_is_refused_where_the_federation_signs(verifier):
    where, payload = encode(SWARM, "vote", RUN, "s1", BODY, None)
    assert refused("unsigned", where, payload, verifier)


def test_a_body_changed_after_signing_is_forged(s1, verifier):
    where, payload = encode(SWARM, "vote", RUN, "s1", BODY, s1)
    tampered = resigned(payload, body={**BODY, "vote": "reject"})
    assert refused("forged", where, tampered, verifier)
    assert refused("forged", where, resigned(payload, ts=99.0), verifier)
    # a payload re-encoded with the same values still verifies: the values are signed
    reordered = resigned(payload, body=dict(reversed(list(BODY.items()))))
    assert decode(SWARM, where, reordered, verifier).signed


def test_a_signed_message_moved_to_another_run_is_forged(s1, verifier):
    _, payload = encode(SWARM, "vote", RUN, "s1", BODY, s1)
    other = "f" * 16
    moved = resigned(payload, run_id=other)  # the payload agrees with its new topic
    assert refused("forged", topic(SWARM, "vote", other, "s1"), moved, verifier)


def test_another_sites_key_cannot_sign_for_a_site(certs, s1, s2, verifier):
    # s2's key behind s1's certificate: the certificate is s1's, the signature is not
    impostor = SiteIdentity("s1", s2._key, s1.certificate_pem)
    where, payload = encode(SWARM, "vote", RUN, "s1", BODY, impostor)
    assert "not s1's" in refused("forged", where, payload, verifier)
    # s2's own certificate claiming s1: the certificate is not s1's
    claims = SiteIdentity("s1", s2._key, s2.certificate_pem)
    where, payload = encode(SWARM, "vote", RUN, "s1", BODY, claims)
    assert "is for 's2'" in refused("bad_certificate", where, payload, verifier)


def test_a_certificate_of_another_ca_is_refused(tmp_path, verifier):
    other = make_swarm_certs(tmp_path / "other", SWARM, ["s1"])
    stranger = SiteIdentity.from_certs(other.root, "s1")
    where, payload = encode(SWARM, "vote", RUN, "s1", BODY, stranger)
    assert "swarm CA" in refused("bad_certificate", where, payload, verifier)
    assert decode(SWARM, where, payload, SiteVerifier.from_certs(other.root)).signed


def test_garbage_in_place_of_a_certificate_is_refused(s1, verifier):
    where, payload = encode(SWARM, "vote", RUN, "s1", BODY, s1)
    assert refused("bad_certificate", where, resigned(payload, cert=b"not a pem"), verifier)
    assert refused("bad_certificate", where, resigned(payload, cert=b"x" * 5000), verifier)


def test_a_revoked_certificate_is_refused(tmp_path, certs):
    root = tmp_path / "certs"
    shutil.copytree(certs.root, root)
    before = SiteIdentity.from_certs(root, "s2")
    revoke(root, ["s2"])
    verifier = SiteVerifier.from_certs(root)
    where, payload = encode(SWARM, "vote", RUN, "s2", BODY, before)
    assert "CRL" in refused("revoked", where, payload, verifier)
    where, payload = encode(SWARM, "vote", RUN, "s1", BODY, SiteIdentity.from_certs(root, "s1"))
    assert decode(SWARM, where, payload, verifier).signed  # s1 is not revoked
    with pytest.raises(CertError, match=r"s2\.crt: certificate revoked"):
        SiteIdentity.from_certs(root, "s2")


# ----------------------------------------------------------------------------- identities


def test_an_identity_whose_key_is_not_its_certificates_is_refused(tmp_path, certs):
    root = tmp_path / "certs"
    shutil.copytree(certs.root, root)
    paths = SwarmCerts(root)
    shutil.copy(paths.node_key("s2"), paths.node_key("s1"))
    with pytest.raises(CertError, match=r"s1\.key: does not match"):
        SiteIdentity.from_certs(root, "s1")
    paths.node_cert("s2").unlink()
    with pytest.raises(CertError, match=r"s2\.crt: missing"):
        SiteIdentity.from_certs(root, "s2")
    with pytest.raises(CertError, match="missing"):
        SiteVerifier.from_certs(tmp_path / "nowhere")


def test_a_fresh_identity_has_no_problem(s1):
    assert s1.problem() is None and s1.site == "s1"
    assert s1.certificate_pem.startswith(b"-----BEGIN CERTIFICATE-----")


# ----------------------------------------------------------------------------- the cache


def test_a_certificate_is_verified_once_per_site(monkeypatch, s1, s2, verifier):
    calls = []
    real = M.verify_member_certificate

    def counted(pem, ca, site=None, revoked=frozenset()):
        calls.append(site)
        return real(pem, ca, site, revoked)

    monkeypatch.setattr(M, "verify_member_certificate", counted)
    for i in range(3):
        for who in (s1, s2):
            where, payload = encode(SWARM, "vote", RUN, who.site, {"i": i}, who)
            assert decode(SWARM, where, payload, verifier).signed
    assert calls == ["s1", "s2"]
    # a forged message by a known certificate costs no certificate check either
    where, payload = encode(SWARM, "vote", RUN, "s1", BODY, s1)
    assert refused("forged", where, resigned(payload, body={}), verifier)
    assert calls == ["s1", "s2"]
    # the key is cached per (site, certificate): s1's certificate claimed by s2 is checked
    claims = SiteIdentity("s2", s1._key, s1.certificate_pem)
    where, payload = encode(SWARM, "vote", RUN, "s2", BODY, claims)
    assert refused("bad_certificate", where, payload, verifier)
    assert calls == ["s1", "s2", "s2"]


def test_the_cache_keeps_the_certificates_used_last(certs, s1, s2):
    verifier = SiteVerifier.from_certs(certs.root)
    verifier.cache_size = 1
    for who in (s1, s2, s1):
        where, payload = encode(SWARM, "vote", RUN, who.site, BODY, who)
        assert decode(SWARM, where, payload, verifier).signed
    assert [site for site, _ in verifier._keys] == ["s1"]
    assert verifier.verify("s1", b"data", s1.sign(b"data"), s1.certificate_pem) is None
    assert verifier.verify("s1", b"data", s2.sign(b"data"), s1.certificate_pem) == "forged"
