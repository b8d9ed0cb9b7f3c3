"""A site's data bindings checked before it consents (:mod:`p2pfl.sites.policy.binding_check`):
the rules the worker's readers apply, without torch; a problem names the binding's field
and the file; ``p2pfl validate --site`` says it and exits 2; the vote refuses a run on a
binding that cannot serve it (``binding_invalid``)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from daemon_helpers import FEATURES, csv_binding, p2pfl_cli, patients

from p2pfl.config.schema import TopologyConfig
from p2pfl.learning import own_rules
from p2pfl.learning.own_rules import DatasetError, frame_xy, map_labels, read_frame
from p2pfl.sites.consent.run_spec import RunSpec
from p2pfl.sites.daemon.site_file import SiteBinding, load_site
from p2pfl.sites.policy.binding_check import binding_mark, check_binding
from p2pfl.sites.policy.binding_watch import LogLimit
from p2pfl.sites.policy.rules import REASON_CODES, Policy, RunFacts, decide
from p2pfl.sites.runs.topology import worker_topology

README = Path(__file__).resolve().parents[3] / "README.md"


def _binding(**fields) -> SiteBinding:
    return SiteBinding.model_validate(fields)


def _csv(tmp_path: Path, rows: int = 40, name: str = "ward.csv") -> Path:
    path = tmp_path / name
    patients(rows, seed=0).to_csv(path, index=False)
    return path


def test_a_good_csv_binding_passes_with_what_it_holds(tmp_path):
    check = check_binding("ward", _binding(**csv_binding(_csv(tmp_path))), "a")
    assert check.ok and check.checked, check.problems
    assert "40 rows, 4 features, label 'outcome'" in check.summary
    assert re.search(r"classes good \d+, bad \d+", check.summary)


def test_a_label_typo_names_the_field_the_file_and_the_nearest_column(tmp_path):
    path = _csv(tmp_path)
    check = check_binding("ward", _binding(**csv_binding(path, label="outcme")), "a")
    (problem,) = check.problems
    assert check.where(problem) == "data.ward.label"
    assert str(path) in problem.message and "no label column 'outcme'" in problem.message
    assert "did you mean 'outcome'?" in problem.message
    assert check.text().startswith("data.ward.label: ")


def test_a_missing_file_and_missing_classes_are_both_said(tmp_path):
    body = {"name": "csv", "root": str(tmp_path / "gone.csv"), "label": "outcome"}
    check = check_binding("gone", _binding(**body), "a")
    fields = [p.field for p in check.problems]
    assert fields == ["classes", "root"], check.problems
    assert f"{tmp_path / 'gone.csv'} does not exist" in check.problems[1].message


def test_a_site_csv_reads_whole_unless_it_says_otherwise(tmp_path):
    assert _binding(name="csv", root="x.csv").partition == "none"
    assert _binding(name="parquet").partition == "none"
    assert _binding(name="imagefolder").partition == "none"
    assert _binding(name="pkg.mod:load").partition == "none"
    assert _binding(name="synthetic").partition == "dirichlet(0.5)"  # a swarm's data: split
    check = check_binding("w", _binding(**csv_binding(_csv(tmp_path), partition="iid")), "a")
    assert [p.field for p in check.problems] == ["partition"]
    assert "read whole" in check.problems[0].message


@pytest.mark.parametrize(
    "damage",
    ["nan", "labels", "text"],
)
def test_a_table_read_by_chunks_says_what_the_whole_read_says(tmp_path, monkeypatch, damage):
    """The daemon reads a table a bounded number of rows at a time; its verdict and its
    words are those of the worker's rules over the whole file, however the damage spreads
    over the chunks."""
    df = patients(30, seed=1)
    if damage == "nan":
        df.loc[[2, 25], "f2"] = np.nan
        df.loc[17, "f4"] = np.inf
    elif damage == "labels":
        df.loc[[3, 28], "outcome"] = ["worse", "awful"]
    else:
        df["f3"] = df["f3"].astype(object)
        df.loc[22, "f3"] = "n/a"
    path = tmp_path / "ward.csv"
    df.to_csv(path, index=False)
    monkeypatch.setattr(own_rules, "CHUNK_ROWS", 7)
    check = check_binding("ward", _binding(**csv_binding(path)), "a")
    with pytest.raises(DatasetError) as whole:
        x, y, _ = frame_xy(read_frame("csv", path), "outcome", path, None)
        map_labels(y, ["good", "bad"], str(path))
    (problem,) = check.problems
    assert problem.message == str(whole.value)
    assert problem.field == whole.value.field.removeprefix("dataset.")


def test_a_folder_of_parquet_files_and_its_stats(tmp_path):
    folder = tmp_path / "ward"
    folder.mkdir()
    patients(30, seed=2).to_parquet(folder / "train.parquet")
    patients(10, seed=3).to_parquet(folder / "test.parquet")
    stats = tmp_path / "stats.json"
    stats.write_text(json.dumps({"mean": dict.fromkeys(FEATURES, 0), "std": {"f1": 1}}))
    body = csv_binding(folder, name="parquet", stats=str(stats))
    check = check_binding("ward", _binding(**body), "a")
    assert [p.field for p in check.problems] == ["stats"]
    assert "no std for column(s) f2, f3, f4" in check.problems[0].message
    stats.write_text(
        json.dumps({"mean": dict.fromkeys(FEATURES, 0), "std": dict.fromkeys(FEATURES, 1)})
    )
    check = check_binding("ward", _binding(**body), "a")
    assert check.ok and "10 test rows in test.parquet" in check.summary


def test_an_npz_binding(tmp_path):
    path = tmp_path / "d.npz"
    x = np.zeros((6, 3), np.float32)
    np.savez(path, x_train=x, y_train=np.array([0, 1, 2, 0, 1, 2]), x_test=x[:2], y_test=[0, 1])
    assert check_binding("d", _binding(name="npz", root=str(path), classes=3), "a").ok
    check = check_binding("d", _binding(name="npz", root=str(path), classes=2), "a")
    assert [p.field for p in check.problems] == ["classes"]
    assert "y_train: labels outside dataset.classes (labels 0..1): 2" in check.problems[0].message


def test_an_image_folders_class_folders_are_read_by_their_names(tmp_path):
    for cls in ("cat", "dog"):
        (tmp_path / "img" / cls).mkdir(parents=True)
        (tmp_path / "img" / cls / "1.png").write_bytes(b"not decoded here")
    root = str(tmp_path / "img")
    check = check_binding("img", _binding(name="imagefolder", root=root), "a")
    assert check.ok and "2 images, 2 class folders (cat, dog)" in check.summary
    check = check_binding(
        "img", _binding(name="imagefolder", root=root, classes=["cat", "cow"]), "a"
    )
    assert [p.field for p in check.problems] == ["classes"]
    assert "class folders not in dataset.classes" in check.problems[0].message
    assert "'dog'" in check.problems[0].message


def test_a_user_function_is_never_imported_here(tmp_path):
    check = check_binding("fn", _binding(name="no_such_module_here:load", classes=2), "a")
    assert check.ok and not check.checked and "not imported" in check.summary
    assert "no_such_module_here" not in sys.modules


def test_an_id_template_is_the_sites_name_and_the_mark_follows_the_file(tmp_path):
    _csv(tmp_path, name="a.csv")
    binding = _binding(**csv_binding(tmp_path / "{id}.csv"))
    assert check_binding("w", binding, "a").ok
    assert not check_binding("w", binding, "b").ok
    before = binding_mark(binding, "a")
    assert binding_mark(binding, "a") == before
    with open(tmp_path / "a.csv", "a") as f:
        f.write("1,2,3,4,good\n")
    assert binding_mark(binding, "a") != before


def test_the_vote_and_the_commit_refuse_a_binding_that_cannot_serve_a_run():
    assert "binding_invalid" in REASON_CODES
    run = RunFacts("a", "fedavg", frozenset({"whole_weights"}), "ward", 5, 2)
    problems = {"ward": "data.ward.label: /x.csv: no label column 'outcme'"}
    for stage in ("vote", "commit"):
        decision = decide(run, Policy(), bindings={"ward"}, stage=stage, binding_problems=problems)
        assert decision.vote == "reject"
        (reason,) = decision.reasons
        assert reason.code == "binding_invalid"
        assert "data binding 'ward'" in reason.detail and "data.ward.label" in reason.detail
    # a running worker holds its data: the rounds' check does not stop it for its files
    assert (
        decide(run, Policy(), bindings={"ward"}, stage="round", binding_problems=problems).vote
        == "accept"
    )
    other = {"other": "data.other.root: gone"}
    assert (
        decide(run, Policy(), bindings={"ward", "other"}, binding_problems=other).vote == "accept"
    )


def test_a_log_limit_says_a_message_once_a_minute_and_a_new_one_at_once():
    now = [0.0]
    limit = LogLimit(60.0, clock=lambda: now[0])
    assert limit.allows("b", "missing")
    now[0] = 30.0
    assert not limit.allows("b", "missing")
    assert limit.allows("b", "label typo")  # another problem: said at once
    now[0] = 91.0
    assert limit.allows("b", "label typo")


def _readme_site_file() -> dict:
    """The site file of README.md's "A standing federation", as written."""
    text = README.read_text()
    block = text.split("**The site file**", 1)[1].split("```yaml", 1)[1].split("```", 1)[0]
    return yaml.safe_load(block)


def test_the_readmes_site_binding_reads_its_csv_whole(tmp_path):
    """The README's binding has no partition: it validates, and the worker's topology
    reads the site's file whole (partition none)."""
    body = _readme_site_file()
    (name, binding), *_ = body["data"].items()
    assert "partition" not in binding
    df = patients(50, seed=4).rename(columns={"outcome": binding["label"]})
    classes = binding["classes"]
    df[binding["label"]] = np.where(df[binding["label"]] == "bad", classes[1], classes[0])
    df.to_csv(tmp_path / "ward.csv", index=False)
    site = {
        **{k: v for k, v in body.items() if k not in ("certs", "policy")},
        "state_dir": "state",
        "data": {name: {**binding, "root": "ward.csv"}},
    }
    (tmp_path / "site.yaml").write_text(yaml.safe_dump(site))
    cli = p2pfl_cli("validate", "--site", str(tmp_path / "site.yaml"))
    assert cli.returncode == 0, cli.stdout + cli.stderr
    assert f"data.{name}: csv {tmp_path / 'ward.csv'}: 50 rows" in cli.stderr
    loaded = load_site(tmp_path / "site.yaml")
    spec = RunSpec(name="r", data=name, algorithm={"name": "fedavg"}, model={"name": "mlp"})
    topo = worker_topology(
        spec,
        run_id="0123456789abcdef",
        site=loaded.site,
        members=[loaded.site, "b"],
        binding=loaded.data[name],
        broker="127.0.0.1:1883",
        certs=None,
        epsilon=None,
    )
    assert topo["dataset"]["partition"] == "none"
    assert TopologyConfig.model_validate(topo).dataset.own_data


def test_validate_site_names_the_file_and_field_and_imports_no_torch(tmp_path):
    path = _csv(tmp_path)
    site = {
        "site": "a",
        "swarm": "fed",
        "state_dir": "state",
        "data": {
            "ward": csv_binding(path, label="outcme"),
            "gone": csv_binding(tmp_path / "gone.csv"),
        },
    }
    site_file = tmp_path / "site.yaml"
    site_file.write_text(yaml.safe_dump(site))
    bad = p2pfl_cli("validate", "--site", str(site_file))
    assert bad.returncode == 2, bad.stdout + bad.stderr
    err = " ".join(bad.stderr.split())  # the console may wrap
    assert f"{site_file}: data.ward.label: {path}: no label column 'outcme'" in err
    assert "did you mean 'outcome'?" in err
    assert f"{site_file}: data.gone.root: {tmp_path / 'gone.csv'} does not exist" in err
    site["data"] = {"ward": csv_binding(path)}
    site["policy"] = {"methods": {"allow": ["fedavgg"]}, "data": {"ward": {"methods": ["ua"]}}}
    site_file.write_text(yaml.safe_dump(site))
    typo = p2pfl_cli("validate", "--site", str(site_file))
    err = " ".join(typo.stderr.split())
    assert typo.returncode == 2 and "unknown algorithm 'fedavgg' (did you mean 'fedavg'" in err
    assert f"{site_file}: policy.methods.allow: unknown algorithm 'fedavgg'" in err
    assert "policy.data.ward.methods: unknown algorithm 'ua'" in err
    site["policy"] = {"methods": {"allow": ["fedavg", "mypkg.mine:Mine"]}}
    site_file.write_text(yaml.safe_dump(site))
    code = (
        "import sys; from p2pfl.cli import main; "
        f"rc = main(['validate', '--site', {str(site_file)!r}]); "
        "print('torch' in sys.modules); sys.exit(rc)"
    )
    good = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert good.returncode == 0, good.stdout + good.stderr
    assert good.stdout.strip() == "False"  # no torch on this path
    assert "ok" in good.stderr and "data.ward: csv" in good.stderr and "40 rows" in good.stderr


def test_policy_check_says_the_binding_the_vote_would_refuse(tmp_path, capsys):
    from p2pfl.cli import main

    path = _csv(tmp_path)
    site = {"site": "a", "swarm": "fed", "state_dir": "state"}
    site["data"] = {"ward": csv_binding(path, label="outcme")}
    (tmp_path / "site.yaml").write_text(yaml.safe_dump(site))
    body = {"name": "r", "data": "ward", "algorithm": {"name": "fedavg"}, "model": {"name": "mlp"}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(body))
    args = ["policy", "check", str(tmp_path / "run.yaml"), "--site", str(tmp_path / "site.yaml")]
    assert main([*args, "--json"]) == 1
    decision = json.loads(capsys.readouterr().out)
    assert decision["vote"] == "reject"
    assert [r["code"] for r in decision["reasons"]] == ["binding_invalid"]
    assert "data.ward.label" in decision["reasons"][0]["detail"]
