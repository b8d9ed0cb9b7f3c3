"""``privacy.secagg``: its knobs load with their defaults, bad values name the field, and
preflight refuses, naming the field and why, every setting that reads individual uploads."""

from __future__ import annotations

import pytest

from p2pfl.check.load import load_topology
from p2pfl.check.preflight import check_inputs
from p2pfl.errors import ConfigError

TOPOLOGY = "topologies/synthetic.yaml"
SECAGG = ["privacy.secagg=true", "defence.rule=mean"]


def _cfg(overrides):
    return load_topology(TOPOLOGY, overrides)


def test_defaults_and_field_errors():
    cfg = _cfg(["privacy.secagg=true"])
    assert cfg.privacy is not None and cfg.privacy.secagg
    assert (cfg.privacy.secagg_neighbours, cfg.privacy.secagg_threshold) == (None, 0.6)
    assert _cfg([]).privacy is None
    for override, text in [
        ("privacy.secagg_threshold=0", "privacy.secagg_threshold: Input should be"),
        ("privacy.secagg_threshold=1.5", "privacy.secagg_threshold: Input should be"),
        ("privacy.secagg_neighbours=1", "privacy.secagg_neighbours: Input should be"),
    ]:
        with pytest.raises(ConfigError) as exc:
            _cfg([override])
        assert text in str(exc.value), str(exc.value)


@pytest.mark.parametrize(
    ("overrides", "field", "text"),
    [
        (
            ["algorithm.name=uapdfl", "algorithm.params={}"],
            "privacy.secagg",
            "uapdfl is decentralized",
        ),
        (
            ["algorithm.name=dfedavgm", "algorithm.params={}"],
            "privacy.secagg",
            "dfedavgm is decentralized",
        ),
        (["algorithm.name=fedsa", "algorithm.params={}"], "privacy.secagg", "dispersion split"),
        (["algorithm.name=criticalfl", "algorithm.params={}"], "privacy.secagg", "gradient norm"),
        (
            ["algorithm.name=diversifed", "algorithm.params={}"],
            "privacy.secagg",
            "pairwise distances",
        ),
        (["algorithm.name=pfedc", "algorithm.params={}"], "privacy.secagg", "clustering"),
        (["defence.rule=median"], "defence.rule", "median screens or combines individual"),
        (["defence.rule=multikrum"], "defence.rule", "set defence.rule: mean"),
        (["defence.rule=trimmed_mean"], "defence.rule", "set defence.rule: mean"),
        (["defence.rule=clip"], "defence.rule", "clip screens"),
        (["security.sign=true"], "security.audit", "set security.audit: false"),
        (["timing.quorum=0.5"], "timing.quorum", "late upload"),
        (["transfer.compress=fp16"], "transfer.compress", "cannot be compressed"),
        (["algorithm.params.fraction=0.25"], "algorithm.params.fraction", "at least 3"),
    ],
)
def test_preflight_refuses_what_reads_individual_uploads(overrides, field, text):
    base = ["algorithm.name=fedavg", "algorithm.params={}", *SECAGG]
    with pytest.raises(ConfigError) as exc:
        check_inputs(_cfg([*base, *overrides]), source="t.yaml")
    assert f"t.yaml: {field}: " in str(exc.value) and text in str(exc.value), str(exc.value)


@pytest.mark.parametrize("method", ["fedavg", "fedper"])
def test_preflight_passes_the_sum_based_methods(method):
    check_inputs(_cfg([f"algorithm.name={method}", "algorithm.params={}", *SECAGG]))
    check_inputs(  # signed, with the audit off
        _cfg(
            [
                f"algorithm.name={method}",
                "algorithm.params={}",
                *SECAGG,
                "security.sign=true",
                "security.audit=false",
                "privacy.secagg_neighbours=4",
            ]
        )
    )


def test_without_secagg_the_dump_is_as_before(tmp_path):
    from p2pfl.config.schema import dump_topology

    assert "secagg" not in dump_topology(_cfg(["privacy.dp.noise_multiplier=1"]))
    cfg = _cfg(["privacy.secagg=true", "privacy.secagg_neighbours=4"])
    text = dump_topology(cfg)
    assert "secagg: true" in text and "secagg_neighbours: 4" in text
    (tmp_path / "t.yaml").write_text(text)
    assert load_topology(tmp_path / "t.yaml").privacy == cfg.privacy


FEDAVG = ["algorithm.name=fedavg", "algorithm.params={}"]


def test_an_unset_rule_defaults_to_mean_under_secagg_and_says_so(tmp_path, capsys):
    from p2pfl.check.checked import check_topology
    from p2pfl.cli import main

    cfg = _cfg([*FEDAVG, "privacy.secagg=true"])  # the one switch, no defence section
    assert cfg.defence.rule == "mean" and cfg.defaulted_rule == "mean"
    checked = check_topology(cfg, "t.yaml")  # passes every check, the secagg one included
    assert len(checked.notes) == 1 and "defence.rule: not set, so mean" in checked.notes[0]
    args = ["validate", TOPOLOGY, "--no-data", *(f"--set={o}" for o in FEDAVG)]
    assert main([*args, "--set", "privacy.secagg=true"]) == 0
    out = capsys.readouterr().err
    assert out.count("defence.rule: not set, so mean") == 1, out
    # the run's config.yaml records the rule, so its node processes say nothing more
    from p2pfl.config.schema import dump_topology

    (tmp_path / "config.yaml").write_text(dump_topology(cfg))
    recorded = check_topology(load_topology(tmp_path / "config.yaml"), "config.yaml")
    assert recorded.cfg.defence.rule == "mean" and recorded.notes == []


def test_an_explicit_rule_is_kept_and_refused_under_secagg():
    cfg = _cfg([*FEDAVG, "privacy.secagg=true", "defence.rule=clip"])
    assert cfg.defence.rule == "clip" and cfg.defaulted_rule is None
    with pytest.raises(ConfigError, match="defence.rule: clip screens or combines individual"):
        check_inputs(cfg, source="t.yaml")
    explicit = _cfg([*FEDAVG, "privacy.secagg=true", "defence.rule=mean"])
    assert explicit.defaulted_rule is None  # set by the user: no note
    from p2pfl.check.checked import default_notes

    assert default_notes(explicit) == []


@pytest.mark.parametrize("overrides", [[], ["privacy.dp.noise_multiplier=1"], ["defence.f=2"]])
def test_without_secagg_the_rule_default_is_unchanged(overrides):
    cfg = _cfg(overrides)
    assert cfg.defence.rule == "centered_clip" and cfg.defaulted_rule is None
    assert "rule" not in cfg.defence.model_fields_set
