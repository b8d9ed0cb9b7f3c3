"""The ``privacy:`` section: its errors name the field, preflight refuses what cannot work,
and a topology without it dumps and fingerprints exactly as before the section existed."""

from __future__ import annotations

import hashlib
import json

import pytest

from p2pfl.check.load import load_topology
from p2pfl.check.preflight import check_inputs
from p2pfl.config.schema import dump_topology
from p2pfl.errors import ConfigError
from p2pfl.services.checkpoint import config_fingerprint

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
        ("privacy={dp: {level: node, noise_multiplier: 1}}", "privacy.dp.level: Input should"),
        (
            "privacy={dp: {level: update, noise_multiplier: 1, max_grad_norm: 2}}",
            "privacy.dp.max_grad_norm: DP-SGD's per-sample bound, unused under level: update",
        ),
        (
            "privacy={dp: {noise_multiplier: 1, max_update_norm: 2}}",
            "privacy.dp.max_update_norm: the bound of level: update, unused by DP-SGD",
        ),
        (
            "privacy={dp: {level: update, noise_multiplier: 1, max_update_norm: 0}}",
            "privacy.dp.max_update_norm: Input should be greater than 0",
        ),
        (
            "privacy={dp: {level: update, noise_multiplier: 1, accountant: prv}}",
            "privacy.dp.accountant: prv is Opacus's DP-SGD accountant",
        ),
        (
            "privacy={dp: {noise_multiplier: 1, accountant: analytic}}",
            "privacy.dp.accountant: analytic composes level: update's Gaussian releases",
        ),
        ("privacy={dp: {level: update, max_update_norm: 2}}", "privacy.dp: give noise_multiplier"),
        (
            "privacy={dp: {noise_multiplier: 1, max_physical_batch: 0}}",
            "privacy.dp.max_physical_batch: Input should be greater than or equal to 1",
        ),
        (
            "privacy={dp: {level: update, noise_multiplier: 1, max_physical_batch: 16}}",
            "privacy.dp.max_physical_batch: DP-SGD's per-sample gradient memory bound, unused",
        ),
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


def test_an_update_level_section_loads_with_defaults():
    cfg = _cfg(["privacy={dp: {level: update, target_epsilon: 4}}"])
    dp = cfg.dp
    assert dp is not None and dp.level == "update" and dp.target_epsilon == 4
    assert (dp.max_update_norm, dp.delta, dp.accountant, dp.rounds) == (1.0, 1e-5, "rdp", None)
    again = _cfg(
        [
            "privacy.dp.max_update_norm=0.5",
            "privacy.dp.level=update",
            "privacy.dp.noise_multiplier=1",
        ]
    )
    assert again.dp.max_update_norm == 0.5  # the override order does not matter
    assert _cfg(["privacy.dp.noise_multiplier=1"]).dp.level == "sample"


@pytest.mark.parametrize("level", ["sample", "update"])
def test_a_dump_holds_its_levels_bound_and_loads_again(tmp_path, level):
    cfg = _cfg([f"privacy={{dp: {{level: {level}, noise_multiplier: 1}}}}"])
    path = tmp_path / "t.yaml"
    path.write_text(dump_topology(cfg))
    again = load_topology(str(path), [])
    assert again.dp == cfg.dp
    dp = cfg.dump()["privacy"]["dp"]
    if level == "sample":  # DP-SGD's dump, fingerprint included, as before levels existed
        assert "level" not in dp and "max_update_norm" not in dp and dp["max_grad_norm"] == 1
    else:
        assert dp["level"] == "update" and "max_grad_norm" not in dp
    assert "max_physical_batch" not in dp  # the default: as before the bound existed


def test_a_physical_batch_is_dumped_when_set_and_loads_again(tmp_path):
    assert _cfg(["privacy.dp.noise_multiplier=1"]).dp.max_physical_batch == 128
    cfg = _cfg(["privacy={dp: {noise_multiplier: 1, max_physical_batch: 16}}"])
    assert cfg.dump()["privacy"]["dp"]["max_physical_batch"] == 16
    path = tmp_path / "t.yaml"
    path.write_text(dump_topology(cfg))
    assert load_topology(str(path), []).dp == cfg.dp


def test_without_privacy_the_dump_and_fingerprint_are_unchanged():
    cfg = _cfg([])
    assert cfg.dp is None
    assert "privacy" not in dump_topology(cfg)
    # the fingerprint as it was computed before the section (and code_dir, evaluation,
    # training.loss, .steps, .optimizer_state, dataset.test_root and .targets, defence.spread)
    # existed
    data = cfg.model_dump(
        mode="json", exclude={"broker", "timing", "security", "privacy", "code_dir", "evaluation"}
    )
    data.get("dataset", {}).pop("root", None)
    for section, name in (
        ("training", "loss"),
        ("training", "steps"),
        ("training", "optimizer_state"),
        ("dataset", "test_root"),
        ("dataset", "targets"),
        ("defence", "spread"),
        ("defence", "radius"),
    ):
        data[section].pop(name)
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


@pytest.mark.parametrize(
    ("overrides", "field", "text"),
    [
        (
            ["algorithm.name=criticalfl", "algorithm.params={}"],
            "privacy.dp.level",
            "criticalfl reports lr·Σ‖g‖² of its raw local training",
        ),
        (
            ["algorithm.name=dispfl", "algorithm.params={}"],  # regrow: grad by default
            "algorithm.params.regrow",
            "grad regrows the mask the node serves by the raw gradients",
        ),
        (
            ["privacy.dp.target_epsilon=0.001"],
            "privacy.dp.target_epsilon",
            "0.001 is below 0.00351, the least ε the rdp accountant certifies for delta 1e-05 "
            "even for one release",
        ),
    ],
)
def test_preflight_refuses_what_update_level_cannot_cover(overrides, field, text):
    update = ["privacy.dp.level=update", "privacy.dp.noise_multiplier=1"]
    if any("target_epsilon" in o for o in overrides):
        update = ["privacy.dp.level=update"]
    with pytest.raises(ConfigError) as exc:
        check_inputs(_cfg([*update, *overrides]), source="t.yaml")
    assert f"t.yaml: {field}: " in str(exc.value) and text in str(exc.value), str(exc.value)


@pytest.mark.parametrize(
    ("method", "params"),
    [("uapdfl", "{}"), ("dispfl", "{regrow: random}"), ("fedavg", "{}"), ("pfedc", "{}")],
)
def test_preflight_passes_update_level_for_the_methods(method, params):
    check_inputs(
        _cfg(
            [
                f"algorithm.name={method}",
                f"algorithm.params={params}",
                "privacy={dp: {level: update, target_epsilon: 4}}",
            ]
        )
    )


@pytest.mark.parametrize("method", ["uapdfl", "fedavg", "dfedavgm", "dispfl", "local"])
def test_preflight_passes_dp_for_the_methods(method):
    check_inputs(
        _cfg([f"algorithm.name={method}", "algorithm.params={}", "privacy.dp.target_epsilon=4"])
    )
