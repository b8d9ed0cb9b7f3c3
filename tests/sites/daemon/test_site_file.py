"""A site's own file (:mod:`p2pfl.sites.daemon.site_file`): paths resolve against its folder, the
policy comes inline or from a file, and a mistake names the file and the field."""

from __future__ import annotations

import os

import pytest

from p2pfl.errors import ConfigError
from p2pfl.sites.daemon.site_file import load_site
from p2pfl.sites.policy.rules import policy_digest

SITE = """
site: hospital-a
swarm: hospitals
broker: 127.0.0.1:18830
state_dir: state
data:
  ward:
    name: csv
    root: data/ward.csv
    label: outcome
limits: {max_concurrent_runs: 2}
observability: {listen: 127.0.0.1:9464, log_format: json}
"""


def _write(folder, text: str, name: str = "site.yaml"):
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(text)
    return path


def test_a_site_file_resolves_its_paths_against_its_folder(tmp_path, monkeypatch):
    path = _write(tmp_path / "etc", SITE + "policy: policy.yaml\n")
    _write(tmp_path / "etc", "methods: {allow: [fedavg]}\napprove: manual\n", "policy.yaml")
    monkeypatch.chdir(tmp_path)
    site = load_site("etc/site.yaml")
    assert site.state_dir == str(tmp_path / "etc" / "state")
    assert site.data["ward"].root == str(tmp_path / "etc" / "data" / "ward.csv")
    assert site.data["ward"].label == "outcome"
    assert site.policy.methods.allow == ["fedavg"] and site.policy.approve == "manual"
    assert site.limits.max_concurrent_runs == 2 and site.observability.log_format == "json"
    assert site.path_note("data.ward.root")  # where it was resolved from, for errors
    assert path.exists()


def test_an_inline_policy_and_a_policy_file_give_one_digest(tmp_path):
    inline = load_site(_write(tmp_path / "a", SITE + "policy: {methods: {allow: [fedavg]}}\n"))
    _write(tmp_path / "b", "methods:\n  allow: [fedavg]\n", "policy.yaml")
    named = load_site(_write(tmp_path / "b", SITE + "policy: policy.yaml\n"))
    assert policy_digest(inline.policy) == policy_digest(named.policy)


@pytest.mark.parametrize(
    "extra, where, words",
    [
        ("polcy: {}\n", "polcy", "did you mean 'policy'"),
        ("limits: {max_concurrent_runs: 0}\n", "limits.max_concurrent_runs", "greater than 0"),
        ("policy: {approve: sometimes}\n", "policy.approve", "auto"),
        ("serving: {cpus: '3-1'}\n", "serving.cpus", "runs backwards"),
        ("serving: {cpus: [0, 0]}\n", "serving.cpus", "names a CPU twice"),
        ("serving: {cpus: [4095]}\n", "serving.cpus", "CPU 4095 is not one this machine"),
    ],
)
def test_a_mistake_names_the_file_and_the_field(tmp_path, extra, where, words):
    path = _write(tmp_path, SITE + extra)
    with pytest.raises(ConfigError) as err:
        load_site(path)
    assert str(path) in str(err.value) and where in str(err.value) and words in str(err.value)


def test_cpu_sets_are_read_as_linux_writes_them(tmp_path):
    """``limits.worker_cpus`` and ``serving.cpus``: a cpulist string or a list of CPUs,
    each one this process may use; absent, nothing is pinned."""
    cpu = min(os.sched_getaffinity(0))
    text = SITE.replace("{max_concurrent_runs: 2}", f"{{worker_cpus: '{cpu}'}}")
    site = load_site(_write(tmp_path, text + f"serving: {{cpus: [{cpu}]}}\n"))
    assert site.limits.worker_cpus == [cpu] and site.serving.cpus == [cpu]
    plain = load_site(_write(tmp_path / "plain", SITE))
    assert plain.limits.worker_cpus is None and plain.serving.cpus is None


def test_a_bad_broker_or_listen_address_is_refused(tmp_path):
    text = SITE.replace("127.0.0.1:18830", "somewhere").replace("127.0.0.1:9464", "nowhere")
    with pytest.raises(ConfigError) as err:
        load_site(_write(tmp_path, text))
    assert "broker must be 'host:port', 'mdns' or 'embedded'" in str(err.value)
    assert "listen must be 'host:port'" in str(err.value)
    assert load_site(_write(tmp_path / "e", SITE.replace("127.0.0.1:18830", "embedded")))


def test_a_policy_files_mistake_names_the_policy_file(tmp_path):
    _write(tmp_path, "resources: {max_round: 3}\n", "policy.yaml")
    with pytest.raises(ConfigError) as err:
        load_site(_write(tmp_path, SITE + "policy: policy.yaml\n"))
    text = str(err.value)
    assert str(tmp_path / "policy.yaml") in text and "resources.max_round" in text
    assert "did you mean 'max_rounds'" in text


def test_a_site_needs_its_name_swarm_and_state_dir(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_site(_write(tmp_path, "data: {}\n"))
    text = str(err.value)
    assert "site" in text and "swarm" in text and "state_dir" in text
