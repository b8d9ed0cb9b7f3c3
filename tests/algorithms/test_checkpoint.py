"""Checkpoints of every registered method (p2pfl/algorithms/base.py, "Checkpoints";
docs/algorithms.md, "Checkpoints").

Each method is driven through two rounds of its hooks on tiny synthetic data (decentralized:
snapshot, gossip, choose_peers, plan, merge, training, after_train with peers; centralized:
training, upload, report, aggregate, apply), then checkpointed through the wire codec and
restored into a fresh instance built the same way. The restored method must be
indistinguishable from the original: the same weights bit for bit, and, with the node's RNG
in the same state (the daemon restores it), the same outputs of every hook and the same
checkpoint after continuing both. ``test_every_saved_item_matters`` is the control: replacing
one item of the saved state by a fresh method's value must change what the method does.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

from p2pfl.algorithms import Method, Upload, get_algorithm, known_algorithms
from p2pfl.config.schema import TrainingConfig
from p2pfl.learning.train import train_local
from p2pfl.wire.codec import decode, encode

BIG = 1 << 30  # decode's size limit for a checkpoint
CFG = TrainingConfig(epochs=1, batch_size=8, lr=0.1, momentum=0.5)
NODES = ("a", "b", "c")  # "a" is the node checkpointed (and the centralized aggregator)
SETUP_ROUNDS = 2

# knob sets per method, so that the state each knob puts in play is exercised ({} otherwise)
VARIANTS: dict[str, list[dict[str, Any]]] = {
    "uapdfl": [
        {},
        {"divergence_rule": "fixed", "th_I": 100.0},
        {"aux_reduction": "mean"},
        {"order": "train_first"},
    ],
    "dfedavgm": [{}, {"mixing": "deltas"}, {"mixing": "deltas", "fp16_deltas": True}],
    "dispfl": [{}, {"regrow": "random", "weighted": True}],
    "diversifed": [{}, {"lam": 0.0}],
    "pfedc": [{}, {"groups": [[0, 1], [2]], "weighting": "equal"}],
    "criticalfl": [{}, {"initial_fraction": 1.0}],
    "fedavg": [{}, {"server_opt": "adam"}, {"server_opt": "yogi", "mu": 0.1}],
    "fedper": [{}, {"server_opt": "adagrad", "beta1": 0.9}],
    "fedsa": [{}, {"weighted": True}],
}
CASES = [
    pytest.param(name, params, id=f"{name}-{i}")
    for name in known_algorithms()
    for i, params in enumerate(VARIANTS.get(name, [{}]))
]


# ----------------------------------------------------------------------------- a tiny swarm


def node_data(node: str, n: int = 24) -> tuple[torch.Tensor, torch.Tensor]:
    """Node ``node``'s training set: 1×4×4 inputs, 3 classes, each node with its own mix
    (``a``: classes 0–1, ``b``: 1–2, ``c``: all three)."""
    i = NODES.index(node)
    gen = torch.Generator().manual_seed(100 + i)
    classes = [[0, 1], [1, 2], [0, 1, 2]][i]
    y = torch.tensor(classes)[torch.randint(0, len(classes), (n,), generator=gen)]
    x = torch.randn(n, 1, 4, 4, generator=gen) + 0.7 * y.view(-1, 1, 1, 1)
    return x, y


@pytest.fixture
def make_node(make_method) -> Callable[[str, dict[str, Any], str], Method]:
    """``make_node(name, params, node)``: node ``node``'s method on an 8-unit MLP, the same
    initial model on every node (torch seed 0, as the daemon builds it), its own node RNG,
    told its labels and the run's rounds as the daemon does (tests/conftest.py)."""

    def make(name: str, params: dict[str, Any], node: str) -> Method:
        _, y = node_data(node)
        return make_method(
            name,
            params,
            hidden=8,
            num_samples=len(y),
            node_id=node,
            seed=0,
            rng_seed=10 + NODES.index(node),
            labels=y.tolist(),
            total_rounds=6,
        )

    return make


Step = Callable[[Method, dict[str, Any]], Any]


def train_step(m: Method, r: dict[str, Any]) -> Any:
    """Local training as the node does it: the method's losses and hook, a seed drawn from
    the node's RNG."""
    x, y = node_data(m.ctx.node_id)
    res = train_local(
        m.model,
        x,
        y,
        CFG,
        CFG.lr,
        extra_loss=m.extra_loss(),
        loss_fn=m.loss_fn(),
        step_hook=m.step_hook(),
        seed=int(m.ctx.rng.integers(2**31)),
    )
    r["result"] = res
    return [res.loss, res.ce_loss, res.steps, res.grad_sq_sum]


def after_train_step(m: Method, r: dict[str, Any]) -> Any:
    return m.after_train()


def publish_step(m: Method, r: dict[str, Any]) -> Any:
    """Decentralized: this round's snapshot (what peers pull) and gossip."""
    snap = m.snapshot()
    gossip = m.gossip()
    r["pubs"][m.ctx.node_id] = (gossip, snap)
    return [snap, gossip]


def plan_step(m: Method, r: dict[str, Any]) -> Any:
    others = {j: p for j, p in r["pubs"].items() if j != m.ctx.node_id}
    peers = m.choose_peers(sorted(others))
    r["heard"] = {j: others[j][0] for j in peers if others[j][0] is not None}
    pull, facts = m.plan(r["heard"])
    r["pull"] = pull
    return [peers, pull, facts]


def merge_step(m: Method, r: dict[str, Any]) -> Any:
    pulled = {j: m.select(r["pubs"][j][1], part) for j, part in r["pull"].items()}
    return m.merge(r["heard"], pulled)


def upload_step(m: Method, r: dict[str, Any]) -> Any:
    """Centralized: the upload and the (checked) report of a participant."""
    state = m.upload()
    report = m.check_report(m.report(r["result"], CFG.lr))
    r["uploads"][m.ctx.node_id] = Upload(m.ctx.num_samples, state, report)
    return [state, report]


def aggregate_step(m: Method, r: dict[str, Any]) -> Any:
    """Centralized: node ``a`` is the aggregator (the rule is pure; the others wait)."""
    if m.ctx.node_id != "a":
        return None
    agg = m.aggregate(dict(r["uploads"]), r["server"], list(NODES), r["round"])
    r["agg"] = agg
    return [agg.results, agg.common, agg.server, agg.facts]


def apply_step(m: Method, r: dict[str, Any]) -> Any:
    agg = r["agg"]
    received = agg.results.get(m.ctx.node_id, agg.common)
    announcement = {"round": r["round"], "server": agg.server}  # as the announcement has it
    return None if received is None else m.apply(received, announcement)


def round_steps(m: Method) -> list[Step]:
    """One round of ``m``'s hooks in the order its driver calls them."""
    if m.kind == "centralized":
        return [train_step, after_train_step, upload_step, aggregate_step, apply_step]
    if m.exchange_after_training:
        return [train_step, after_train_step, publish_step, plan_step, merge_step]
    return [publish_step, plan_step, merge_step, train_step, after_train_step]


def new_round(round_no: int, server: dict[str, Any]) -> dict[str, Any]:
    """What a round's nodes share in memory (peers' publications and uploads, the plan)."""
    return {"round": round_no, "server": server, "pubs": {}, "uploads": {}}


def run_round(nodes: dict[str, Method], r: dict[str, Any]) -> None:
    """Every node runs each step before any runs the next (peers publish before anyone
    plans, every upload arrives before the aggregate)."""
    steps = {i: round_steps(m) for i, m in nodes.items()}
    for s in range(len(next(iter(steps.values())))):
        for i, m in nodes.items():
            steps[i][s](m, r)


def setup_swarm(make_node, name: str, params: dict[str, Any]):
    """Nodes a, b, c of method ``name`` after :data:`SETUP_ROUNDS` rounds; returns
    ``(nodes, server state for the next round)``."""
    nodes = {i: make_node(name, params, i) for i in NODES}
    a = nodes["a"]
    server = a.initial_server_state(list(NODES)) if a.kind == "centralized" else {}
    for rnd in range(1, SETUP_ROUNDS + 1):
        r = new_round(rnd, server)
        run_round(nodes, r)
        server = r["agg"].server if a.kind == "centralized" else {}
    return nodes, server


def peers_part(nodes: dict[str, Method], round_no: int, server: dict[str, Any]):
    """The peers' (b, c) share of round ``round_no``, which node a's round needs: their
    publications (decentralized) or uploads (centralized)."""
    r = new_round(round_no, server)
    for i in ("b", "c"):
        m = nodes[i]
        for step in round_steps(m):
            step(m, r)
            if step in (publish_step, upload_step):
                break
    return r


def continue_node(m: Method, r: dict[str, Any], start: int, peers_next) -> list[Any]:
    """Steps ``start..`` of the current round ``r``, then one whole further round against
    ``peers_next`` (the peers' share of it); every hook's output, then the final weights."""
    out = [step(m, r) for step in round_steps(m)[start:]]
    server = r["agg"].server if m.kind == "centralized" else {}
    r2 = copy.deepcopy(peers_next)
    r2["server"] = server
    out += [step(m, r2) for step in round_steps(m)]
    out.append(m.model_state())
    return out


def roundtrip(ckpt: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint as the node writes and reads it back."""
    return decode(encode(ckpt), BIG)


def restored(make_node, original: Method, ckpt: dict[str, Any], rng_state=None) -> Method:
    """A fresh method built as ``original`` was, restored from ``ckpt``, with the node's RNG
    in ``rng_state`` (default: ``original``'s now), the daemon's part of the checkpoint."""
    fresh = make_node(original.name, original.params.model_dump(), original.ctx.node_id)
    fresh.restore(ckpt)
    state = original.ctx.rng.bit_generator.state if rng_state is None else rng_state
    fresh.ctx.rng.bit_generator.state = copy.deepcopy(state)
    return fresh


def assert_same_outputs(got: list[Any], want: list[Any]) -> None:
    """Hook by hook, bit for bit (msgpack bytes: tensors and floats exactly)."""
    assert len(got) == len(want)
    for k, (g, w) in enumerate(zip(got, want, strict=True)):
        assert encode(g) == encode(w), f"output {k} differs"


def next_round_inputs(nodes: dict[str, Method], server: dict[str, Any]):
    """The peers' share of round ``SETUP_ROUNDS + 1``, taken on copies of b and c, and of
    round ``SETUP_ROUNDS + 2`` (the peers run their shares twice in a row; what they hold
    does not matter, only that both runs of node a see the same)."""
    peers = {i: copy.deepcopy(nodes[i]) for i in ("b", "c")}
    first = peers_part(peers, SETUP_ROUNDS + 1, server)
    second = peers_part(peers, SETUP_ROUNDS + 2, server)
    return first, second


def replay(a0: Method, first: dict[str, Any], cut: int) -> tuple[Method, dict[str, Any]]:
    """A copy of node ``a0`` and of the round's shared memory after its first ``cut`` steps
    of the round whose peers' share is ``first``."""
    a = copy.deepcopy(a0)
    r = copy.deepcopy(first)
    for step in round_steps(a)[:cut]:
        step(a, r)
    return a, r


# ----------------------------------------------------------------------------- the tests


@pytest.mark.parametrize(("name", "params"), CASES)
def test_restored_method_continues_identically(make_node, name, params):
    nodes, server = setup_swarm(make_node, name, params)
    a = nodes["a"]
    ckpt = roundtrip(a.checkpoint())
    assert set(ckpt) == {"model", "extra"}
    twin = restored(make_node, a, ckpt)

    # the weights, bit for bit, and the same checkpoint straight away
    want = a.model.state_dict()
    got = twin.model.state_dict()
    assert list(got) == list(want)
    assert all(got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want)
    assert encode(twin.checkpoint()) == encode(a.checkpoint())

    # the same next round and the one after, hook by hook, and the same state after them
    first, second = next_round_inputs(nodes, server)
    out_a = continue_node(a, copy.deepcopy(first), 0, second)
    out_twin = continue_node(twin, copy.deepcopy(first), 0, second)
    assert_same_outputs(out_twin, out_a)
    assert encode(twin.checkpoint()) == encode(a.checkpoint())


@pytest.mark.parametrize(("name", "params"), CASES)
def test_checkpoint_between_any_two_hooks(make_node, name, params):
    """The method's whole state is in the checkpoint at every point of a round, not only at
    its end (what the round's nodes share in memory, e.g. the pulled states, is the
    driver's, and is handed to both runs alike)."""
    nodes, server = setup_swarm(make_node, name, params)
    first, second = next_round_inputs(nodes, server)
    for cut in range(len(round_steps(nodes["a"]))):
        a, r = replay(nodes["a"], first, cut)
        twin = restored(make_node, a, roundtrip(a.checkpoint()))
        out_twin = continue_node(twin, copy.deepcopy(r), cut, second)
        out_a = continue_node(a, r, cut, second)
        assert_same_outputs(out_twin, out_a)
        assert encode(twin.checkpoint()) == encode(a.checkpoint()), f"cut after step {cut}"


# the methods that keep state between rounds beyond their model
STATEFUL = [n for n in known_algorithms() if get_algorithm(n).extra_state is not Method.extra_state]


@pytest.mark.parametrize("name", STATEFUL)
def test_every_saved_item_matters(make_node, name):
    """The control of the tests above: each item of ``extra_state`` changes what the method
    does when it is replaced by a fresh method's value (as if it were not saved), at some
    point of a round with some knob set. So the comparisons above can fail, and nothing is
    saved for nothing."""
    keys: set[str] | None = None
    mattered: set[str] = set()
    for params in VARIANTS[name]:
        fresh = roundtrip(make_node(name, params, "a").checkpoint())["extra"]
        if not fresh:  # a knob set that keeps nothing (FedAvg without server_opt)
            continue
        nodes, server = setup_swarm(make_node, name, params)
        first, second = next_round_inputs(nodes, server)
        for cut in range(len(round_steps(nodes["a"]))):
            a, r = replay(nodes["a"], first, cut)
            ckpt = roundtrip(a.checkpoint())
            keys = set(ckpt["extra"]) if keys is None else keys
            assert keys and set(ckpt["extra"]) == keys
            rng_state = copy.deepcopy(a.ctx.rng.bit_generator.state)
            r_at_cut = copy.deepcopy(r)
            out_a = [encode(x) for x in continue_node(a, r, cut, second)]
            for key in sorted(keys - mattered):
                forged = copy.deepcopy(ckpt)
                forged["extra"][key] = copy.deepcopy(fresh[key])
                twin = restored(make_node, a, forged, rng_state)
                out_twin = continue_node(twin, copy.deepcopy(r_at_cut), cut, second)
                if [encode(x) for x in out_twin] != out_a:
                    mattered.add(key)
    assert keys is not None
    assert mattered == keys, f"{name}: never mattered: {sorted(keys - mattered)}"


# ----------------------------------------------------------------------------- bad content


def weights_of(m: Method) -> bytes:
    return encode(m.model_state())


def perturbed(ckpt: dict[str, Any]) -> dict[str, Any]:
    """``ckpt`` with other (valid) weights, so a refused restore shows if it left them."""
    out = copy.deepcopy(ckpt)
    for v in out["model"].values():
        if v.is_floating_point():
            v.add_(1.0)
    return out


def first_param_key(m: Method) -> str:
    return next(iter(dict(m.model.named_parameters())))


@pytest.mark.parametrize("name", known_algorithms())
def test_restore_names_the_mismatched_tensor(make_node, name):
    nodes, _ = setup_swarm(make_node, name, {})
    ckpt = roundtrip(nodes["a"].checkpoint())
    key = first_param_key(nodes["a"])
    fresh = make_node(name, {}, "a")
    before = weights_of(fresh)

    missing = perturbed(ckpt)
    del missing["model"][key]
    with pytest.raises(ValueError, match=rf"checkpoint model: keys differ \(missing \['{key}'\]"):
        fresh.restore(missing)

    unknown = perturbed(ckpt)
    unknown["model"]["h.extra.weight"] = torch.zeros(2)
    with pytest.raises(ValueError, match=r"extra \['h.extra.weight'\]"):
        fresh.restore(unknown)

    wrong_shape = perturbed(ckpt)
    wrong_shape["model"][key] = torch.zeros(*wrong_shape["model"][key].shape, 2)
    with pytest.raises(ValueError, match=rf"tensor '{key}' does not match \(shape"):
        fresh.restore(wrong_shape)

    wrong_dtype = perturbed(ckpt)
    wrong_dtype["model"][key] = wrong_dtype["model"][key].double()
    with pytest.raises(ValueError, match=rf"tensor '{key}' does not match \(dtype"):
        fresh.restore(wrong_dtype)

    not_tensor = perturbed(ckpt)
    not_tensor["model"][key] = [1.0, 2.0]
    with pytest.raises(ValueError, match=rf"tensor '{key}' does not match \(not a tensor\)"):
        fresh.restore(not_tensor)

    assert weights_of(fresh) == before  # every refusal left the method as built
    fresh.restore(ckpt)  # and it still takes the good checkpoint
    assert weights_of(fresh) == weights_of(nodes["a"])


@pytest.mark.parametrize("name", known_algorithms())
def test_restore_refuses_foreign_content(make_node, name):
    nodes, _ = setup_swarm(make_node, name, {})
    ckpt = perturbed(roundtrip(nodes["a"].checkpoint()))
    fresh = make_node(name, {}, "a")
    before = weights_of(fresh)
    cases = [
        ([1, 2], r"checkpoint: expected a map, got list"),
        ({"model": ckpt["model"]}, r"checkpoint: keys \['model'\], expected"),
        ({**ckpt, "rng": 1}, r"checkpoint: keys \['extra', 'model', 'rng'\]"),
        ({**ckpt, "model": [1]}, r"checkpoint model: not a map"),
        ({**ckpt, "extra": None}, r"checkpoint extra: expected a map, got NoneType"),
        (
            {**ckpt, "extra": {**ckpt["extra"], "bogus": 1}},
            rf"{name} checkpoint extra: keys differ",
        ),
    ]
    for bad, match in cases:
        with pytest.raises(ValueError, match=match):
            fresh.restore(copy.deepcopy(bad))
    assert weights_of(fresh) == before


def test_restore_refuses_another_methods_state(make_node):
    """Two methods on the same model: the weights fit, the extra state does not."""
    dfedavgm = make_node("dfedavgm", {}, "a")
    fake_train = {k: v + 1.0 for k, v in dfedavgm.model_state().items()}
    dfedavgm.model.load_state_dict(fake_train)  # now x differs from the model: it is saved
    ckpt = roundtrip(dfedavgm.checkpoint())
    assert ckpt["extra"]["x"] is not None
    for other in ("fedavg", "local", "uapdfl", "dispfl", "diversifed"):
        with pytest.raises(ValueError, match=rf"{other} checkpoint extra: keys differ"):
            make_node(other, {}, "a").restore(ckpt)


def bad_extra_cases():
    """``(method, change to the saved extra state, expected message)``."""
    t = torch.tensor
    return [
        (
            "uapdfl",
            lambda e: e.update(I=t([0.5, 0.5])),
            r"uapdfl checkpoint I: .* shape \(2,\)",
        ),
        (
            "uapdfl",
            lambda e: e.update(A=e["A"].double()),
            r"uapdfl checkpoint A: torch.float64",
        ),
        ("uapdfl", lambda e: e.update(A_avg=[0.0]), r"A_avg: expected a tensor, got list"),
        ("uapdfl", lambda e: e.update(I_pre=t([1.0])), r"uapdfl checkpoint I_pre"),
        ("uapdfl", lambda e: e.update(drift="0.1"), r"uapdfl checkpoint drift: '0.1'"),
        ("uapdfl", lambda e: e.update(drift=True), r"uapdfl checkpoint drift: True"),
        ("uapdfl", lambda e: e.update(dropout_peer=3), r"dropout_peer: 3 is not a str"),
        ("uapdfl", lambda e: e.pop("drift"), r"keys differ \(missing \['drift'\]"),
        (
            "dfedavgm",
            lambda e: e.update(x={"h.weight": t([1.0])}),
            r"dfedavgm checkpoint x: keys differ",
        ),
        (
            "dispfl",
            lambda e: e["masks"].pop("h.weight"),
            r"dispfl checkpoint masks: keys differ \(missing \['h.weight'\]",
        ),
        (
            "dispfl",
            lambda e: e["masks"]["h.weight"].fill_(False),
            r"mask 'h.weight': 0 active elements, expected \d+ \(another density\?\)",
        ),
        (
            "dispfl",
            lambda e: e["masks"].update({"h.weight": e["masks"]["h.weight"].to(torch.uint8)}),
            r"mask 'h.weight': torch.uint8",
        ),
        ("dispfl", lambda e: e.update(gen=e["gen"][:-1]), r"dispfl checkpoint gen: .* shape"),
        ("dispfl", lambda e: e.update(gen=e["gen"].float()), r"gen: torch.float32"),
        ("dispfl", lambda e: e.update(round_no=-1), r"round_no: -1 is not an int >= 0"),
        ("dispfl", lambda e: e.update(round_no="2"), r"round_no: '2' is not an int"),
        ("dispfl", lambda e: e.update(grad_sum=[]), r"grad_sum: expected a map"),
        (
            "dispfl",
            lambda e: e.update(grad_sum={"h.bias": t([1.0, 2.0, 3.0])}),
            r"grad_sum: 'h.bias' is not a masked tensor",
        ),
        (
            "dispfl",
            lambda e: e.update(grad_sum={"h.weight": t([1.0])}),
            r"grad_sum 'h.weight': .* shape \(1,\)",
        ),
        (
            "diversifed",
            lambda e: e["target"].pop("h.bias"),
            r"diversifed checkpoint target: keys differ \(missing \['h.bias'\]",
        ),
        (
            "diversifed",
            lambda e: e.update(target=[]),
            r"diversifed checkpoint target: not a map",
        ),
    ]


@pytest.mark.parametrize(
    ("name", "change", "match"),
    [pytest.param(*case, id=f"{case[0]}-{i}") for i, case in enumerate(bad_extra_cases())],
)
def test_restore_refuses_bad_extra_state_and_keeps_the_method(make_node, name, change, match):
    nodes, _ = setup_swarm(make_node, name, {})
    ckpt = perturbed(roundtrip(nodes["a"].checkpoint()))
    change(ckpt["extra"])
    fresh = make_node(name, {}, "a")
    before = encode(fresh.checkpoint())
    with pytest.raises(ValueError, match=match):
        fresh.restore(ckpt)
    assert encode(fresh.checkpoint()) == before  # weights put back, extra state untouched


@pytest.mark.parametrize("name", known_algorithms())
def test_checkpoint_is_a_detached_cpu_copy(make_node, name):
    """Later rounds do not change a checkpoint taken earlier, and it holds only what the
    codec encodes (CPU tensors without autograd history)."""
    nodes, server = setup_swarm(make_node, name, {})
    ckpt = nodes["a"].checkpoint()
    data = encode(ckpt)

    def tensors(obj):
        if isinstance(obj, torch.Tensor):
            yield obj
        elif isinstance(obj, dict):
            for v in obj.values():
                yield from tensors(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                yield from tensors(v)

    assert all(t.device.type == "cpu" and not t.requires_grad for t in tensors(ckpt))
    first, second = next_round_inputs(nodes, server)
    continue_node(nodes["a"], first, 0, second)
    assert encode(ckpt) == data
    assert encode(nodes["a"].checkpoint()) != data  # the rounds did change the method


def test_dfedavgm_saves_x_only_when_it_is_not_the_model(make_node):
    """Between rounds ``x`` is the model (one copy of the weights in the checkpoint); after
    training, before the merge, it is saved and restored."""
    nodes, server = setup_swarm(make_node, "dfedavgm", {"mixing": "deltas"})
    a = nodes["a"]
    assert a.checkpoint()["extra"] == {"x": None}
    first, _ = next_round_inputs(nodes, server)
    a, _ = replay(a, first, 1)  # trained: x is where the training started
    x = a.checkpoint()["extra"]["x"]
    assert x is not None and encode(x) == encode(a.x)
    b = restored(make_node, a, roundtrip(a.checkpoint()))
    assert encode(b.x) == encode(a.x)


def test_model_state_is_copied_once_per_state_of_the_model(make_node):
    """A round's snapshot, rollback point and checkpoint share one copy while the model is
    unchanged; training, a load or model_changed (a change torch's versions do not show)
    each make the next call copy the model as it now is, and no earlier copy moves."""
    m = make_node("uapdfl", {}, "a")
    first = m.model_state()
    again = m.checkpoint()["model"]
    assert again is not first and all(again[k] is first[k] for k in first)
    kept = {k: v.clone() for k, v in first.items()}
    x, y = node_data("a")
    train_local(m.model, x, y, CFG, 0.1, seed=0)
    trained = m.model_state()
    live = m.model.state_dict()
    assert all(torch.equal(trained[k], live[k]) for k in live)
    assert any(not torch.equal(trained[k], kept[k]) for k in kept)
    assert all(torch.equal(first[k], kept[k]) for k in kept)  # the old copy did not move
    m.model.load_state_dict(kept)
    assert all(torch.equal(m.model_state()[k], kept[k]) for k in kept)
    p = next(iter(m.model.parameters()))
    p.data = p.data + 1.0  # no version moves: the node says so
    m.model_changed()
    assert torch.equal(m.model_state()[next(iter(live))], p.detach())
