"""The one base class of p2pfl's errors.

Each error class lives in the module that raises it and derives from :class:`P2PFLError`
and, where it always did, from ``ValueError`` or ``RuntimeError``, so existing
``except ValueError`` code keeps working: ``ConfigError`` (here: the checks, the data a node
loads, the method it builds, its wiring and a site's files all raise it),
``CodecError`` (:mod:`p2pfl.wire.codec`), ``TransportError`` (:mod:`p2pfl.wire.errors`, raised by both lanes),
``BrokerError`` (:mod:`p2pfl.launch.broker`), ``CertError`` (:mod:`p2pfl.security.certs`),
``TrackerError`` (:mod:`p2pfl.launch.tracker`).
"""

from __future__ import annotations


class P2PFLError(Exception):
    """The base of every error p2pfl raises on purpose; catch it to handle any of them."""


class ConfigError(P2PFLError, ValueError):
    """A configuration problem; ``errors`` holds one ``(location, message)`` per problem:
    the field to fix and what is wrong with it, shown after ``source`` (the file, or the
    command's argument, the configuration came from)."""

    def __init__(self, source: str, errors: list[tuple[str, str]]):
        self.source = source
        self.errors = errors
        lines = [f"{source}: {loc}: {msg}" if loc else f"{source}: {msg}" for loc, msg in errors]
        super().__init__("\n".join(lines))
