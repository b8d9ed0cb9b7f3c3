"""Shared fixtures: a real Mosquitto broker on a free loopback port; the scripts in
``scripts/`` loaded as modules."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest

from p2pfl.launch.broker import MosquittoBroker


def _have_mosquitto() -> bool:
    return shutil.which("mosquitto") is not None or shutil.os.path.exists("/usr/sbin/mosquitto")


@pytest.fixture
def broker(tmp_path):
    """A private Mosquitto instance for one test (never a system service)."""
    if not _have_mosquitto():
        pytest.fail("mosquitto is not installed: apt-get install -y mosquitto")
    b = MosquittoBroker(workdir=tmp_path / "broker").start()
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
