"""Inputs that cannot work are reported before anything trains, naming file and field."""

from __future__ import annotations

import zipfile

import pytest
from imagefolder_zip import make_imagefolder_zip

from p2pfl.check.load import load_topology
from p2pfl.check.preflight import check_inputs
from p2pfl.errors import ConfigError


def _cfg(overrides):
    return load_topology("topologies/synthetic.yaml", overrides)


def test_synthetic_topology_passes():
    check_inputs(_cfg([]), source="synthetic.yaml")


@pytest.mark.parametrize(
    ("overrides", "field", "text"),
    [
        (
            ["dataset.name=fashionmnist", "dataset.root=/nonexistent/x"],
            "dataset.root",
            "does not exist",
        ),
        (["dataset.partition=pathological(9)"], "dataset.partition", "k must be in 1..4"),
        (
            ["dataset.input_shape=[1,2,2]"],
            "model.name",
            "cannot take synthetic inputs of shape [1, 2, 2]",
        ),
        (["dataset.min_samples=600"], "dataset.partition", "min_samples=600"),
    ],
)
def test_input_errors_name_the_file_and_field(overrides, field, text):
    with pytest.raises(ConfigError) as exc:
        check_inputs(_cfg(overrides), source="t.yaml")
    assert f"t.yaml: {field}: " in str(exc.value) and text in str(exc.value), str(exc.value)


def test_out_of_range_partition_arguments_fail_when_the_file_loads():
    for bad, text in [
        ("dirichlet(-1)", "ALPHA must be > 0"),
        ("groups(0,3,0.8)", ">= 1"),
        ("groups(3,3,1.5)", "FRACTION must be in [0, 1]"),
        ("pathological(0)", ">= 1"),
    ]:
        with pytest.raises(ConfigError) as exc:
            _cfg([f"dataset.partition={bad}"])
        assert "dataset.partition" in str(exc.value) and text in str(exc.value), str(exc.value)


def _imagefolder(root, cache):
    return _cfg(
        [
            "dataset.name=imagefolder",
            f"dataset.root={root}",
            "dataset.partition=iid",
            "dataset.min_samples=1",
            "model.name=mlp",
        ]
    ), cache


@pytest.mark.parametrize("damage", ["truncated", "corrupt_member", "not_an_image"])
def test_a_damaged_zip_names_the_zip_and_the_member(tmp_path, damage):
    src = tmp_path / "ds.zip"
    make_imagefolder_zip(src)
    if damage == "truncated":
        data = src.read_bytes()
        src.write_bytes(data[: len(data) // 2])
    else:
        with zipfile.ZipFile(src) as zf:
            items = [(i, zf.read(i.filename)) for i in zf.infolist()]
        with zipfile.ZipFile(src, "w") as zf:
            for info, data in items:
                if info.filename == "test/dog/1.png":
                    data = b"garbage, not a png" if damage == "not_an_image" else data
                zf.writestr(info, data)
        if damage == "corrupt_member":  # flip bytes inside the stored member's data
            raw = bytearray(src.read_bytes())
            with zipfile.ZipFile(src) as zf:
                info = zf.getinfo("test/dog/1.png")
            start = info.header_offset + 30 + len(info.filename) + 20
            raw[start : start + 8] = b"\xff" * 8
            src.write_bytes(bytes(raw))
    cfg, cache = _imagefolder(src, tmp_path / "cache")
    with pytest.raises(ConfigError) as exc:
        check_inputs(cfg, source="t.yaml", cache_dir=cache)
    msg = str(exc.value)
    assert "t.yaml: dataset.root: " in msg and str(src) in msg, msg
    if damage != "truncated":
        assert "member test/dog/1.png" in msg, msg


@pytest.mark.parametrize(
    ("overrides", "text"),
    [
        (  # a ring node combines itself and 2 neighbours
            ["defence={rule: multikrum, f: 1}"],
            "multikrum needs n >= 2f + 3 inputs (n = 3, f = 1): node a combines "
            "at most 3 states (itself and 2 neighbours)",
        ),
        (
            ["algorithm.name=fedavg", "algorithm.params={}", "defence={rule: bulyan, f: 1}"],
            "bulyan needs n >= 4f + 3 inputs (n = 4, f = 1): the aggregator "
            "combines at most 4 uploads",
        ),
        (
            ["edges=full", "defence={rule: trimmed_mean, beta: 0.1}"],
            "trimmed_mean with beta = 0.1 trims nothing from n = 4 inputs (f = 1)",
        ),
        (
            ["algorithm.name=dispfl", "algorithm.params={}", "defence={rule: median}"],
            "dispfl combines with mean, clip, centered_clip, multikrum only, not median",
        ),
        (
            ["algorithm.name=fedsa", "algorithm.params={}", "defence={rule: trimmed_mean}"],
            "fedsa combines with mean, clip, centered_clip, multikrum only, not trimmed_mean",
        ),
    ],
)
def test_a_defence_rule_that_cannot_hold_names_the_rule_n_and_f(overrides, text):
    with pytest.raises(ConfigError) as exc:
        check_inputs(_cfg(overrides), source="synthetic.yaml")
    assert "synthetic.yaml: defence.rule: " in str(exc.value), str(exc.value)
    assert text in str(exc.value), str(exc.value)


def test_a_defence_rule_that_holds_passes():
    check_inputs(_cfg(["edges=full", "defence={rule: trimmed_mean, beta: 0.25}"]))
    check_inputs(_cfg(["algorithm.name=fedavg", "algorithm.params={}", "defence={rule: median}"]))


@pytest.mark.parametrize(
    ("overrides", "text"),
    [
        (
            [
                "algorithm.name=fedavg",
                "algorithm.params={}",
                "security.sign=true",
                "transfer.compress=topk(0.1)",
            ],
            "topk(0.1) is lossy and security.audit recomputes each aggregate bit for bit",
        ),
        (
            [
                "algorithm.name=fedavg",
                "algorithm.params={}",
                "security.sign=true",
                "transfer.compress=int8",
            ],
            "int8 is lossy and security.audit recomputes each aggregate bit for bit",
        ),
    ],
)
def test_a_compression_the_swarm_cannot_run_names_transfer_compress(overrides, text):
    with pytest.raises(ConfigError) as exc:
        check_inputs(_cfg(overrides), source="synthetic.yaml")
    assert "synthetic.yaml: transfer.compress: " in str(exc.value), str(exc.value)
    assert text in str(exc.value), str(exc.value)


def test_compressions_the_swarm_can_run_pass():
    check_inputs(_cfg(["transfer.compress=int8"]))
    check_inputs(_cfg(["transfer.compress=fp16", "security.sign=true"]))  # decentralized
    fedavg = ["algorithm.name=fedavg", "algorithm.params={}", "transfer.compress=int8"]
    check_inputs(_cfg(fedavg))
    check_inputs(_cfg([*fedavg, "security.sign=true", "security.audit=false"]))
    # top-k: the pull names the receiver's base (docs/wire.md, "Compression")
    check_inputs(_cfg(["transfer.compress=topk(0.1)"]))
    check_inputs(_cfg(["transfer.compress=topk(1)", "security.sign=true"]))  # decentralized
    topk = ["algorithm.name=fedavg", "algorithm.params={}", "transfer.compress=topk(0.25)"]
    check_inputs(_cfg(topk))
    check_inputs(_cfg([*topk, "security.sign=true", "security.audit=false"]))
