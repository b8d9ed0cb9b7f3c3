"""The ``privacy:`` section: its errors name the field, preflight refuses what cannot work,
and a topology without it dumps and fingerprints exactly as before the section existed."""

from __future__ import annotations

import hashlib
import json

import pytest

from p2pfl.config.load import ConfigError, dump_topology, load_topology
from p2pfl.config.preflight import check_inputs
from p2pfl.node.checkpoint import config_fingerprint

TOPOLOGY = "topologies/synthetic.yaml"


def _cfg(overrides):
    return load_topology(TOPOLOGY, overrides)


@pytest.mark.parametrize(
    ("override", "text"),
    [
        ("privacy={dp: {max_grad_norm: 1.0}}", "privacy.dp: give noise_multiplier"),
        (
            "privacy={dp: {noise_multiplier: 1.0, target_epsilon: 4}}",
            "privacy.dp: give noise_multiplier or target_epsilon (exactly one",
        ),
        ("privacy={dp: {noise_multiplier: 0}}", "privacy.dp.noise_multiplier: Input should be"),
        ("privacy={dp: {target_epsilon: -1}}", "privacy.dp.target_epsilon: Input should be"),
        ("privacy={dp: {noise_multiplier: 1, max_grad_norm: 0}}", "privacy.dp.max_grad_norm"),
        ("privacy={dp: {noise_multiplier: 1, delta: 1.5}}", "privacy.dp.delta: Input should be"),
        ("privacy={dp: {noise_multiplier: 1, accountant: gdp}}", "privacy.dp.accountant"),
        ("privacy={dp: {noise_multiplier: 1, rounds: 2}}", "rounds: only with target_epsilon"),
        ("privacy={dp: {noise_multiplier: 1, sigma: 2}}", "privacy.dp.sigma: unknown field"),
        ("privacy={dpsgd: {}}", "privacy.dpsgd: unknown field"),
    ],
)
def test_errors_name_the_field(override, text):
    with pytest.raises(ConfigError) as exc:
        _cfg([override])
    assert text in str(exc.value) and TOPOLOGY in str(exc.value), str(exc.value)


def test_a_dp_section_loads_with_defaults():
    cfg = _cfg(["privacy.dp.noise_multiplier=1.1"])
    dp = cfg.dp
    assert dp is not None and dp.noise_multiplier == 1.1 and dp.target_epsilon is None
    assert (dp.max_grad_norm, dp.delta, dp.accountant, dp.rounds) == (1.0, 1e-5, "rdp", None)
    assert "privacy:" in dump_topology(cfg)
    assert _cfg(["privacy={}"]).dp is None  # an empty section: DP off


def test_without_privacy_the_dump_and_fingerprint_are_unchanged():
    cfg = _cfg([])
    assert cfg.dp is None
    assert "privacy" not in dump_topology(cfg)
    # the fingerprint as it was computed before the section existed
    data = cfg.model_dump(mode="json", exclude={"broker", "timing", "security", "privacy"})
    data.get("dataset", {}).pop("root", None)
    text = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
    assert config_fingerprint(cfg) == hashlib.sha256(text.encode()).hexdigest()[:32]
    assert config_fingerprint(_cfg(["privacy.dp.noise_multiplier=1"])) != config_fingerprint(cfg)


@pytest.mark.parametrize(
    ("overrides", "field", "text"),
    [
        (
            ["algorithm.name=pfedc", "algorithm.params={}", "privacy.dp.noise_multiplier=1"],
            "privacy.dp",
            "pfedc trains with its own loss over the whole batch (loss_fn)",
        ),
        (
            ["privacy.dp.target_epsilon=0.01"],
            "privacy.dp.target_epsilon",
            "0.01 is below 0.103, the least ε the rdp accountant certifies for delta 1e-05",
        ),
    ],
)
def test_preflight_refuses_what_cannot_work(overrides, field, text):
    with pytest.raises(ConfigError) as exc:
        check_inputs(_cfg(overrides), source="t.yaml")
    assert f"t.yaml: {field}: " in str(exc.value) and text in str(exc.value), str(exc.value)


@pytest.mark.parametrize("method", ["uapdfl", "fedavg", "dfedavgm", "dispfl", "local"])
def test_preflight_passes_dp_for_the_methods(method):
    check_inputs(
        _cfg([f"algorithm.name={method}", "algorithm.params={}", "privacy.dp.target_epsilon=4"])
    )
