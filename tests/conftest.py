"""Shared fixtures: a real broker on a free loopback port (Mosquitto and the embedded one,
each test that takes ``broker`` runs on both); the scripts in
``scripts/`` loaded as modules; a method instance on a small model (``make_method``)."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch

from p2pfl.algorithms import AlgorithmContext, Method, get_algorithm
from p2pfl.config.schema import ModelConfig
from p2pfl.launch.broker import BROKER_KINDS, have_mosquitto, make_broker
from p2pfl.learning.models import build_model

BROKERS = [k for k in BROKER_KINDS if k != "auto"]


@pytest.fixture(params=BROKERS)
def broker_kind(request) -> str:
    """Each broker p2pfl can start: ``mosquitto`` (which must be installed: CI installs it)
    and ``embedded``. A test taking it (or ``broker``) runs once on each."""
    if request.param == "mosquitto" and not have_mosquitto():
        pytest.fail("mosquitto is not installed: apt-get install -y mosquitto")
    return request.param


def pytest_collection_modifyitems(config, items):
    """A test marked ``one_broker`` runs on Mosquitto only: what it exercises is the node's
    own (its disk, its checkpoint), or a sibling parametrisation already runs the same broker
    path on both brokers. The mark keeps the suite short; it never hides a failure on the
    embedded broker of a broker-facing behaviour."""
    keep, drop = [], []
    for item in items:
        callspec = getattr(item, "callspec", None)
        kind = callspec.params.get("broker_kind") if callspec else None
        (drop if kind == "embedded" and item.get_closest_marker("one_broker") else keep).append(
            item
        )
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture
def broker(tmp_path, broker_kind):
    """A private broker of ``broker_kind`` for one test (never a system service)."""
    b = make_broker(broker_kind, workdir=tmp_path / "broker").start()
    try:
        yield b
    finally:
        b.stop()


SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def _load_script(name: str) -> ModuleType:
    """``scripts/<name>.py`` as a module (registered in ``sys.modules``, where pydantic
    resolves a script's model annotations)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def load_script():
    """A loader of ``scripts/<name>.py`` by name: ``load_script("bench_accuracy")``."""
    return _load_script


def _make_method(
    method: str | type[Method],
    params: dict[str, Any] | None = None,
    *,
    model: str = "mlp",
    hidden: int = 4,
    num_classes: int = 3,
    input_shape: tuple[int, ...] = (1, 4, 4),
    num_samples: int = 10,
    node_id: str = "n0",
    seed: int = 0,
    rng_seed: int | None = None,
    labels: Sequence[int] | None = None,
    total_rounds: int | None = None,
) -> Method:
    """A method (registered name or class) with ``params`` on a fresh ``model`` (torch's RNG
    seeded with ``seed`` first, then the method's ``adapt_model``, as every node of a swarm
    builds it), in an :class:`AlgorithmContext` whose ``rng`` is seeded with ``rng_seed``
    (default: ``seed``). ``labels`` go to ``set_labels``; ``total_rounds`` is set when given."""
    cls = get_algorithm(method) if isinstance(method, str) else method
    params = params or {}
    torch.manual_seed(seed)
    net = build_model(ModelConfig(name=model, hidden=hidden), num_classes, input_shape)
    net = cls.adapt_model(net, cls.Params.model_validate(params), num_classes)
    ctx = AlgorithmContext(
        node_id=node_id,
        model=net,
        num_samples=num_samples,
        num_classes=num_classes,
        input_shape=tuple(input_shape),
        rng=np.random.default_rng(seed if rng_seed is None else rng_seed),
    )
    alg = cls(params, ctx)
    if total_rounds is not None:
        alg.total_rounds = total_rounds
    if labels is not None:
        alg.set_labels(torch.tensor(labels))
    return alg


@pytest.fixture
def make_method():
    """The factory of method instances for tests: ``make_method("fedavg", {...},
    num_samples=2, node_id="me")`` (keywords: see :func:`_make_method`). A test module binds
    its own defaults with ``functools.partial`` in a ``make_alg`` fixture."""
    return _make_method
