"""The pieces of a series (docs/design.md, "Series"): cycle specs and their ids, data
versions of a watched binding, held-out rows drawn by row hash, standing acceptance, and
the warm start a cycle takes from the site's last promoted model."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from daemon_helpers import Site, wait
from daemon_helpers import spec as spec_body
from PIL import Image

from p2pfl.errors import ConfigError
from p2pfl.learning.own_tables import split_by_row_hash
from p2pfl.sites.consent.run_spec import (
    canonical,
    cycle_rounds,
    cycle_spec,
    run_id,
    series_id,
    spec_from_dict,
)
from p2pfl.sites.consent.run_state import RunState
from p2pfl.sites.policy.rules import Decision
from p2pfl.sites.runs.data_version import DataVersionError, data_version
from p2pfl.sites.runs.series import SeriesCycles, proposer_order, refused_proposers

SERIES = {"on_new_data": {"min_new": 20}, "rounds": 1}


def test_cycles_have_their_own_ids_derived_from_the_series():
    first = spec_from_dict(spec_body(series=SERIES))
    second = cycle_spec(first, 2)
    assert first.series.cycle == 1 and second.series.cycle == 2
    assert run_id(second) != run_id(first)
    assert series_id(first) == series_id(second) == run_id(first)
    assert run_id(cycle_spec(first, 2)) == run_id(second)  # any site derives the same
    assert cycle_rounds(first) == 2 and cycle_rounds(second) == 1  # series.rounds after the first


def test_a_spec_without_a_series_keeps_its_run_id():
    plain = spec_from_dict(spec_body())
    data = plain.model_dump(mode="json")
    # the fields added since specs were first hashed (series, retry, model.init), unset
    assert data.pop("series") is None and data.pop("retry") is None
    assert data["model"].pop("init") is None
    old = hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode())
    assert run_id(plain) == old.hexdigest()[:16]
    assert '"series"' not in canonical(plain) and series_id(plain) is None
    assert '"retry"' not in canonical(plain)


@pytest.mark.parametrize(
    ("over", "error"),
    [
        ({"series": {"rounds": 2}}, "a series needs every_s, on_new_data, or both"),
        ({"series": {"every_s": 1}}, "series.every_s"),
        ({"series": {"on_new_data": {"min_new": 0}}}, "min_new"),
        ({"series": {"every_s": 60, "warm_start": "hot"}}, "warm_start"),
        ({"model": {"name": "mlp", "init": "/etc/passwd"}}, "model.init: a device's own file"),
    ],
)
def test_bad_series_and_device_fields_are_refused(over, error):
    with pytest.raises(ConfigError, match=error):
        spec_from_dict(spec_body(**over), "run.yaml")


def test_data_version_of_a_csv_and_of_an_image_folder(tmp_path):
    csv = tmp_path / "ward.csv"
    pd.DataFrame({"a": [1, 2, 3], "y": [0, 1, 0]}).to_csv(csv, index=False)
    one = data_version(csv)
    assert one.rows == 3 and len(one.version) == 16
    assert data_version(csv) == one  # the same bytes, the same version
    with open(csv, "a") as f:
        f.write("4,1\n5,0")  # the last line without its newline counts too
    two = data_version(csv)
    assert two.rows == 5 and two.version != one.version

    folder = tmp_path / "images"
    for rel in ("cat/1.png", "dog/2.png", ".hidden/3.png"):
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.zeros((4, 4), np.uint8)).save(folder / rel)
    (folder / "notes.txt").write_text("not counted")
    three = data_version(folder)
    assert three.rows == 2
    (folder / "cat" / "1.png").rename(folder / "dog" / "1.png")  # a moved file: another version
    assert data_version(folder).version != three.version
    with pytest.raises(DataVersionError, match="no such file"):
        data_version(tmp_path / "missing.csv")


def test_held_out_rows_by_row_hash_stay_held_out_as_the_file_grows():
    rng = np.random.default_rng(0)
    old = rng.normal(size=(400, 5))
    train, test = split_by_row_hash(old, 0.25)
    assert 0.18 < len(test) / len(old) < 0.32 and len(train) + len(test) == len(old)
    grown = np.concatenate([old, rng.normal(size=(300, 5))])
    train2, test2 = split_by_row_hash(grown, 0.25)
    assert set(test2[test2 < 400]) == set(test) and set(train2[train2 < 400]) == set(train)
    # two rows: one on each side, whatever their hashes
    assert [len(s) for s in split_by_row_hash(old[:2], 0.01)] == [1, 1]
    assert [len(s) for s in split_by_row_hash(old[:2], 0.99)] == [1, 1]


class _Context:
    """What the series part reads of its daemon's context, over hand-made runs: every run
    ended, and what it publishes recorded."""

    def __init__(self, name: str, runs: list[RunState]):
        self.name = name
        self.runs = {st.run_id: st for st in runs}
        self.published: list[tuple[str, str, dict]] = []

    def final(self, st: RunState) -> bool:
        return True

    def publish(self, kind: str, run: str, body: dict) -> None:
        self.published.append((kind, run, body))

    def spawn(self, st, coro) -> None:
        assert coro is None  # publish above records at once


def _Daemon(runs: list[RunState], name: str = "a") -> SeriesCycles:
    """The series part of site ``name``'s daemon over hand-made runs."""
    return SeriesCycles(_Context(name, runs))  # type: ignore[arg-type]


def _cycle(k: int, vote: dict | None) -> RunState:
    spec = cycle_spec(spec_from_dict(spec_body(series=SERIES)), k)
    st = RunState(run_id(spec), spec, "b", 0.0)
    if vote is not None:
        st.votes["a"] = vote
    return st


def test_standing_acceptance_holds_only_while_the_policy_is_unchanged():
    pending = Decision("pending", (), "digest-1")
    first = _cycle(1, {"vote": "accept", "policy": "digest-1"})
    second = _cycle(2, None)
    daemon = _Daemon([first, second])
    assert daemon.standing(second, pending).vote == "accept"
    changed = Decision("pending", (), "digest-2")  # the site's policy changed: it votes again
    assert daemon.standing(second, changed).vote == "pending"
    assert daemon.standing(first, pending).vote == "pending"  # the first cycle: asked
    rejected = _Daemon([_cycle(1, {"vote": "reject", "policy": "digest-1"}), second])
    assert rejected.standing(second, pending).vote == "pending"
    refused = Decision("reject", (), "digest-1")  # a policy that rejects still rejects
    assert daemon.standing(second, refused).vote == "reject"


def test_new_rows_are_counted_from_what_the_last_cycle_trained_on():
    daemon = _Daemon([])
    daemon.data_reports[("s", "b")] = {"rows": 130, "trained": 100}
    daemon.data_reports[("s", "c")] = {"rows": 90, "trained": None}
    assert daemon.new_rows("s", "b") == 30
    assert daemon.new_rows("s", "c") == 90
    assert daemon.new_rows("s", "d") == 0


def test_warm_start_loads_the_whole_model_or_names_the_field(tmp_path):
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "export"))
    from export_helpers import make_run

    from p2pfl.algorithms import get_algorithm
    from p2pfl.algorithms.build import build_node_model, warm_start
    from p2pfl.learning.artifacts import weights_path

    run = make_run(tmp_path / "r", input_shape=(3,), num_classes=3)
    fresh = build_node_model(get_algorithm(run.cfg.algorithm.name), run.cfg, 3, (3,))
    warm_start(fresh, str(weights_path(run.dir, "a")), "topology.yaml")
    want = run.models["a"].state_dict()
    for name, tensor in fresh.export_module().state_dict().items():
        assert np.array_equal(tensor.numpy(), want[name].numpy()), name  # g and h alike
    other = build_node_model(get_algorithm(run.cfg.algorithm.name), run.cfg, 4, (3,))
    with pytest.raises(ConfigError, match="model.init.*do not fit"):
        warm_start(other, str(weights_path(run.dir, "a")), "topology.yaml")
    with pytest.raises(ConfigError, match="model.init.*not a readable safetensors"):
        warm_start(other, str(tmp_path / "none.safetensors"), "topology.yaml")


def _Proposer(name: str, runs: list[RunState]) -> SeriesCycles:
    """A member of the series' last cycle, every cycle ended, recording what it publishes
    (``.ctx.published``)."""
    return _Daemon(runs, name)


def _ended_cycle(series: dict, ago_s: float) -> RunState:
    """Cycle 1 of ``series`` committed with a and b, its vote deadline ``ago_s`` ago."""
    import time

    spec = spec_from_dict(spec_body(series=series, vote_deadline_s=6))
    st = RunState(run_id(spec), spec, "a", time.time() - 6 - ago_s)
    st.members = ("a", "b")
    return st


def test_the_next_cycle_is_proposed_on_schedule_by_the_first_in_turn():
    series = {"every_s": 60}
    not_yet = _Proposer("a", [_ended_cycle(series, 59)])
    not_yet._next_cycle(*next(iter(not_yet._cycles().items())))
    assert not_yet.ctx.published == []
    first, second = (_Proposer(n, [_ended_cycle(series, 61)]) for n in ("a", "b"))
    for member in (first, second):
        member._next_cycle(*next(iter(member._cycles().items())))
    [(kind, rid, body)] = first.ctx.published
    cycle = spec_from_dict(body["spec"])
    assert kind == "spec" and cycle.series.cycle == 2 and run_id(cycle) == rid
    assert second.ctx.published == []  # its turn comes one grace period later


def test_the_next_cycle_is_due_when_enough_members_report_new_rows():
    series = {"on_new_data": {"min_new": 30}}
    member = _Proposer("a", [_ended_cycle(series, 1)])
    sid, cycles = next(iter(member._cycles().items()))
    member.data_reports[(sid, "a")] = {"rows": 200, "trained": 160}
    member.data_reports[(sid, "b")] = {"rows": 170, "trained": 160}  # 10 new: too few
    member._next_cycle(sid, cycles)
    assert member.ctx.published == []  # one member of the two min_accept asks
    member.data_reports[(sid, "b")] = {"rows": 190, "trained": 160}
    member._next_cycle(sid, cycles)
    assert [spec_from_dict(b["spec"]).series.cycle for _, _, b in member.ctx.published] == [2]
    member._next_cycle(sid, cycles)
    assert len(member.ctx.published) == 1  # proposed once


def _refused_cycle(first: RunState, proposer: str, code: str, ago_s: float) -> RunState:
    """Cycle 2 of ``first``'s series proposed by ``proposer``, aborted (no commit) ``ago_s``
    after it was proposed: a's and b's votes reject it with ``code``."""
    import time

    spec = cycle_spec(first.spec, 2)
    st = RunState(run_id(spec), spec, proposer, time.time() - ago_s)
    for site in ("a", "b"):
        st.votes[site] = {"vote": "reject", "reasons": [{"code": code, "detail": "..."}]}
    return st


def test_a_proposer_refused_steps_aside_and_the_cycle_is_proposed_again_at_once():
    """Members a, b, c; c proposed cycle 2 and a and b refused it as proposer: cycle 3 is
    proposed at once (not one deadline or period later) by a, the first in turn once c is
    moved to the back; c proposes only after the others' turns."""
    series = {"every_s": 3600}
    first = _ended_cycle(series, 61)
    first.members = ("a", "b", "c")
    second = _refused_cycle(first, "c", "proposer_not_allowed", 3)  # deadline 3 s away
    assert refused_proposers({1: first, 2: second}) == {"c": 2}
    assert proposer_order(["a", "b", "c"], 3, {"c": 2}) == ["a", "b", "c"]
    assert proposer_order(["a", "b", "c"], 2, {"c": 2}) == ["a", "b", "c"]  # c was first
    assert proposer_order(["a", "b", "c"], 4, {"c": 2}) == ["b", "a", "c"]
    sites = {n: _Proposer(n, [first, second]) for n in ("a", "b", "c")}
    for site in sites.values():
        site._next_cycle(*next(iter(site._cycles().items())))
    [(kind, rid, body)] = sites["a"].ctx.published
    assert spec_from_dict(body["spec"]).series.cycle == 3 and rid == run_id(
        cycle_spec(first.spec, 3)
    )
    assert sites["b"].ctx.published == sites["c"].ctx.published == []  # their turns come later


def test_a_cycle_refused_for_another_reason_is_not_proposed_again_before_its_deadline():
    series = {"on_new_data": {"min_new": 30}}
    first = _ended_cycle(series, 61)
    second = _refused_cycle(first, "a", "too_many_rounds", 3)  # aborted before its deadline
    member = _Proposer("b", [first, second])  # the first in turn for cycle 3
    sid, cycles = next(iter(member._cycles().items()))
    for site in ("a", "b"):
        member.data_reports[(sid, site)] = {"rows": 200, "trained": 160}  # still new
    member._next_cycle(sid, cycles)
    assert member.ctx.published == []  # the refusal does not loop faster than its deadline
    second.proposed_ts -= 10  # its deadline passed
    member._next_cycle(sid, cycles)
    assert [spec_from_dict(b["spec"]).series.cycle for _, _, b in member.ctx.published] == [3]


def test_a_site_refused_in_its_latest_proposal_only_is_refused():
    series = {"every_s": 3600}
    first = _ended_cycle(series, 61)
    second = _refused_cycle(first, "b", "proposer_not_allowed", 100)
    third = _refused_cycle(first, "b", "too_many_rounds", 50)  # a policy changed since
    third.spec = cycle_spec(first.spec, 3)
    assert refused_proposers({1: first, 2: second}) == {"b": 2}
    assert refused_proposers({1: first, 2: second, 3: third}) == {}
    unasked = _refused_cycle(first, "b", "proposer_not_allowed", 100)
    unasked.spec = unasked.spec.model_copy(update={"members": ["c", "d"]})
    assert refused_proposers({1: first, 2: unasked}) == {}  # a and b were not asked


@pytest.mark.one_broker  # the daemons' MQTT use is the nodes'; Mosquitto only
def test_only_the_allowed_site_proposes_after_one_refusal(tmp_path, broker):
    """Sites a and b; both policies let only b propose. b submits cycle 1; cycle 2 falls to
    a in turn: b (and a itself) refuse it as proposer, a aborts it as soon as the quorum
    is out of reach (long before its deadline) and b takes that abort; cycle 3 follows at
    once, proposed by b, and trains; cycle 4, a's turn again, is b's too."""
    policy = {"proposers": ["b"]}
    sites = [Site(tmp_path, n, broker.address, policy) for n in ("a", "b")]
    try:
        a, b = (site.start() for site in sites)
        body = spec_body(
            "steady",
            rounds=1,
            members=["a", "b"],
            vote_deadline_s=10,
            series={"every_s": 10, "rounds": 1, "warm_start": "fresh"},
        )
        first = b.ask("submit", spec=body)["run_id"]
        for site in sites:
            site.wait_status(first, {"finished"}, 120)
        second = _cycle_at(a, 2, 120)
        assert second["proposer"] == "a"
        for site in sites:
            run = site.wait_status(second["run_id"], {"aborted"}, 30)
            assert "before the deadline" in run["why"] and "may accept, 2 needed" in run["why"]
            assert run["votes"]["b"]["reasons"][0]["code"] == "proposer_not_allowed"
            assert "early_commit" not in site.ask("status")["dropped"]
        third = _cycle_at(b, 3, 30)
        assert third["proposer"] == "b"
        for site in sites:
            assert site.wait_status(third["run_id"], {"finished"}, 120)["members"] == ["a", "b"]
        assert _cycle_at(b, 4, 60)["proposer"] == "b"  # a, first in turn, stepped aside
        assert [run["proposer"] for run in b.runs().values()].count("a") == 1
    finally:
        for site in sites:
            site.stop()


def _cycle_at(site: Site, cycle: int, timeout: float) -> dict:
    """The run of the series' ``cycle`` at ``site``, once it knows it."""

    def find() -> dict | None:
        return next((r for r in site.runs().values() if r["cycle"] == cycle), None)

    wait(find, timeout, f"cycle {cycle} at {site.name}", lambda: site.log()[-3000:])
    run = find()
    assert run is not None
    return run
