"""The one base class of p2pfl's errors.

Each error class lives in the module that raises it and derives from :class:`P2PFLError`
and, where it always did, from ``ValueError`` or ``RuntimeError``, so existing
``except ValueError`` code keeps working: ``ConfigError`` (:mod:`p2pfl.check.load`),
``CodecError`` (:mod:`p2pfl.wire.codec`), ``TransportError`` (:mod:`p2pfl.wire.errors`, raised by both lanes),
``BrokerError`` (:mod:`p2pfl.launch.broker`), ``CertError`` (:mod:`p2pfl.security.certs`),
``TrackerError`` (:mod:`p2pfl.launch.tracker`).
"""

from __future__ import annotations


class P2PFLError(Exception):
    """The base of every error p2pfl raises on purpose; catch it to handle any of them."""
