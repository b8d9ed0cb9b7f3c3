"""One node's attacks (p2pfl/attacks/adversary.py): round windows, what each hook returns,
and the peer-based attacks on remembered states, against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from p2pfl.attacks import Adversary
from p2pfl.attacks.transforms import alie_z
from p2pfl.config.schema import AttackSpec, TopologyConfig


def spec(kind: str, **kw) -> AttackSpec:
    return AttackSpec(kind=kind, nodes=kw.pop("nodes", ["n0"]), **kw)


def adv(*specs: AttackSpec, num_classes: int = 4, seed: int = 0, node: str = "n0") -> Adversary:
    return Adversary(list(specs), node, num_classes, seed)


def st(g, h=(0.0,), dtype=torch.float32):
    return {
        "g.w": torch.tensor(g, dtype=dtype),
        "g.n": torch.tensor(3, dtype=torch.long),
        "h.w": torch.tensor(h, dtype=dtype),
    }


def _snapshot(state):
    return {k: t.clone() for k, t in state.items()}


def _untouched(state, before):
    return all(torch.equal(state[k], before[k]) for k in before)


# ----------------------------------------------------------------------------- who and when


def test_for_node_with_nodes_and_with_fraction():
    cfg = TopologyConfig(
        name="t",
        nodes=10,
        seed=5,
        attacks=[
            {"kind": "sign_flip", "nodes": ["n1", "n2"]},
            {"kind": "noise", "fraction": 0.3},
        ],
    )
    a = Adversary.for_node(cfg, "n1", 10)
    assert a is not None and a.node_id == "n1" and a.seed == 5 and a.num_classes == 10
    assert a.specs[0].kind == "sign_flip"
    drawn = {
        n
        for n in cfg.node_ids
        if (x := Adversary.for_node(cfg, n, 10)) and any(s.kind == "noise" for s in x.specs)
    }
    assert len(drawn) == 3
    again = {
        n
        for n in cfg.node_ids
        if (x := Adversary.for_node(cfg, n, 10)) and any(s.kind == "noise" for s in x.specs)
    }
    assert drawn == again
    honest = set(cfg.node_ids) - drawn - {"n1", "n2"}
    assert honest and all(Adversary.for_node(cfg, n, 10) is None for n in honest)
    assert Adversary.for_node(TopologyConfig(name="t", nodes=3), "n0", 10) is None


def test_active_respects_the_round_window():
    a = adv(spec("sign_flip", from_round=3, to_round=5), spec("delay", from_round=4))
    assert [s.kind for s in a.active(2)] == []
    assert [s.kind for s in a.active(3)] == ["sign_flip"]
    assert [s.kind for s in a.active(5)] == ["sign_flip", "delay"]
    assert [s.kind for s in a.active(6)] == ["delay"]
    assert [s.kind for s in a.active(1000)] == ["delay"]


def test_describe_lists_active_kinds_once_in_order():
    a = adv(spec("scale", to_round=2), spec("inflate_n"), spec("scale", from_round=2))
    assert a.describe(1) == ["scale", "inflate_n"]
    assert a.describe(2) == ["scale", "inflate_n"]
    assert a.describe(3) == ["inflate_n", "scale"]
    assert adv(spec("delay", from_round=9)).describe(1) == []


def test_label_flip_classes_are_checked():
    with pytest.raises(ValueError):
        adv(spec("label_flip", source=1, target=4), num_classes=4)
    adv(spec("label_flip", source=1, target=3), num_classes=4)


# ----------------------------------------------------------------------------- outgoing


def test_outgoing_applies_specs_by_on_and_in_order():
    s = st([1.0, -2.0], [4.0])
    before = _snapshot(s)
    a = adv(spec("sign_flip", corrupts="model"), spec("scale", factor=2.0, corrupts="result"))
    m = a.outgoing(s, 1, "model")
    assert torch.equal(m["g.w"], torch.tensor([-1.0, 2.0])) and m["g.n"].item() == 3
    r = a.outgoing(s, 1, "result")
    assert torch.equal(r["g.w"], torch.tensor([2.0, -4.0]))
    both = adv(spec("sign_flip", corrupts="both"), spec("scale", factor=3.0, corrupts="both"))
    assert torch.equal(both.outgoing(s, 1, "model")["h.w"], torch.tensor([-12.0]))
    assert torch.equal(both.outgoing(s, 1, "result")["h.w"], torch.tensor([-12.0]))
    assert _untouched(s, before)
    with pytest.raises(ValueError):
        a.outgoing(s, 1, "upload")


def test_outgoing_outside_the_window_or_other_kinds_returns_the_state_itself():
    s = st([1.0])
    a = adv(
        spec("sign_flip", from_round=2, to_round=3),
        spec("label_flip"),
        spec("inflate_n"),
        spec("delay"),
    )
    assert a.outgoing(s, 1, "model") is s
    assert a.outgoing(s, 4, "model") is s
    assert a.outgoing(s, 2, "model") is not s
    assert adv(spec("nan", corrupts="result")).outgoing(s, 1, "model") is s


def test_nan_keeps_non_floating_and_dtype():
    s = st([1.0, 2.0], dtype=torch.float64)
    out = adv(spec("nan")).outgoing(s, 1, "model")
    assert torch.isnan(out["g.w"]).all() and out["g.w"].dtype == torch.float64
    assert out["g.n"].item() == 3 and out["g.n"].dtype == torch.long


def test_noise_is_deterministic_per_seed_node_round():
    s = st([0.0] * 6, [0.0] * 3)
    a = adv(spec("noise", sigma=0.5), seed=1).outgoing(s, 2, "model")
    b = adv(spec("noise", sigma=0.5), seed=1).outgoing(s, 2, "model")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(
        a["g.w"], adv(spec("noise", sigma=0.5), seed=1).outgoing(s, 3, "model")["g.w"]
    )
    assert not torch.equal(
        a["g.w"], adv(spec("noise", sigma=0.5), seed=2).outgoing(s, 2, "model")["g.w"]
    )
    other = adv(spec("noise", sigma=0.5, nodes=["n1"]), seed=1, node="n1").outgoing(s, 2, "model")
    assert not torch.equal(a["g.w"], other["g.w"])
    assert a["g.n"].item() == 3 and not torch.equal(a["g.w"], s["g.w"])
    assert float(a["g.w"].abs().max()) < 0.5 * 8


# ----------------------------------------------------------------------------- remembered peers


def test_remember_keeps_the_latest_round_only():
    a = adv(spec("free_rider"))
    own = st([0.0])
    a.remember(1, {"n1": st([10.0])})
    a.remember(2, {"n2": st([2.0])})
    a.remember(2, {"n3": st([4.0]), "n0": st([100.0])})  # same round adds; own id left out
    a.remember(1, {"n4": st([50.0])})  # an earlier round is ignored
    assert torch.equal(a.outgoing(own, 3, "model")["g.w"], torch.tensor([3.0]))
    a.remember(3, {"n5": st([7.0])})
    assert torch.equal(a.outgoing(own, 3, "model")["g.w"], torch.tensor([7.0]))


def test_alie_uses_own_and_remembered_states():
    own, peer = st([1.0, 4.0], [2.0]), st([3.0, 8.0], [2.0])
    before = _snapshot(peer), _snapshot(own)
    a = adv(spec("alie", z=1.5))
    a.remember(1, {"n1": peer})
    out = a.outgoing(own, 2, "model")
    # mean [2, 6], population std [1, 2]
    assert torch.allclose(out["g.w"], torch.tensor([0.5, 3.0]))
    assert torch.equal(out["h.w"], torch.tensor([2.0]))  # std 0
    assert out["g.n"].item() == 3
    assert _untouched(peer, before[0]) and _untouched(own, before[1])


def test_alie_default_z_from_the_number_of_benign_states():
    own, p1, p2 = st([0.0]), st([3.0]), st([6.0])
    a = adv(spec("alie"))
    a.remember(1, {"n1": p1, "n2": p2})
    z = alie_z(4, 1)  # three benign states + the attacker
    expected = 3.0 - z * math.sqrt(6.0)  # [0, 3, 6]: mean 3, population variance 6
    assert a.outgoing(own, 1, "model")["g.w"].item() == pytest.approx(expected, rel=1e-6)


def test_alie_without_usable_peers_serves_the_own_state():
    own = st([1.0, 2.0], [5.0])
    a = adv(spec("alie", z=2.0))
    assert torch.equal(a.outgoing(own, 1, "model")["g.w"], own["g.w"])
    a.remember(1, {"n1": {"g.w": torch.tensor([1.0, 2.0, 3.0])}})  # other shape
    a.remember(1, {"n2": st([math.nan, 0.0])})  # a non-finite peer tensor is left out
    out = a.outgoing(own, 1, "model")
    assert torch.equal(out["g.w"], own["g.w"])
    # n2's h.w [0] is usable: [5, 0] has mean 2.5 and population std 2.5
    assert torch.equal(out["h.w"], torch.tensor([-2.5]))
    assert out is not own and out["g.w"].data_ptr() != own["g.w"].data_ptr()


def test_peer_attacks_match_peers_per_tensor():
    """A peer that sent only the ``g`` part counts for ``g``; ``h`` falls back to the own."""
    own = st([1.0, 4.0], [10.0])
    a = adv(spec("ipm", epsilon=0.5))
    a.remember(1, {"n1": {"g.w": torch.tensor([3.0, 8.0])}, "n2": st([5.0, 0.0], [20.0])})
    out = a.outgoing(own, 1, "model")
    assert torch.allclose(out["g.w"], -0.5 * torch.tensor([3.0, 4.0]))  # mean of 3 states
    assert torch.allclose(out["h.w"], torch.tensor([-7.5]))  # mean of own and n2
    part = a.outgoing({"g.w": own["g.w"]}, 1, "model")  # a served part: its keys only
    assert list(part) == ["g.w"] and torch.equal(part["g.w"], out["g.w"])
    assert adv(spec("ipm", epsilon=2.0)).outgoing(own, 1, "model")["h.w"].item() == -20.0


def test_free_rider_serves_the_peers_mean():
    own = st([100.0, 100.0], [100.0], dtype=torch.float16)
    a = adv(spec("free_rider"))
    assert torch.equal(a.outgoing(own, 1, "model")["g.w"], own["g.w"])
    a.remember(1, {"n1": st([1.0, 2.0], dtype=torch.float32), "n2": st([3.0, 6.0])})
    out = a.outgoing(own, 1, "model")
    assert out["g.w"].dtype == torch.float16
    assert torch.equal(out["g.w"], torch.tensor([2.0, 4.0], dtype=torch.float16))
    assert torch.equal(out["h.w"], torch.tensor([0.0], dtype=torch.float16))
    assert out["g.n"].item() == 3 and own["g.w"][0].item() == 100.0


# ----------------------------------------------------------------------------- other hooks


def test_claimed_samples_and_serve_delay():
    a = adv(
        spec("inflate_n", claim=5000, to_round=2),
        spec("delay", delay_s=1.5),
        spec("delay", delay_s=2.0, from_round=2),
    )
    assert a.claimed_samples(30, 1) == 5000
    assert a.claimed_samples(30, 3) == 30
    assert a.serve_delay(1) == 1.5
    assert a.serve_delay(2) == 3.5
    assert adv(spec("sign_flip")).serve_delay(1) == 0.0
    assert isinstance(adv(spec("sign_flip")).serve_delay(1), float)


def test_train_labels_flips_only_when_active():
    y = torch.tensor([0, 1, 2, 3])
    a = adv(spec("label_flip", to_round=1), num_classes=4)
    assert a.train_labels(y, 1).tolist() == [3, 2, 1, 0]
    assert a.train_labels(y, 2) is y
    t = adv(spec("label_flip", source=2, target=0), num_classes=4)
    assert t.train_labels(y, 1).tolist() == [0, 1, 0, 3]
    assert y.tolist() == [0, 1, 2, 3]
    assert adv(spec("sign_flip")).train_labels(y, 1) is y
