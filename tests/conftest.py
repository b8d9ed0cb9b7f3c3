"""Shared fixtures: a real Mosquitto broker on a free loopback port."""

from __future__ import annotations

import shutil

import pytest

from p2pfl.broker import MosquittoBroker


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
