"""Every error p2pfl raises on purpose derives from :class:`p2pfl.errors.P2PFLError`, and
keeps the built-in base it always had, so ``except ValueError`` code keeps working."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import p2pfl
from p2pfl.errors import P2PFLError


def public_exceptions() -> dict[str, type[BaseException]]:
    """``{module.Name: class}`` for every public exception class defined in p2pfl."""
    found = {}
    for info in pkgutil.walk_packages(p2pfl.__path__, prefix="p2pfl."):
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if (
                inspect.isclass(obj)
                and issubclass(obj, BaseException)
                and obj.__module__ == module.__name__
                and not name.startswith("_")
            ):
                found[f"{module.__name__}.{name}"] = obj
    return found


EXCEPTIONS = public_exceptions()


def test_the_known_errors_are_found():
    assert {
        "p2pfl.errors.P2PFLError",
        "p2pfl.errors.ConfigError",
        "p2pfl.wire.untrusted.CodecError",
        "p2pfl.wire.errors.TransportError",
        "p2pfl.launch.broker.BrokerError",
        "p2pfl.security.certs.CertError",
    } <= set(EXCEPTIONS)


@pytest.mark.parametrize("name", sorted(EXCEPTIONS))
def test_every_public_exception_derives_from_p2pflerror(name):
    assert issubclass(EXCEPTIONS[name], P2PFLError), f"{name} does not derive from P2PFLError"


@pytest.mark.parametrize(
    "name, builtin",
    [
        ("p2pfl.errors.ConfigError", ValueError),
        ("p2pfl.wire.untrusted.CodecError", ValueError),
        ("p2pfl.wire.errors.TransportError", RuntimeError),
        ("p2pfl.launch.broker.BrokerError", RuntimeError),
        ("p2pfl.security.certs.CertError", ValueError),
    ],
)
def test_errors_keep_their_builtin_base(name, builtin):
    assert issubclass(EXCEPTIONS[name], builtin)
