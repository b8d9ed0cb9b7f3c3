"""Hostile peer states never stop a node nor partly load into its model (docs/design.md: "a
node never dies from a peer's bytes"; the contract of ``DecentralizedAlgorithm.merge`` and
``CentralizedAlgorithm.apply`` in p2pfl/algorithms/base.py).

Every built-in method is fed, on each of its paths that loads a peer's state (UA-PDFL's
client-wise dropout and its layer-wise mean, pFedC's shared part and its heads, ...), states
with a key missing, an extra key, a wrong shape, a wrong dtype, a non-tensor value, no keys,
keys that are not all ``str``, another model's tensors, or no map at all:

- ``merge`` returns, names the bad peer in ``facts["rejected"]``, leaves the model bit for
  bit as it was when only bad states arrived, and gives what the good peers alone give when
  a good state arrives too;
- ``apply`` raises ``ValueError`` and leaves the model and the method's state (its
  checkpoint) bit for bit as they were.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from p2pfl.algorithms import Method, Upload, known_algorithms, method_source
from p2pfl.wire.codec import encode

# ----------------------------------------------------------------------------- hostile kinds

State = dict[str, Any]


def _float_keys(state: State) -> list[str]:
    return [k for k, v in state.items() if isinstance(v, torch.Tensor) and v.is_floating_point()]


def _first(state: State) -> str:
    keys = _float_keys(state) or list(state)
    return keys[0]


def _last(state: State) -> str:
    keys = _float_keys(state) or list(state)
    return keys[-1]


def _replace(state: State, key: str, value: Any) -> State:
    out = dict(state)
    out[key] = value
    return out


def _missing(s: State, other: State) -> State:
    return {k: v for k, v in s.items() if k != _last(s)}


def _extra(s: State, other: State) -> State:
    return {**s, "g.intruder.weight": torch.zeros(2, 2)}


def _wrong_shape(s: State, other: State) -> State:
    k = _last(s)
    return _replace(s, k, torch.zeros(*s[k].shape, 2, dtype=s[k].dtype))


def _float64(s: State, other: State) -> State:
    k = _first(s)
    return _replace(s, k, s[k].to(torch.float64))


def _int(s: State, other: State) -> State:
    k = _last(s)
    return _replace(s, k, s[k].to(torch.int64))


def _list_value(s: State, other: State) -> State:
    k = _first(s)
    return _replace(s, k, s[k].tolist())


def _str_value(s: State, other: State) -> State:
    return _replace(s, _last(s), "not a tensor")


def _none_value(s: State, other: State) -> State:
    return _replace(s, _first(s), None)


def _empty(s: State, other: State) -> State:
    return {}


def _other_model(s: State, other: State) -> State:
    return dict(other)


def _mixed_keys(s: State, other: State) -> State:
    # the codec lets bytes keys through: str and bytes do not even sort together
    return {**s, b"g.bytes": torch.zeros(1), "g.zzz": torch.zeros(1)}


def _int_keys(s: State, other: State) -> State:
    return {i: v for i, v in enumerate(s.values())}


def _not_a_map(s: State, other: State) -> Any:
    return list(s.values())


HOSTILE: dict[str, Callable[[State, State], Any]] = {
    "missing_key": _missing,
    "extra_key": _extra,
    "wrong_shape": _wrong_shape,
    "float64": _float64,
    "int": _int,
    "list_value": _list_value,
    "str_value": _str_value,
    "none_value": _none_value,
    "empty": _empty,
    "other_model": _other_model,
    "mixed_keys": _mixed_keys,
    "int_keys": _int_keys,
    "not_a_map": _not_a_map,
}


def model_copy(alg: Method) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in alg.model.state_dict().items()}


def assert_same_model(alg: Method, want: dict[str, torch.Tensor]) -> None:
    got = alg.model.state_dict()
    assert list(got) == list(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


# ----------------------------------------------------------------------------- decentralized


@dataclass(frozen=True)
class Dec:
    """One path of a decentralized method's merge: the method and knobs, the part pulled,
    and how the node is put on that path before merging (``prepare``)."""

    id: str
    method: str
    params: dict[str, Any]
    part: str = "all"
    prepare: Callable[[Method], None] | None = None
    pulls: bool = True  # False: the method pulls nothing, every pulled state is refused


def _dropout_to_bad(alg: Method) -> None:
    alg._dropout_peer = "bad"  # client-wise dropout: adopt bad's whole model


def _layerwise(alg: Method) -> None:
    alg._dropout_peer = None  # layer-wise personalization: g (and h) means


DEC = [
    Dec("uapdfl-dropout", "uapdfl", {}, "all", _dropout_to_bad),
    Dec("uapdfl-layer-all", "uapdfl", {}, "all", _layerwise),
    Dec("uapdfl-layer-g", "uapdfl", {}, "g", _layerwise),
    Dec("dfedavgm", "dfedavgm", {}),
    Dec("dfedavgm-deltas-fp16", "dfedavgm", {"mixing": "deltas", "fp16_deltas": True}),
    Dec("dispfl", "dispfl", {"weighted": True}),
    Dec("local", "local", {}, pulls=False),
]


def dec_node(make_method, case: Dec, *, seed: int = 0, node_id: str = "me", hidden: int = 4):
    return make_method(
        case.method, case.params, hidden=hidden, seed=seed, node_id=node_id, num_samples=6
    )


def dec_pulled(make_method, case: Dec, seed: int, hidden: int = 4) -> State:
    """What a peer built from ``seed`` serves for ``case.part`` (its snapshot's part)."""
    peer = dec_node(make_method, case, seed=seed, node_id=f"p{seed}", hidden=hidden)
    with torch.no_grad():  # peers' models differ from the node's by more than their seed
        for p in peer.model.parameters():
            p.add_(0.5 * seed)
    return peer.select(peer.snapshot(), case.part)


def gossip_for(alg: Method, peers: list[str]) -> dict[str, dict[str, Any]]:
    g = {"n": 4}
    if alg.name == "uapdfl":
        g = {"n": 4, "I": alg.I.clone(), "A": alg.A.clone()}
    return {p: dict(g) for p in peers}


def run_merge(make_method, case: Dec, pulled: dict[str, Any], peers: list[str]):
    alg = dec_node(make_method, case)
    if case.prepare is not None:
        case.prepare(alg)
    before = model_copy(alg)
    facts = alg.merge(gossip_for(alg, peers), pulled)
    return alg, before, facts


@pytest.mark.parametrize("kind", sorted(HOSTILE))
@pytest.mark.parametrize("case", DEC, ids=[c.id for c in DEC])
def test_merge_rejects_a_hostile_state_and_keeps_the_model(make_method, case, kind):
    good = dec_pulled(make_method, case, 1)
    other = dec_pulled(make_method, case, 2, hidden=8)
    bad = HOSTILE[kind](good, other)
    alg, before, facts = run_merge(make_method, case, {"bad": bad}, ["bad"])
    assert "bad" in facts.get("rejected", {}), facts
    assert isinstance(facts["rejected"]["bad"], str)
    assert "bad" not in facts.get("merged_from", [])
    assert_same_model(alg, before)


@pytest.mark.parametrize("kind", sorted(HOSTILE))
@pytest.mark.parametrize("case", DEC, ids=[c.id for c in DEC])
def test_merge_with_a_hostile_and_a_good_state_uses_the_good_one_only(make_method, case, kind):
    good = dec_pulled(make_method, case, 1)
    other = dec_pulled(make_method, case, 2, hidden=8)
    bad = HOSTILE[kind](good, other)
    mixed, _, facts = run_merge(make_method, case, {"bad": bad, "good": good}, ["bad", "good"])
    alone, before, want = run_merge(make_method, case, {"good": good}, ["bad", "good"])
    assert "bad" in facts.get("rejected", {}), facts
    assert_same_model(mixed, model_copy(alone))
    if case.pulls:
        assert "good" not in facts.get("rejected", {})
        assert facts.get("merged_from") == want.get("merged_from")
        if case.prepare is not _dropout_to_bad:  # the good peer really was merged
            assert facts.get("merged_from") == ["good"]
            assert any(not torch.equal(v, before[k]) for k, v in mixed.model.state_dict().items())


def test_every_builtin_method_is_covered():
    builtin = {n for n in known_algorithms() if method_source(n) == "built-in"}
    covered = {c.method for c in DEC} | {c.method for c in CEN}
    assert covered == builtin


# ----------------------------------------------------------------------------- UA-PDFL's plan


def _uapdfl_plan_and_merge(make_method, params, gossip_I, kind):
    alg = make_method("uapdfl", params, seed=0, node_id="me", num_samples=6)
    gossip = {"bad": {"n": 4, "I": gossip_I(alg), "A": alg.A.clone()}}
    pull, facts = alg.plan(gossip)
    good = dec_pulled(make_method, Dec("x", "uapdfl", {}, pull["bad"]), 1)
    other = dec_pulled(make_method, Dec("x", "uapdfl", {}, pull["bad"]), 2, hidden=8)
    before = model_copy(alg)
    merged = alg.merge(gossip, {"bad": HOSTILE[kind](good, other)})
    assert "bad" in merged["rejected"] and merged["merged_from"] == []
    assert_same_model(alg, before)
    return pull, facts


@pytest.mark.parametrize("kind", ["wrong_shape", "float64", "mixed_keys", "missing_key"])
def test_uapdfl_plan_chosen_dropout_rejects_a_hostile_model(make_method, kind):
    params = {"divergence_rule": "fixed", "th_I": 100.0}
    pull, facts = _uapdfl_plan_and_merge(make_method, params, lambda a: a.I.clone(), kind)
    assert facts["dropout"] is True and pull == {"bad": "all"}


def _far(alg):
    return torch.tensor([0.98, 0.01, 0.01]) if alg.I[0] < 0.5 else torch.tensor([0.01, 0.01, 0.98])


@pytest.mark.parametrize("close", [True, False], ids=["all", "g"])
@pytest.mark.parametrize("kind", ["wrong_shape", "float64", "mixed_keys", "missing_key"])
def test_uapdfl_plan_chosen_layerwise_rejects_a_hostile_part(make_method, kind, close):
    # fixed rule, th_I 0.5: a second, far peer keeps the node off dropout; "bad" at Div 0
    # shares h (pulls "all"), a far "bad" shares g only
    params = {"divergence_rule": "fixed", "th_I": 0.5}
    alg = make_method("uapdfl", params, seed=0, node_id="me", num_samples=6)
    gossip = {
        "bad": {"n": 4, "I": alg.I.clone() if close else _far(alg), "A": alg.A.clone()},
        "far": {"n": 4, "I": _far(alg), "A": alg.A.clone()},
    }
    pull, facts = alg.plan(gossip)
    assert facts["dropout"] is False and pull["bad"] == ("all" if close else "g")
    good = dec_pulled(make_method, Dec("x", "uapdfl", {}, pull["bad"]), 1)
    other = dec_pulled(make_method, Dec("x", "uapdfl", {}, pull["bad"]), 2, hidden=8)
    before = model_copy(alg)
    merged = alg.merge(gossip, {"bad": HOSTILE[kind](good, other)})
    assert "bad" in merged["rejected"] and merged["merged_from"] == []
    assert_same_model(alg, before)


@pytest.mark.parametrize("case", DEC, ids=[c.id for c in DEC])
@pytest.mark.parametrize("gossip", [{}, {"bad": {"n": "many"}}, {"bad": None}], ids=str)
def test_merge_survives_missing_or_malformed_gossip_of_a_pulled_peer(make_method, case, gossip):
    alg = dec_node(make_method, case)
    if case.prepare is not None:
        case.prepare(alg)
    good = dec_pulled(make_method, case, 1)
    facts = alg.merge(gossip, {"bad": good})  # never raises
    assert isinstance(facts, dict)


# ----------------------------------------------------------------------------- centralized


@dataclass(frozen=True)
class Cen:
    """One kind of result a centralized method applies: ``received`` picks it from the
    round's :class:`Aggregate` (the node's own result, or ``common``)."""

    id: str
    method: str
    params: dict[str, Any]
    received: str  # "own" (results["me"]) or "common"


CEN = [
    Cen("fedavg", "fedavg", {}, "common"),
    Cen("fedper", "fedper", {}, "common"),
    Cen("criticalfl", "criticalfl", {}, "common"),
    Cen("fedsa", "fedsa", {}, "common"),
    Cen("fedsa-own", "fedsa", {"weighted": True}, "own"),
    Cen("diversifed", "diversifed", {}, "own"),
    Cen("pfedc-heads", "pfedc", {}, "own"),
    Cen("pfedc-common", "pfedc", {}, "common"),
    Cen("pfedc-groups", "pfedc", {"groups": [[0, 1], [2]]}, "own"),
]
TRAINED = SimpleNamespace(grad_sq_sum=2.0)  # the TrainResult fields a report reads
LABELS = {"me": [0, 1], "p1": [0, 1, 2], "p2": [1, 2]}  # pFedC: "me" lacks task 2


def cen_node(make_method, case: Cen, node: str = "me", seed: int = 0, hidden: int = 4):
    return make_method(
        case.method,
        case.params,
        hidden=hidden,
        seed=seed,
        node_id=node,
        num_samples=4 + seed,
        labels=LABELS[node],
    )


def cen_received(make_method, case: Cen, hidden: int = 4) -> State:
    """What the round's aggregator sends "me" after "me", "p1" and "p2" uploaded."""
    nodes = {n: cen_node(make_method, case, n, i, hidden) for i, n in enumerate(LABELS)}
    for i, alg in enumerate(nodes.values()):
        with torch.no_grad():
            for p in alg.model.parameters():
                p.add_(0.1 * i * torch.randn_like(p))
    uploads = {
        n: Upload(alg.ctx.num_samples, alg.upload(), alg.check_report(alg.report(TRAINED, 0.1)))
        for n, alg in nodes.items()
    }
    agg = nodes["p1"].aggregate(
        uploads, nodes["p1"].initial_server_state(list(nodes)), list(nodes), 1
    )
    got = agg.results["me"] if case.received == "own" else agg.common
    assert got
    return got


def checkpoint_bytes(alg: Method) -> bytes:
    return encode(alg.checkpoint())


@pytest.mark.parametrize("kind", sorted(HOSTILE))
@pytest.mark.parametrize("case", CEN, ids=[c.id for c in CEN])
def test_apply_refuses_a_hostile_state_and_changes_nothing(make_method, case, kind):
    good = cen_received(make_method, case)
    other = cen_received(make_method, case, hidden=8)
    bad = HOSTILE[kind](good, other)
    alg = cen_node(make_method, case)
    before, ckpt = model_copy(alg), checkpoint_bytes(alg)
    with pytest.raises(ValueError):
        alg.apply(bad, {"round": 1})
    assert_same_model(alg, before)
    assert checkpoint_bytes(alg) == ckpt
    alg.apply(good, {"round": 1})  # and the good one still goes in
    assert checkpoint_bytes(alg) != ckpt


def test_pfedc_apply_refuses_the_head_of_a_task_the_node_lacks(make_method):
    case = CEN[6]
    good = cen_received(make_method, case)
    alg = cen_node(make_method, case)
    assert alg.pi == [1, 1, 0]
    lacked = {k: v for k, v in alg.model_state().items() if k.startswith("h.heads.2.")}
    partial = {k: v for k, v in good.items() if k != "h.heads.0.bias"}
    assert "h.heads.0.weight" in partial
    before, ckpt = model_copy(alg), checkpoint_bytes(alg)
    for bad in ({**good, **lacked}, partial):
        with pytest.raises(ValueError):
            alg.apply(bad, {})
        assert_same_model(alg, before)
        assert checkpoint_bytes(alg) == ckpt


@pytest.mark.parametrize("case", CEN, ids=[c.id for c in CEN])
def test_apply_of_the_honest_result_loads_it(make_method, case):
    good = cen_received(make_method, case)
    alg = cen_node(make_method, case)
    alg.apply(good, {"round": 1})
    if case.method == "diversifed":  # the target, not the model
        assert all(torch.equal(alg.target[k], v) for k, v in good.items())
    else:
        state = alg.model.state_dict()
        assert all(torch.equal(state[k], v) for k, v in good.items())
